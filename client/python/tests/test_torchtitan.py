"""ckptd.torchtitan: torchtitan's own Trainer and training loop checkpointing through a real ckptd.

Every test runs tests/torchtitan_worker.py, which is torchtitan's entry point
(torchtitan.train.main) with torchtitan's command line, on the CPU, with the llama3 debug
model: the switch is `--override.imports 'ckptd.torchtitan.ckptd_checkpoint={"job": ...}'`,
and the checkpoint options are torchtitan's own `--checkpoint.*`. A run killed with SIGKILL
resumes from ckptd and gives the uninterrupted run's loss at every step and its final model,
optimizer state and learning rates bit for bit: one process, and two pipeline-parallel ranks
under torchrun. The tokenizer (bytes) and the dataset (c4_test's format, from a JSON file)
are made here: torchtitan's wheel ships neither.
"""
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest
import torch

pytest.importorskip("torchtitan")

import torch.distributed.checkpoint as dcp  # noqa: E402

import ckptd  # noqa: E402
from ckptd.torch import CheckpointManager  # noqa: E402
from ckptd.dcp import CkptdStorageReader  # noqa: E402

from conftest import PYTHONPATH, Daemon, free_port, losses  # noqa: E402
from torchtitan_worker import export_digest  # noqa: E402

WORKER = "client/python/tests/torchtitan_worker.py"
STEPS = 12


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """A byte-level tokenizer (256 tokens and BOS/EOS; the debug model has 2048) and a
    c4_test-shaped dataset: {"text": ...} lines that torchtitan's HuggingFaceTextDataLoader
    reads with `datasets` and packs into sequences."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    root = tmp_path_factory.mktemp("titan")
    tokenizer_dir, data_dir = root / "tokenizer", root / "data"
    tokenizer_dir.mkdir()
    data_dir.mkdir()
    tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))},
                                     merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<|begin_of_text|>", "<|end_of_text|>"])
    tokenizer.save(str(tokenizer_dir / "tokenizer.json"))
    (tokenizer_dir / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}))
    rng = random.Random(0)
    words = "checkpoint daemon tensor shard commit restore step loss rank stage".split()
    with open(data_dir / "train.json", "w") as f:
        for _ in range(300):
            f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(rng.randint(4, 40)))}) + "\n")
    return {"tokenizer": str(tokenizer_dir), "data": str(data_dir), "cache": str(root / "hf-cache")}


def start(assets, dump, *checkpoint, job=None, socket_path=None, ranks=1, delay=0.0, steps=STEPS):
    """torchtitan's training of the debug model (seq_len 64, batch 2, `steps` steps) with
    torchtitan's `--checkpoint.*` options `checkpoint`; through ckptd when `job` is given
    (torchtitan's own DCP checkpointer otherwise). One process, or `ranks` under torchrun
    as pipeline stages."""
    titan = ["--module", "llama3", "--config", "llama3_debugmodel",
             "--hf_assets_path", assets["tokenizer"], "--dataloader.dataset_path", assets["data"],
             "--training.steps", str(steps), "--training.seq_len", "64", "--training.local_batch_size", "2",
             "--debug.seed", "0", "--dump_folder", str(dump), "--checkpoint.enable", *checkpoint,
             "--override.imports", "__main__.cpu_attention"]
    if job is not None:
        titan.append("ckptd.torchtitan.ckptd_checkpoint=" + json.dumps({"job": job, "socket": socket_path}))
    env = dict(os.environ, PYTHONPATH=PYTHONPATH, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1",
               HF_DATASETS_CACHE=assets["cache"], OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if ranks == 1:
        env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        command = [sys.executable, WORKER]
    else:
        titan += ["--parallelism.pipeline_parallel_degree", str(ranks), "--training.disable_cuda_graphs"]
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", WORKER]
    # stderr (warnings, torchrun's log) into a file: a pipe nobody reads while the test
    # follows stdout could fill and stop the run.
    log = tempfile.TemporaryFile(mode="w+")
    process = subprocess.Popen([*command, "--delay", str(delay), *titan], stdout=subprocess.PIPE,
                               stderr=log, text=True, env=env)
    process.log = log  # its stderr (Popen keeps no handle on a file it was given)
    return process


def stderr_of(process):
    process.log.seek(0)
    return process.log.read()


def finish(process):
    out, _ = process.communicate(timeout=150)
    if process.returncode != 0:
        raise AssertionError(f"exit status {process.returncode}:\n{stderr_of(process)[-4000:]}")
    return out


def line(out, prefix):
    """The rest of the last line that starts with `prefix`."""
    return next(l[len(prefix) + 1:] for l in reversed(out.splitlines()) if l.startswith(prefix + " "))


def descendants(pid):
    """The processes under `pid`, from /proc (torchrun starts each rank in a session of its
    own, so the ranks are not in torchrun's process group)."""
    children = {}
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                children.setdefault(int(f.read().rsplit(")", 1)[1].split()[1]), []).append(int(entry))
        except (ValueError, OSError):
            continue
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_after(process, step, committed):
    """SIGKILLs the run (the process started, and under torchrun every rank it started) once
    it prints `step` and `committed()` holds; returns what it printed."""
    seen = []
    for text in process.stdout:
        seen.append(text)
        if text.startswith(f"step {step} "):
            deadline = time.monotonic() + 30
            while not committed() and time.monotonic() < deadline:
                time.sleep(0.05)
            for pid in [*descendants(process.pid), process.pid]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass  # a rank that had just ended
            break
    seen.extend(process.stdout)
    process.wait(timeout=60)
    assert process.returncode == -signal.SIGKILL
    return "".join(seen)


def steps_of(daemon, job, expected=None):
    """(step, flags) of every committed step of `job`, without "increment" (whether a step
    references an earlier one is the data's matter, not torchtitan's); waits up to 10 s for
    `expected` (retention deletes after the commit)."""
    deadline = time.monotonic() + 10
    while True:
        listed, errors = ckptd.list_checkpoints(daemon.socket, job)
        assert not errors
        found = [(c["step"], [f for f in c["flags"] if f != "increment"]) for c in listed]
        if expected is None or found == expected or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


@pytest.fixture(scope="module")
def reference(assets):
    """The uninterrupted run every resumed run must reproduce: 12 steps through ckptd (on a
    daemon of its own; saving changes no value)."""
    workdir = tempfile.mkdtemp(prefix="ckptd-py.", dir="/tmp")  # short: a socket path
    d = Daemon(workdir).start()
    try:
        out = finish(start(assets, os.path.join(workdir, "dump"), "--checkpoint.interval", "4",
                           job="reference", socket_path=d.socket))
    finally:
        d.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    expected = losses(out)
    assert sorted(expected) == list(range(1, STEPS + 1))
    return {"losses": expected, "weights": line(out, "weights"), "export": line(out, "export")}


def test_sigkill_and_resume_gives_the_uninterrupted_run(daemon, assets, reference, tmp_path):
    """torchtitan's loop, killed with SIGKILL at step 8, resumes from ckptd's newest step: the
    loss of every step and the final weights, optimizer state and learning rates are the
    uninterrupted run's (model, optimizers, LR schedulers, the data loader's position, the
    trainer's step and token count all come back). async_with_pinned_mem: ckptd's copy
    overlaps the next step."""
    options = ["--checkpoint.interval", "3", "--checkpoint.async_mode", "async_with_pinned_mem"]
    killed = start(assets, tmp_path / "dump", *options, job="run", socket_path=daemon.socket, delay=0.25)
    before = losses(kill_after(killed, 8, lambda: daemon.steps("run")))
    out = finish(start(assets, tmp_path / "dump", *options, job="run", socket_path=daemon.socket))
    restored = int(line(out, "resumed from step").split()[0])
    assert restored in (3, 6)  # the newest committed (6 may still be in flight at the kill)
    after = losses(out)
    assert sorted(after) == list(range(restored + 1, STEPS + 1))
    for step, loss in {**before, **after}.items():
        assert loss == reference["losses"][step], f"step {step}: {loss} != {reference['losses'][step]}"
    assert line(out, "weights") == reference["weights"]


def test_two_pipeline_stages_under_torchrun_resume_bit_exact(daemon, assets, tmp_path):
    """Two ranks under torchrun, pipeline parallel (Interleaved1F1B: two model parts per
    rank, torchtitan's model_parts), saving with async_mode=async: killed with SIGKILL,
    resumed, bit-exact against the uninterrupted run."""
    options = ["--checkpoint.interval", "4", "--checkpoint.async_mode", "async"]
    reference = finish(start(assets, tmp_path / "ref", *options, job="pp-ref", socket_path=daemon.socket, ranks=2))
    expected = losses(reference)
    assert sorted(expected) == list(range(1, STEPS + 1))
    killed = start(assets, tmp_path / "run", *options, job="pp", socket_path=daemon.socket, ranks=2, delay=0.25)
    before = losses(kill_after(killed, 9, lambda: daemon.steps("pp")))
    out = finish(start(assets, tmp_path / "run", *options, job="pp", socket_path=daemon.socket, ranks=2))
    restored = int(line(out, "resumed from step").split()[0])
    assert restored in (4, 8)
    after = losses(out)
    assert sorted(after) == list(range(restored + 1, STEPS + 1))
    for step, loss in {**before, **after}.items():
        assert loss == expected[step], f"step {step}: {loss} != {expected[step]}"
    assert line(out, "weights") == line(reference, "weights")
    # Each step of both ranks (the last is a full save: the debug config's
    # last_save_model_only is off).
    assert [(c["step"], c["world_size"]) for c in ckptd.list_checkpoints(daemon.socket, "pp")[0]] == [
        (4, 2), (8, 2), (12, 2)]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_interval_keep_latest_k_and_the_model_only_export(daemon, assets, reference, tmp_path):
    """--checkpoint.interval 2 saves steps 2, 4, ... 10 in ckptd, keep_latest_k 3 keeps the
    newest three, and the last step (12) is torchtitan's model-only export in export_dtype:
    the job 'keep-weights', under torchtitan's state-dict keys (the fused wqkv split into
    wq/wk/wv), equal bit for bit to the trained model cast to bfloat16. async_mode=disabled:
    each save returns committed. Then load_step 6 with load_only resumes that step and saves
    nothing."""
    options = ["--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "3",
               "--checkpoint.last_save_model_only", "--checkpoint.export_dtype", "bfloat16"]
    out = finish(start(assets, tmp_path / "dump", *options, job="keep", socket_path=daemon.socket))
    assert losses(out) == reference["losses"]
    kept = [(6, []), (8, []), (10, [])]
    assert steps_of(daemon, "keep", kept) == kept
    assert steps_of(daemon, "keep-weights") == [(12, ["weights-only"])]

    step = os.path.join(daemon.root, "keep-weights", "step-00000012")
    with open(os.path.join(step, "manifest.json")) as f:
        manifest = json.load(f)["tensors"]
    assert {"layers.0.attention.qkv_linear.wq.weight", "tok_embeddings.weight", "lm_head.weight"} <= set(manifest)
    assert not any("wqkv" in k or "_checkpoint_wrapped_module" in k for k in manifest)
    assert {t["dtype"] for t in manifest.values()} == {"BF16"}
    exported = {k: torch.empty(t["global_shape"], dtype=torch.bfloat16) for k, t in manifest.items()}
    dcp.load(exported, storage_reader=CkptdStorageReader(step))
    assert export_digest(exported) == line(out, "export") == reference["export"]

    again = finish(start(assets, tmp_path / "dump", *options, "--checkpoint.load_step", "6", "--checkpoint.load_only",
                         job="keep", socket_path=daemon.socket))
    assert line(again, "resumed from step").split()[0] == "6"
    assert losses(again) == {s: reference["losses"][s] for s in range(7, STEPS + 1)}
    assert steps_of(daemon, "keep") == kept and steps_of(daemon, "keep-weights") == [(12, ["weights-only"])]


def test_a_job_switches_from_torchtitans_dcp_checkpoints(workdir, assets, reference, tmp_path):
    """A job that checkpointed with torchtitan's own DCP checkpointer switches to ckptd with
    the same arguments plus the override: ckptd holds nothing of it, so it resumes from the
    newest DCP step in checkpoint.folder (torchtitan's own load), continues the trajectory
    exactly, and saves its next steps to ckptd. keep_latest_k 0 keeps them all, as in
    torchtitan, on a daemon that keeps only the newest one of other jobs."""
    daemon = Daemon(workdir, extra=["--keep-last", "1"]).start()
    try:
        options = ["--checkpoint.interval", "5", "--checkpoint.keep_latest_k", "0"]
        dcp_run = start(assets, tmp_path / "dump", *options, delay=0.25)
        folder = tmp_path / "dump" / "checkpoint"
        kill_after(dcp_run, 7, lambda: (folder / "step-5" / ".metadata").exists())
        # A job of a close name: not a misspelling to warn about while DCP's step loads.
        with CheckpointManager("swtich", torch.nn.Linear(2, 2), socket=daemon.socket) as other:
            other.save(1, blocking=True)
        switched = start(assets, tmp_path / "dump", *options, job="switch", socket_path=daemon.socket)
        out = finish(switched)
        assert "misspelt" not in stderr_of(switched)
        assert "resumed from step" not in out  # not from ckptd: from DCP's step 5
        assert losses(out) == {s: reference["losses"][s] for s in range(6, STEPS + 1)}
        assert line(out, "weights") == reference["weights"]
        assert steps_of(daemon, "switch") == [(10, []), (12, [])]
    finally:
        daemon.stop()

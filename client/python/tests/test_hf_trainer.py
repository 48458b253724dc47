"""ckptd.transformers.CkptdCallback: transformers.Trainer checkpointing through a real ckptd.

The end-to-end tests run tests/hf_worker.py (Trainer.train on a tiny GPT-2) in subprocesses:
a run killed with SIGKILL resumes with `resume_from_checkpoint=callback.resume_from(trainer)`
and gives the uninterrupted run's losses and final weights bit for bit.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # what transformers.Trainer runs on

from ckptd.torch import CheckpointError  # noqa: E402
from ckptd.transformers import CkptdCallback  # noqa: E402

from conftest import PYTHONPATH, finish, kill_after_commit, last_line, losses  # noqa: E402

WORKER = "client/python/tests/hf_worker.py"


def start(daemon, job, *args):
    return subprocess.Popen(
        [sys.executable, WORKER, "--socket", daemon.socket, "--job", job,
         "--dir", os.path.join(daemon.workdir, job), *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=dict(os.environ, PYTHONPATH=PYTHONPATH))


def test_sigkill_and_resume_gives_the_uninterrupted_run(daemon):
    """Killed mid-run, resumed through ckptd: every step's loss and the final weights,
    optimizer state and learning rate are the uninterrupted run's (model, optimizer, LR
    scheduler, RNG, step and data position all come back)."""
    common = ["--steps", "20", "--every", "5"]
    reference = finish(start(daemon, "reference", *common))
    expected = losses(reference)
    assert sorted(expected) == list(range(1, 21))

    before = losses(kill_after_commit(daemon, "resumed", start(daemon, "resumed", *common, "--delay", "0.15"), 13))
    out = finish(start(daemon, "resumed", *common, "--resume"))
    restored = int(last_line(out, "resumed").split()[2])
    assert restored in (5, 10)  # the newest committed step (10 may still be in flight at the kill)
    after = losses(out)
    assert sorted(after) == list(range(restored + 1, 21))
    for step, loss in {**before, **after}.items():
        assert loss == expected[step], f"step {step}: {loss} != {expected[step]}"
    assert last_line(out, "weights") == last_line(reference, "weights")
    assert last_line(out, "resume") == "folder gone"
    assert daemon.steps("resumed")[-1] == 20


def test_resume_mid_epoch_from_disk(daemon):
    """Step 5 is half-way through the first epoch (10 steps): the Trainer fast-forwards its
    data loader and restores the RNG after it; ckptd reads the step from disk after a restart."""
    common = ["--steps", "12", "--every", "5"]
    reference = finish(start(daemon, "first", *common))
    daemon.restart()
    out = finish(start(daemon, "first", *common, "--resume", "--resume-step", "5"))
    assert last_line(out, "resumed") == "from step 5 (disk)"
    # callback.restored outlives train() (it was None again).
    assert last_line(out, "after").startswith("train Restored(step=5, source='disk', bytes=")
    expected, after = losses(reference), losses(out)
    assert sorted(after) == list(range(6, 13))
    assert all(after[s] == expected[s] for s in after)
    assert last_line(out, "weights") == last_line(reference, "weights")


def tiny_trainer(daemon, tmp_path, callback, steps=4):
    transformers.set_seed(0)
    config = transformers.GPT2Config(vocab_size=32, n_positions=8, n_embd=8, n_layer=1, n_head=2)
    tokens = torch.randint(0, 32, (16, 8), generator=torch.Generator().manual_seed(0))
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=steps, save_strategy="no",
        report_to="none", use_cpu=True, disable_tqdm=True)
    return transformers.Trainer(model=transformers.GPT2LMHeadModel(config), args=args,
                                train_dataset=[{"input_ids": t, "labels": t} for t in tokens],
                                callbacks=[callback])


def test_what_a_step_holds(daemon, tmp_path):
    """The model under its own state-dict keys, the optimizer state under optim.*, and the
    Trainer's state (trainer_state.json's content, its RNG file) as train state."""
    callback = CkptdCallback("held", save_steps=2, socket=daemon.socket)
    trainer = tiny_trainer(daemon, tmp_path, callback)
    assert callback.resume_from(trainer) is None  # a new job: train() starts from scratch
    trainer.train(resume_from_checkpoint=None)
    assert daemon.steps("held") == [2, 4]
    with open(os.path.join(daemon.root, "held", "step-00000004", "manifest.json")) as f:
        manifest = json.load(f)
    names = set(manifest["tensors"])
    assert {"transformer.wte.weight", "transformer.h.0.attn.c_attn.weight",
            "optim.transformer.wte.weight.exp_avg"} <= names
    assert set(manifest["shards"][0]["train_state"]) >= {"extra.trainer_state", "extra.hf_rng", "lr_scheduler"}


def test_resume_without_ckptd_raises(workdir, tmp_path):
    callback = CkptdCallback("absent", save_steps=2, socket=os.path.join(workdir, "nobody.sock"),
                             daemon_timeout=0.2)
    with pytest.raises(CheckpointError, match="not reachable"):
        callback.resume_from(tiny_trainer(None, tmp_path, callback))

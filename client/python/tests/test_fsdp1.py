"""FSDP1 (FullyShardedDataParallel) through ckptd.torch: each original parameter is saved as
a flat shard under its own FQN, and a job resumes on the same and on other world sizes.

PyTorch 2 only (run_pytest.sh leaves this file out on Debian's 1.13, which cannot import
FSDP on Python 3.11). Each job is a few processes over gloo on the CPU (fsdp1_worker.py).
"""
import json
import os
import signal
import subprocess
import sys

import torch

from conftest import CKPTCTL, PYTHONPATH, free_port

WORKER = "client/python/tests/fsdp1_worker.py"

# Net in fsdp1_worker.py: the original parameters and their shapes, and which of them the
# root FSDP1 module's FlatParameter holds (the first Linear has its own).
SHAPES = {"body.0.weight": [9, 6], "body.0.bias": [9], "body.2.weight": [7, 9], "body.2.bias": [7],
          "body.4.weight": [5, 7], "body.4.bias": [5], "scale": [1]}


def manifest(daemon, job, step):
    with open(os.path.join(daemon.root, job, f"step-{step:08d}", "manifest.json")) as f:
        return json.load(f)


def equal_bits(a, b):
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))


def run_ranks(daemon, job, mode, layout, out, world=2):
    """Runs `world` ranks of fsdp1_worker.py; a save's ranks are killed with SIGKILL once
    they have written what they trained."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, PYTHONPATH=PYTHONPATH, RANK=str(rank), WORLD_SIZE=str(world),
                   LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen(
            [sys.executable, WORKER, "--socket", daemon.socket, "--job", job, "--mode", mode,
             "--layout", layout, "--out", out],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
    if mode == "save":
        for p in procs:
            line = p.stdout.readline()
            if line.strip() != "ready":
                p.kill()
                out_text, err = p.communicate(timeout=60)
                raise AssertionError(f"save rank exited {p.returncode}:\n{line}{out_text}\n{err}")
        for p in procs:
            p.send_signal(signal.SIGKILL)
            p.communicate(timeout=60)
        return
    for p in procs:
        out_text, err = p.communicate(timeout=300)
        assert p.returncode == 0, f"{mode} rank exited {p.returncode}:\n{out_text}\n{err}"


def check_loaded(workdir, losses=True):
    saved = torch.load(os.path.join(workdir, "saved.pt"))
    loaded = torch.load(os.path.join(workdir, "loaded.pt"))
    assert saved.keys() == loaded.keys()
    assert {f"optim.{fqn}.step" for fqn in SHAPES} <= saved.keys()
    for k in saved:
        assert equal_bits(saved[k], loaded[k]), k
    if losses:  # the same ranks train on from the restored state as from the saved one
        assert equal_bits(torch.load(os.path.join(workdir, "losses-save.pt")),
                          torch.load(os.path.join(workdir, "losses-load.pt")))


def test_fsdp1_saves_original_fqns_as_flat_shards_and_resumes_on_2_3_and_1_ranks(daemon, workdir):
    run_ranks(daemon, "fsdp1", "save", "fsdp1", workdir)
    tensors = manifest(daemon, "fsdp1", 3)["tensors"]
    assert not any("_flat_param" in k or "_fsdp_wrapped_module" in k for k in tensors)
    for fqn, shape in SHAPES.items():
        for key in (fqn, f"optim.{fqn}.exp_avg", f"optim.{fqn}.exp_avg_sq"):
            assert tensors[key]["global_shape"] == shape, key
            assert all("flat" in s for s in tensors[key]["shards"]), key
        assert tensors[f"optim.{fqn}.step"]["global_shape"] == []
    # The root FlatParameter holds scale (1), body.2.weight (63), body.2.bias (7), body.4.*
    # (35 + 5): 111 elements, 56 per rank. Rank 0 ends inside body.2.weight.
    weight = tensors["body.2.weight"]["shards"]
    assert sorted((s["rank"], s["flat"]) for s in weight) == [(0, [[0, 55]]), (1, [[55, 63]])]
    assert [s["rank"] for s in tensors["body.4.weight"]["shards"]] == [1]
    # Adam's step, one per FlatParameter, is under every parameter a rank holds some of.
    assert sorted(s["rank"] for s in tensors["optim.body.2.weight.step"]["shards"]) == [0, 1]

    # save_weights: the same flat shards, converted; ckptctl export makes whole tensors of them.
    weights = manifest(daemon, "fsdp1-weights", 3)["tensors"]
    assert {k: t["global_shape"] for k, t in weights.items()} == SHAPES
    assert all("flat" in s for t in weights.values() for s in t["shards"])
    out = os.path.join(workdir, "weights.safetensors")
    r = subprocess.run([CKPTCTL, "export", "--root", daemon.root, "--job", "fsdp1-weights", "3", out,
                        "--format", "safetensors"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    from safetensors.torch import load_file
    saved = torch.load(os.path.join(workdir, "saved.pt"))
    for fqn, t in load_file(out).items():
        assert equal_bits(t, saved[f"model.{fqn}"].to(torch.bfloat16)), fqn

    run_ranks(daemon, "fsdp1", "load", "fsdp1", workdir)  # from memory
    check_loaded(workdir)
    daemon.restart()  # from disk, on other world sizes: the flat ranges are cut anew
    for layout, world in (("fsdp1", 3), ("fsdp1", 1), ("plain", 1)):
        run_ranks(daemon, "fsdp1", "load", layout, workdir, world=world)
        check_loaded(workdir, losses=False)


def test_fsdp1_checkpoints_load_into_a_plain_model_and_fsdp2_and_back(daemon, workdir):
    # The keys are the original FQNs: FSDP1 with use_orig_params=True, a plain model and
    # FSDP2 read them; FSDP1 reads what FSDP2 saved.
    run_ranks(daemon, "orig", "save", "fsdp1-orig", workdir)
    tensors = manifest(daemon, "orig", 3)["tensors"]
    assert set(tensors) == ({*SHAPES} | {f"optim.{fqn}.{key}" for fqn in SHAPES
                                         for key in ("exp_avg", "exp_avg_sq", "step")})
    run_ranks(daemon, "orig", "load", "fsdp1-orig", workdir)
    check_loaded(workdir)
    run_ranks(daemon, "orig", "load", "plain", workdir, world=1)
    check_loaded(workdir, losses=False)
    for world in (2, 3):  # the same world size in another layout reads other ranks' flat shards
        run_ranks(daemon, "orig", "load", "fsdp2", workdir, world=world)
        check_loaded(workdir, losses=False)

    run_ranks(daemon, "from-fsdp2", "save", "fsdp2", workdir)
    for world in (2, 3):
        run_ranks(daemon, "from-fsdp2", "load", "fsdp1", workdir, world=world)
        check_loaded(workdir, losses=False)

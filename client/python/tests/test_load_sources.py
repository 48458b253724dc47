"""Loading from somewhere other than the job's own steps (issue 46 item 5): a step directory
copied elsewhere (`load(from_path=)`), another job of the same user through ckptd
(`load(from_job=)`), and a step that holds the model only (a seed checkpoint) loaded into a
manager with an optimizer. Real ckptd, both PyTorch lines.
"""
import json
import os
import shutil
import time
import warnings

import pytest
import torch

from ckptd.torch import CheckpointError, CheckpointManager
from conftest import shard_path


class Loader:
    def __init__(self):
        self.batch = 0

    def state_dict(self):
        return {"batch": self.batch}

    def load_state_dict(self, state):
        self.batch = state["batch"]


def make(seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    return model, optimizer, scheduler, Loader()


def train(model, optimizer, scheduler, loader, steps):
    for _ in range(steps):
        model(torch.randn(3, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        loader.batch += 1


def equal_state(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def step_dir(daemon, job, step):
    return os.path.join(daemon.root, job, f"step-{step:08d}")


def ckptd_warnings(record):
    return [str(w.message) for w in record if str(w.message).startswith("ckptd")]


@pytest.fixture
def saved(daemon):
    """Job path-src at step 5: model, Adam, StepLR, a loader, and the RNG state after."""
    model, optimizer, scheduler, loader = make(0)
    train(model, optimizer, scheduler, loader, 5)
    with CheckpointManager("path-src", model, optimizer, scheduler, extra_state={"loader": loader},
                           socket=daemon.socket) as manager:
        torch.manual_seed(11)
        manager.save(5, blocking=True)
        rng_after = torch.rand(2)
    return model, optimizer, scheduler, rng_after


def check_restored(saved, model, optimizer, scheduler, loader):
    src_model, src_optimizer, src_scheduler, rng_after = saved
    assert equal_state(model.state_dict(), src_model.state_dict())
    for p, q in zip(model.parameters(), src_model.parameters()):
        assert torch.equal(optimizer.state[p]["exp_avg"], src_optimizer.state[q]["exp_avg"])
    assert scheduler.state_dict() == src_scheduler.state_dict()
    assert loader.batch == 5
    assert torch.equal(torch.rand(2), rng_after)


def test_a_step_copied_elsewhere_loads_from_its_path_and_the_job_saves_on(daemon, workdir, saved):
    copy = os.path.join(workdir, "elsewhere", "step-00000005")
    shutil.copytree(step_dir(daemon, "path-src", 5), copy)
    # Also into another job's folder under ckptd's root: ckptd shows it as UNREADABLE (its
    # manifest names job path-src), and its files still load.
    shutil.copytree(step_dir(daemon, "path-src", 5), step_dir(daemon, "path-dst", 5))
    for job, where in (("path-new", copy), ("path-new-2", step_dir(daemon, "path-dst", 5))):
        model, optimizer, scheduler, loader = make(9)
        with CheckpointManager(job, model, optimizer, scheduler, extra_state={"loader": loader},
                               socket=daemon.socket) as manager:
            restored = manager.load(from_path=where)
            assert restored == 5 and restored.source == "path" and restored.bytes > 0
            check_restored(saved, model, optimizer, scheduler, loader)
            manager.save(6, blocking=True)  # the next save is this job's
    assert daemon.steps("path-new") == daemon.steps("path-new-2") == [6]
    model, optimizer, scheduler, loader = make(10)
    with CheckpointManager("path-new", model, optimizer, scheduler, extra_state={"loader": loader},
                           socket=daemon.socket) as manager:
        assert manager.load() == 6


def test_from_path_says_what_it_did_not_find(daemon, workdir, saved):
    model, optimizer, scheduler, loader = make(9)
    with CheckpointManager("path-new", model, optimizer, scheduler, extra_state={"loader": loader},
                           socket=daemon.socket) as manager:
        job_dir = os.path.join(daemon.root, "path-src")
        with pytest.raises(CheckpointError, match=r"not a step directory but a job's, holding step-00000005: "
                                                  r"name one of its steps"):
            manager.load(from_path=job_dir)
        with pytest.raises(CheckpointError, match=r"from_path=.*no-such'\): no such directory"):
            manager.load(from_path=os.path.join(workdir, "no-such"))
        empty = os.path.join(workdir, "step-00000007")
        os.makedirs(empty)
        with pytest.raises(CheckpointError, match=r"no manifest.json in it: not a committed ckptd step"):
            manager.load(from_path=empty)
        with pytest.raises(CheckpointError, match=r"the directory holds step 5, not 4"):
            manager.load(from_path=step_dir(daemon, "path-src", 5), step=4)
        # A model it does not fit: named, and nothing changed.
        bigger = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
        before = {k: v.clone() for k, v in bigger.state_dict().items()}
        with CheckpointManager("path-big", bigger, socket=daemon.socket) as big:
            with pytest.raises(CheckpointError, match=r"tensor 2.weight is \[2, 8\] in step 5, \[3, 8\] here"):
                big.load(from_path=step_dir(daemon, "path-src", 5), exclude=["optim.*"])
        assert equal_state(bigger.state_dict(), before)
    # A manifest edited by hand (a piece without its byte range): named, not a KeyError.
    edited = os.path.join(workdir, "edited", "step-00000005")
    shutil.copytree(step_dir(daemon, "path-src", 5), edited)
    with open(os.path.join(edited, "manifest.json")) as f:
        manifest = json.load(f)
    del manifest["tensors"]["0.weight"]["shards"][0]["data_offsets"]
    with open(os.path.join(edited, "manifest.json"), "w") as f:
        json.dump(manifest, f)
    model, optimizer, scheduler, loader = make(9)
    with CheckpointManager("path-bad", model, optimizer, scheduler, extra_state={"loader": loader},
                           socket=daemon.socket) as manager:
        with pytest.raises(CheckpointError, match=r"tensor 0\.weight: rank 0's piece is not well formed "
                                                  r"\(KeyError\('data_offsets'\)\)"):
            manager.load(from_path=edited)
    # A damaged copy: the checksum names it, nothing of that tensor is copied.
    damaged = os.path.join(workdir, "damaged", "step-00000005")
    shutil.copytree(step_dir(daemon, "path-src", 5), damaged)
    with open(shard_path(damaged, 0), "r+b") as f:
        header = int.from_bytes(f.read(8), "little")
        f.seek(8 + header)
        first = f.read(1)
        f.seek(8 + header)
        f.write(bytes([first[0] ^ 0xFF]))
    model, optimizer, scheduler, loader = make(9)
    with CheckpointManager("path-bad", model, optimizer, scheduler, extra_state={"loader": loader},
                           socket=daemon.socket) as manager:
        with pytest.raises(CheckpointError, match=r"rank-00000\.[0-9a-f]{16}\.safetensors: tensor .*: checksum mismatch"):
            manager.load(from_path=damaged)


def test_from_job_loads_another_job_of_the_user_and_leaves_it_alone(daemon, saved):
    model, optimizer, scheduler, loader = make(9)
    with CheckpointManager("warm", model, optimizer, scheduler, extra_state={"loader": loader},
                           keep_last=1, socket=daemon.socket) as manager:
        assert manager.load(from_job="path-src") == 5
        check_restored(saved, model, optimizer, scheduler, loader)
        manager.save(1, blocking=True)
        manager.save(2, blocking=True)  # keep_last=1 is this job's: the source keeps its steps
    deadline = time.monotonic() + 10  # retention runs after the commit
    while daemon.steps("warm") != [2] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert daemon.steps("warm") == [2]
    assert daemon.steps("path-src") == [5]
    with CheckpointManager("warm", *make(3)[:3], extra_state={"loader": Loader()},
                           socket=daemon.socket) as manager:
        assert manager.load() == 2


def test_from_job_names_what_it_did_not_find_and_claims_no_name(daemon, saved):
    model, optimizer, scheduler, loader = make(9)
    with CheckpointManager("warm", model, optimizer, scheduler, extra_state={"loader": loader},
                           socket=daemon.socket) as manager:
        with pytest.raises(CheckpointError, match=r"job 'path-scr' has no committed checkpoint on this node's "
                                                  r"ckptd .*; jobs that do: 'path-src'"):
            manager.load(from_job="path-scr")
        with pytest.raises(CheckpointError, match=r"job 'path-src' has no step 4; its committed steps: 5"):
            manager.load(from_job="path-src", step=4)
    assert not os.path.exists(os.path.join(daemon.root, "path-scr"))


def test_a_model_only_seed_checkpoint_starts_the_optimizer_fresh(daemon, workdir):
    seed_model = make(0)[0]
    with CheckpointManager("seeded", seed_model, socket=daemon.socket) as manager:
        manager.save(0, blocking=True)  # torchtitan's seed checkpoint: step 0, the model only
    model, optimizer, scheduler, loader = make(9)
    with CheckpointManager("seeded", model, optimizer, scheduler, extra_state={"loader": loader},
                           socket=daemon.socket) as manager:
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            assert manager.load() == 0
        said = ckptd_warnings(record)
        assert len(said) == 1, said
        assert "step 0 of job 'seeded' holds the model only" in said[0]
        assert "the optimizer (its state and hyper-parameters), the LR scheduler, extra_state['loader']" in said[0]
        assert equal_state(model.state_dict(), seed_model.state_dict())
        assert len(optimizer.state) == 0  # fresh: no state created by load() is left behind
        assert scheduler.last_epoch == 0 and optimizer.param_groups[0]["lr"] == 1e-2
        train(model, optimizer, scheduler, loader, 1)
        manager.save(1, blocking=True)
    # strict=False takes the same way; and so do a weights-only step and a copied seed step.
    for how in ({"strict": False}, {"from_job": "seeded-weights"},
                {"from_path": step_dir(daemon, "seeded", 0)}):
        if "from_job" in how:
            with CheckpointManager("seeded", seed_model, socket=daemon.socket) as weights:
                weights.save_weights(0)
        model, optimizer, scheduler, loader = make(9)
        with CheckpointManager("seeded-2", model, optimizer, scheduler, extra_state={"loader": loader},
                               socket=daemon.socket) as manager:
            if "strict" in how:
                manager.job = "seeded"  # its step 1 has the optimizer: load step 0
                how = {"strict": False, "step": 0}
            with warnings.catch_warnings(record=True) as record:
                warnings.simplefilter("always")
                assert manager.load(**how) == 0
            said = ckptd_warnings(record)
            assert len(said) == 1 and "holds the model only" in said[0], (how, said)
            assert equal_state(model.state_dict(), seed_model.state_dict())
            assert len(optimizer.state) == 0


def test_a_full_step_whose_optimizer_does_not_fit_is_still_refused(daemon):
    model, optimizer, scheduler, loader = make(0)
    train(model, optimizer, scheduler, loader, 2)
    with CheckpointManager("full", model, optimizer, socket=daemon.socket) as manager:
        manager.save(2, blocking=True)
    fresh = make(9)[0]
    # An optimizer over another set of parameters: its state is in the step, and does not fit.
    extra = torch.nn.Parameter(torch.zeros(3))
    other = torch.optim.Adam(list(fresh.parameters()) + [extra], lr=1e-2)
    with CheckpointManager("full", fresh, other, socket=daemon.socket) as manager:
        with pytest.raises(CheckpointError, match=r"does not match the registered tensors: 3 registered but "
                                                  r"not in the checkpoint \(optim\.group0\.param4\.exp_avg"):
            manager.load()

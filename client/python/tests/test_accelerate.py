"""ckptd.torch.CheckpointManager in a plain Accelerate loop: it takes the optimizer and
scheduler that `accelerator.prepare` returns (AcceleratedOptimizer, AcceleratedScheduler).

tests/accelerate_worker.py trains in a subprocess; a run killed with SIGKILL resumes with
`manager.load()` and gives the uninterrupted run's losses and final weights bit for bit.
Needs `accelerate` (the virtual environment's): run_pytest.sh leaves it out on Debian's
PyTorch 1.13.
"""
import os
import subprocess
import sys

import pytest
import torch

from ckptd.torch import CheckpointManager

from conftest import PYTHONPATH, finish, kill_after_commit, last_line, losses

accelerate = pytest.importorskip("accelerate")

WORKER = "client/python/tests/accelerate_worker.py"


def start(daemon, job, *args):
    return subprocess.Popen([sys.executable, WORKER, "--socket", daemon.socket, "--job", job, *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=PYTHONPATH))


def test_an_accelerate_loop_killed_and_resumed_gives_the_uninterrupted_run(daemon):
    common = ["--steps", "30", "--every", "5"]
    reference = finish(start(daemon, "reference", *common))
    expected = losses(reference)
    assert sorted(expected) == list(range(1, 31))

    before = losses(kill_after_commit(daemon, "resumed", start(daemon, "resumed", *common, "--delay", "0.1"), 17))
    out = finish(start(daemon, "resumed", *common))
    restored = int(last_line(out, "resumed").split()[2])
    assert restored in (10, 15)  # the newest committed step (15 may still be in flight at the kill)
    after = losses(out)
    assert sorted(after) == list(range(restored + 1, 31))
    for step, loss in {**before, **after}.items():
        assert loss == expected[step], f"step {step}: {loss} != {expected[step]}"
    assert last_line(out, "weights") == last_line(reference, "weights")
    assert daemon.steps("resumed")[-1] == 30


def test_prepared_objects_are_checkpointed_as_the_ones_they_wrap(daemon):
    """What goes in is the inner optimizer's and scheduler's state, under the usual keys, and
    the wrappers' steps wait for the snapshot as the plain ones do."""
    accelerator = accelerate.Accelerator(cpu=True)
    model = torch.nn.Linear(4, 2)
    inner = torch.optim.Adam(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(inner, step_size=1, gamma=0.5)
    model, optimizer, prepared_scheduler = accelerator.prepare(model, inner, scheduler)
    with CheckpointManager("prepared", model, optimizer, prepared_scheduler, socket=daemon.socket) as manager:
        assert manager.optimizer is inner and manager.lr_scheduler is scheduler
        model(torch.ones(3, 4)).sum().backward()
        optimizer.step()
        prepared_scheduler.step()
        manager.save(1, blocking=True)
        saved_lr = inner.param_groups[0]["lr"]
        saved = {k: v.clone() for k, v in inner.state[model.weight].items()}
        optimizer.step()  # changes the state: the load must bring step 1's back
        prepared_scheduler.step()
        assert manager.load() == 1
    assert inner.param_groups[0]["lr"] == saved_lr
    assert scheduler.last_epoch == 1
    for key, value in saved.items():
        assert torch.equal(inner.state[model.weight][key], value), key

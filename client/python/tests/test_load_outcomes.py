"""What load() says and keeps (issue 46 items 4 and 7): a job without a checkpoint is warned
about only when its name may be a misspelling of one of the user's jobs (once, by rank 0),
load(require=True) raises for a run that must resume, `manager.restored` is the Restored that
load() returned, a reshard is described in plain words, ckptctl export prints sizes people
read, and the first in-place load does not hold two copies of the state at once.

Real ckptd, PyTorch (Debian's 1.13 or 2.x).
"""
import gc
import os
import re
import subprocess
import warnings

import pytest
import torch

import ckptd

from ckptd.torch import CheckpointError, CheckpointManager, Restored

from conftest import CKPTCTL, ranks_in_threads


def saved(daemon, *jobs):
    for job in jobs:
        with CheckpointManager(job, torch.nn.Linear(4, 4), socket=daemon.socket) as manager:
            manager.save(1, blocking=True)


def test_a_new_job_is_not_warned_about_the_users_other_jobs(daemon):
    saved(daemon, "gpt", "llama3-8b", "run-1", "exp")
    for job in ("bert-base", "run-2", "llama3-70b", "exp2"):  # new jobs, some of a series
        with CheckpointManager(job, torch.nn.Linear(4, 4), socket=daemon.socket) as manager:
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                assert manager.load() is None
            assert manager.restored is None


def test_a_misspelt_job_is_warned_about_once_by_rank_0_naming_only_close_jobs(daemon):
    saved(daemon, "gpt2-small", "llama")

    def rank(r):
        with CheckpointManager("gpt2-smal", torch.nn.Linear(4, 4), socket=daemon.socket,
                               rank=r, world_size=2) as manager:
            assert manager.load() is None
            assert manager.load() is None  # and again: still said once

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert ranks_in_threads(rank, 2) == []
    said = [str(w.message) for w in seen if "gpt2-smal'" in str(w.message)]
    assert len(said) == 1, said
    assert "job 'gpt2-smal' has no checkpoint on this node; this user has checkpoints of 'gpt2-small'" in said[0]
    assert "llama" not in said[0] and "from scratch" not in said[0]
    assert "load(require=True) raises instead" in said[0]


def test_require_raises_naming_the_job_the_close_jobs_and_where_it_looked(daemon):
    saved(daemon, "gpt2-small")
    with CheckpointManager("gpt2-smal", torch.nn.Linear(4, 4), socket=daemon.socket) as manager:
        with pytest.raises(CheckpointError) as raised:
            manager.load(require=True)
    message = str(raised.value)
    assert f"cannot load job 'gpt2-smal': it has no checkpoint in the ckptd at {daemon.socket}" in message
    assert "this user's jobs with a similar name that do: 'gpt2-small' (a misspelt job name?)" in message
    with CheckpointManager("fresh", torch.nn.Linear(4, 4), socket=daemon.socket) as manager:
        with pytest.raises(CheckpointError, match="job 'fresh': it has no checkpoint in the ckptd") as raised:
            manager.load(require=True)
        assert "similar name" not in str(raised.value)
        # Nothing stays registered: the same manager loads and saves on.
        assert manager.load() is None
        assert manager.save(1, blocking=True)
    with CheckpointManager("fresh", torch.nn.Linear(4, 4), socket=daemon.socket) as manager:
        assert manager.load(require=True) == 1


def test_manager_restored_is_the_restored_that_load_returned(daemon):
    model = torch.nn.Linear(4, 4)
    with CheckpointManager("kept", model, socket=daemon.socket) as manager:
        assert manager.restored is None  # nothing loaded yet: no AttributeError
        manager.save(3, blocking=True)
    with CheckpointManager("kept", torch.nn.Linear(4, 4), socket=daemon.socket) as manager:
        restored = manager.load()
        assert isinstance(manager.restored, Restored) and manager.restored is restored
        assert restored == 3 and restored.source == "memory"
        assert restored["source"] == "memory" and restored["step"] == 3  # as when it was a dict
        with pytest.raises(KeyError):
            restored["path"]


class Loader:
    def __init__(self):
        self.position = 0

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


@pytest.mark.parametrize("saved_world, world, who", [
    (4, 2, "no rank loads the extra_state 'loader' that ranks 2-3 saved"),
    (3, 2, "no rank loads the extra_state 'loader' that rank 2 saved"),
    (1, 3, "ranks 1-2 get rank 0's extra_state 'loader'"),
])
def test_a_reshard_says_which_ranks_state_goes_where(daemon, saved_world, world, who):
    def save(r):
        with CheckpointManager("resharded", torch.nn.Linear(4, 4), extra_state={"loader": Loader()},
                               socket=daemon.socket, rank=r, world_size=saved_world) as manager:
            manager.save(1, blocking=True)

    def load(r):
        with CheckpointManager("resharded", torch.nn.Linear(4, 4), extra_state={"loader": Loader()},
                               socket=daemon.socket, rank=r, world_size=world) as manager:
            manager.load()

    assert ranks_in_threads(save, saved_world) == []
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert ranks_in_threads(load, world) == []
    said = [str(w.message) for w in seen if "was saved by" in str(w.message)]
    assert said == [f"ckptd: step 1 was saved by {saved_world} ranks and is loaded by {world}: {who}. "
                    "Give such an object a reshard_state_dict(state, saved_world_size, world_size, rank, "
                    "from_rank) method that returns the state to load, or leave it out with "
                    "exclude_from_loading."]


def test_export_of_a_small_model_prints_its_size(daemon, workdir):
    with CheckpointManager("small", torch.nn.Linear(64, 64), socket=daemon.socket) as manager:
        manager.save(1, blocking=True)
    out = subprocess.run([CKPTCTL, "export", "--root", daemon.root, "--job", "small", "1",
                          os.path.join(workdir, "hf"), "--format", "hf"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert re.search(r"exported step 1 of job small to .*: 2 tensors, 16\.2 KiB in \d+ files", out.stdout), out.stdout
    assert "0.00 GiB" not in out.stdout + out.stderr


def _rss_mib(field):
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"no {field} in /proc/self/status")


def test_the_first_load_moves_the_state_into_shared_memory_one_tensor_at_a_time(daemon, monkeypatch):
    """A model with its Adam state (156 MiB of it) loads in place: each tensor's storage
    moves into ckptd's shared memory and its old one is freed at once, so the process never
    holds both copies of the state (it held them all until the last). Tensors of 39 MiB, which
    the C library maps and unmaps on their own, so that what is freed leaves the RSS at once."""
    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(3200, 3200, bias=False) for _ in range(2)])
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        model(torch.randn(2, 3200)).sum().backward()
        optimizer.step()  # the state exists: the load creates none
        optimizer.zero_grad(set_to_none=True)
        return model, optimizer

    # Arenas in base pages: huge pages (where the machine has a pool, as tools/test.sh
    # reserves) do not count in VmRSS, and the copies in them would not be seen.
    connect = ckptd.connect
    monkeypatch.setattr(ckptd, "connect", lambda *args, **kwargs: connect(*args, **kwargs, huge_pages=False))
    model, optimizer = build()
    with CheckpointManager("rss", model, optimizer, socket=daemon.socket) as manager:
        manager.save(1, blocking=True)
    del model, optimizer, manager
    gc.collect()  # the first model's shared memory goes now, not in the middle of the load
    model, optimizer = build()
    state_mib = sum(t.numel() * t.element_size() for s in optimizer.state.values()
                    for t in s.values() if torch.is_tensor(t)) / 2**20
    assert state_mib >= 150
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # VmHWM (the peak) starts again from now
    before = _rss_mib("VmRSS")
    with CheckpointManager("rss", model, optimizer, socket=daemon.socket) as manager:
        assert manager.load() == 1
        peak = _rss_mib("VmHWM")
    # Both copies at once would be the whole state above what the process held before; one
    # tensor at a time, one tensor.
    assert peak - before < state_mib / 2, f"peak {peak:.0f} MiB, before the load {before:.0f} MiB"

"""load(from_dcp=) imports everything a DCP checkpoint holds for the manager, in the layouts
people save (issue 46 item 1): the DCP tutorial's {"app": AppState} with whatever the user
added beside model and optimizer (a scheduler as "sched", a data loader as "loader", RNG
states), torchtitan's (model keys at the top, "optimizer", "lr_scheduler", "dataloader",
"train_state"), and get_state_dict's flattened optimizer at the top; the rest is mapped with
from_dcp_keys, and what is not imported is named in one warning, or refused with strict=True
before anything is loaded.

PyTorch 2 only (DCP): run_pytest.sh leaves this file out on Debian's 1.13.
"""
import os
import random
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from ckptd.torch import CheckpointError, CheckpointManager

from conftest import same

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


class Loader:
    """A data loader's position, as stateful loaders keep it."""

    def __init__(self):
        self.epoch, self.batch = 0, 0

    def state_dict(self):
        return {"epoch": self.epoch, "batch": self.batch}

    def load_state_dict(self, state):
        self.epoch, self.batch = state["epoch"], state["batch"]


def warmup(optimizer):
    """Linear warm-up over 100 steps: the LR says which step the scheduler is at."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 100))


def make(seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, optimizer, warmup(optimizer), Loader()


def train(model, optimizer, scheduler, loader, steps):
    for _ in range(steps):
        model(torch.randn(3, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        loader.batch += 1


class AppState(Stateful):
    """The DCP tutorial's wrapper, with what a user adds beside model and optimizer."""

    def __init__(self, model, optimizer, scheduler, loader):
        self.model, self.optimizer, self.scheduler, self.loader = model, optimizer, scheduler, loader

    def state_dict(self):
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        return {"model": model_state, "optim": optim_state, "sched": self.scheduler.state_dict(),
                "loader": self.loader.state_dict(),
                "rng": {"torch": torch.get_rng_state(), "python": random.getstate()}}

    def load_state_dict(self, state):
        raise AssertionError("not called: ckptd reads the checkpoint")


def ckptd_warnings(record):
    return [str(w.message) for w in record if str(w.message).startswith("ckptd")]


def test_the_tutorial_layout_brings_back_scheduler_loader_and_rng(daemon, workdir):
    model, optimizer, scheduler, loader = make(0)
    train(model, optimizer, scheduler, loader, 31)
    path = os.path.join(workdir, "dcp", "step-31")
    random.seed(7)
    torch.manual_seed(7)
    dcp.save({"app": AppState(model, optimizer, scheduler, loader)}, checkpoint_id=path)
    after_save = (torch.rand(3), random.random())  # what the RNGs give next in the saving run

    fresh, fresh_optimizer, fresh_scheduler, fresh_loader = make(9)
    with CheckpointManager("tutorial", fresh, fresh_optimizer, fresh_scheduler,
                           extra_state={"dataloader": fresh_loader}, socket=daemon.socket) as manager:
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            assert manager.load(from_dcp=path) == 31
        assert ckptd_warnings(record) == []
        # The LR of step 31, not the warm-up's first.
        assert fresh_scheduler.get_last_lr() == scheduler.get_last_lr() == [1e-2 * 32 / 100]
        assert fresh_optimizer.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"]
        assert fresh_scheduler.last_epoch == 31
        assert fresh_loader.state_dict() == {"epoch": 0, "batch": 31}
        assert same(fresh.state_dict(), model.state_dict())
        assert same(fresh_optimizer.state_dict(), optimizer.state_dict())
        assert torch.equal(torch.rand(3), after_save[0]) and random.random() == after_save[1]
        manager.save(32, blocking=True)  # the next save is ckptd's


def torchtitan_state(model, optimizer, scheduler, loader, step):
    """torchtitan's layout: the model's keys at the top, the optimizer flattened, its
    scheduler container's {"last_epoch"}, the data loader, and its TrainState."""
    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    model_state, optim_state = get_state_dict(model, optimizer, options=flat)
    return {**model_state, "optimizer": optim_state, "lr_scheduler": {"last_epoch": scheduler.last_epoch},
            "dataloader": loader.state_dict(),
            "train_state": {"step": torch.tensor(step), "ntokens_seen": torch.tensor(step * 1024)}}


def test_the_torchtitan_layout_takes_its_step_from_train_state_and_names_the_rest(daemon, workdir):
    model, optimizer, scheduler, loader = make(0)
    train(model, optimizer, scheduler, loader, 31)
    path = os.path.join(workdir, "titan", "latest")  # no step in the name: train_state has it
    dcp.save(torchtitan_state(model, optimizer, scheduler, loader, 31), checkpoint_id=path)

    fresh, fresh_optimizer, fresh_scheduler, fresh_loader = make(9)
    with CheckpointManager("titan", fresh, fresh_optimizer, fresh_scheduler,
                           extra_state={"dataloader": fresh_loader}, socket=daemon.socket) as manager:
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            assert manager.load(from_dcp=path) == 31
        said = ckptd_warnings(record)
        assert len(said) == 1, said
        # Only what it has no place for: torchtitan's token count.
        assert "the checkpoint's train_state not imported" in said[0], said[0]
        assert "from_dcp_keys={'train_state': None}" in said[0]
        assert fresh_scheduler.last_epoch == 31
        assert fresh_optimizer.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"]
        assert fresh_loader.state_dict() == {"epoch": 0, "batch": 31}
        assert same(fresh.state_dict(), model.state_dict())
        assert same(fresh_optimizer.state_dict()["state"], optimizer.state_dict()["state"])
        # Told to leave it, nothing is said.
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            assert manager.load(from_dcp=path, from_dcp_keys={"train_state": None}) == 31
        assert ckptd_warnings(record) == []


def test_get_state_dicts_flattened_optimizer_at_the_top_loads(daemon, workdir):
    model, optimizer, scheduler, loader = make(0)
    train(model, optimizer, scheduler, loader, 3)
    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    model_state, optim_state = get_state_dict(model, optimizer, options=flat)
    path = os.path.join(workdir, "flat", "step-3")
    dcp.save({"model": model_state, **optim_state}, checkpoint_id=path)
    fresh, fresh_optimizer, _, _ = make(9)
    with CheckpointManager("flat", fresh, fresh_optimizer, socket=daemon.socket) as manager:
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            assert manager.load(from_dcp=path) == 3
        assert ckptd_warnings(record) == []
    assert same(fresh.state_dict(), model.state_dict())
    assert same(fresh_optimizer.state_dict()["state"], optimizer.state_dict()["state"])


def test_what_no_layout_explains_is_named_once_mapped_or_refused_by_strict(daemon, workdir):
    model, optimizer, scheduler, loader = make(0)
    train(model, optimizer, scheduler, loader, 5)
    model_state, optim_state = get_state_dict(model, optimizer)
    ema = {k: v.clone() * 0.5 for k, v in model_state.items()}
    path = os.path.join(workdir, "own", "step-5")
    dcp.save({"app": {"model": model_state, "optim": optim_state, "warmup": scheduler.state_dict(),
                      "ema": ema}}, checkpoint_id=path)

    fresh, fresh_optimizer, fresh_scheduler, _ = make(9)
    untouched = {k: v.clone() for k, v in fresh.state_dict().items()}
    with CheckpointManager("own", fresh, fresh_optimizer, fresh_scheduler, socket=daemon.socket) as manager:
        # strict=True: refused before anything is loaded, naming both sides and the way out.
        with pytest.raises(CheckpointError) as refused:
            manager.load(from_dcp=path, strict=True)
        message = str(refused.value)
        assert "app.ema (4 keys)" in message and "app.warmup" in message, message
        assert "nothing found for the LR scheduler" in message, message
        assert "from_dcp_keys={'lr_scheduler': 'app.warmup'}" in message, message
        assert same(fresh.state_dict(), untouched)
        assert fresh_scheduler.last_epoch == 0

        # Without strict: loaded, and one warning names what was left.
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            assert manager.load(from_dcp=path) == 5
        said = ckptd_warnings(record)
        assert len(said) == 1 and "app.ema (4 keys)" in said[0] and "app.warmup" in said[0], said
        assert fresh_scheduler.last_epoch == 0

        # Mapped: the scheduler comes back, the EMA is left unread on purpose, nothing is said.
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            assert manager.load(from_dcp=path, strict=True,
                                from_dcp_keys={"lr_scheduler": "app.warmup", "app.ema": None}) == 5
        assert ckptd_warnings(record) == []
        assert fresh_scheduler.last_epoch == 5
        assert fresh_scheduler.get_last_lr() == scheduler.get_last_lr()
    assert same(fresh.state_dict(), model.state_dict())


def test_from_dcp_keys_that_name_nothing_say_what_the_checkpoint_holds(daemon, workdir):
    model, optimizer, scheduler, loader = make(0)
    path = os.path.join(workdir, "bad", "step-1")
    dcp.save({"app": AppState(model, optimizer, scheduler, loader)}, checkpoint_id=path)
    with CheckpointManager("bad", model, optimizer, scheduler, socket=daemon.socket) as manager:
        with pytest.raises(CheckpointError, match=r"from_dcp_keys\['lr_scheduler'\] = 'app.schedule': the DCP "
                           r"checkpoint has no such key; it holds keys under .*'app.sched'"):
            manager.load(from_dcp=path, from_dcp_keys={"lr_scheduler": "app.schedule"})
        with pytest.raises(CheckpointError, match=r"from_dcp_keys: 'ema' is neither a part of this manager"):
            manager.load(from_dcp=path, from_dcp_keys={"ema": None})
        with pytest.raises(ValueError, match="from_dcp_keys maps the keys of a from_dcp= checkpoint"):
            manager.load(from_dcp_keys={"lr_scheduler": "app.sched"})

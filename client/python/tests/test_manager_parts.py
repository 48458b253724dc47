"""What the reference checkpointers' users register that is not one model and one optimizer
(issue 21 item 7): pipeline stages with an optimizer and scheduler each (torchtitan's
model_parts, AReaL's lists), named parts, plain values in extra_state (a tensor of any size,
a dict, a list), and train state on another world size (dataloaders). Real ckptd, both
PyTorch lines."""
import warnings

import pytest
import torch

from ckptd.torch import CheckpointManager

from conftest import ranks_in_threads


def stages(seed=0):
    torch.manual_seed(seed)
    parts = [torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU()),
             torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()),
             torch.nn.Sequential(torch.nn.Linear(8, 2))]
    # Pipeline stages name their layers apart, as torchtitan's do.
    for i, part in enumerate(parts):
        part.add_module(f"stage{i}", part[0])
        del part._modules["0"]
    optimizers = [torch.optim.AdamW(p.parameters(), lr=1e-2) for p in parts]
    schedulers = [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5) for o in optimizers]
    return parts, optimizers, schedulers


def train(parts, optimizers, schedulers, steps, seed=1):
    torch.manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(3, 4)
        for part in parts:
            x = part(x)
        x.square().mean().backward()
        for o, s in zip(optimizers, schedulers):
            o.step()
            o.zero_grad()
            s.step()


def weights(parts):
    return [t.clone() for p in parts for t in p.state_dict().values()]


def same(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_pipeline_stages_with_their_optimizers_and_schedulers_resume_bit_exactly(daemon):
    parts, optimizers, schedulers = stages()
    train(parts, optimizers, schedulers, 3)
    with CheckpointManager("pp", parts, optimizers, schedulers, socket=daemon.socket) as manager:
        manager.save(3, blocking=True)
    train(parts, optimizers, schedulers, 2, seed=2)  # the run that never stopped

    fresh, fresh_optimizers, fresh_schedulers = stages(seed=9)
    with CheckpointManager("pp", fresh, fresh_optimizers, fresh_schedulers, socket=daemon.socket) as manager:
        assert manager.load() == 3
        assert [s.last_epoch for s in fresh_schedulers] == [3, 3, 3]
        keys = [e.name for e in manager._collect()]
        train(fresh, fresh_optimizers, fresh_schedulers, 2, seed=2)
    assert same(weights(fresh), weights(parts))
    # Keys are the stages' own, merged, as torchtitan keeps them.
    assert "stage0.weight" in keys and "stage2.bias" in keys and "optim.stage1.weight.exp_avg" in keys


def test_named_parts_keep_their_keys_apart(daemon):
    torch.manual_seed(0)
    encoder, decoder = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)  # the same names inside
    with CheckpointManager("named", {"encoder": encoder, "decoder": decoder}, socket=daemon.socket) as manager:
        manager.save(1, blocking=True)
        names = [e.name for e in manager._collect()]
    assert {"encoder.weight", "decoder.weight"} <= set(names)
    fresh = {"encoder": torch.nn.Linear(4, 4), "decoder": torch.nn.Linear(4, 4)}
    with CheckpointManager("named", fresh, socket=daemon.socket) as manager:
        assert manager.load() == 1
    assert torch.equal(fresh["decoder"].weight, decoder.weight)


def test_parts_whose_keys_collide_are_refused_by_name():
    with pytest.raises(ValueError, match="model parts 0 and 1 both have 'weight': pass a dict"):
        CheckpointManager("clash", [torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)], socket="/nonexistent")


def test_plain_values_in_extra_state_come_back_in_place(daemon):
    model = torch.nn.Linear(2, 2)
    id_map = torch.arange(1 << 20, dtype=torch.int64)  # 8 MiB: far past a command's 256 KiB
    history = {"loss": [3.0, 2.5, 2.1]}
    seen = [1, 2, 3]
    extra = {"id_map": id_map, "history": history, "seen": seen}
    with CheckpointManager("plain", model, extra_state=extra, socket=daemon.socket) as manager:
        manager.save(1, blocking=True)
    id_map.zero_()
    history["loss"].append(9.9)
    seen.clear()
    with CheckpointManager("plain", model, extra_state=extra, socket=daemon.socket) as manager:
        assert manager.load() == 1
    assert torch.equal(id_map, torch.arange(1 << 20, dtype=torch.int64))
    assert history == {"loss": [3.0, 2.5, 2.1]} and seen == [1, 2, 3]
    # A number or string cannot come back in place: load() gives it back (test_tables.py).


class Loader:
    """A dataloader's position; `reshard` chooses whether it decides for itself."""

    def __init__(self, position, reshard=False):
        self.position = position
        self.calls = []
        if reshard:
            self.reshard_state_dict = self._reshard

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]

    def _reshard(self, state, **where):
        self.calls.append(where)
        return {"position": state["position"] * where["saved_world_size"] // where["world_size"]}


@pytest.mark.parametrize("hook", [False, True], ids=["warned", "hook"])
def test_train_state_on_another_world_size_is_said_or_decided_by_the_object(daemon, hook):
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 2)
    with CheckpointManager("dl", model, extra_state={"loader": Loader(100)}, socket=daemon.socket) as manager:
        manager.save(1, blocking=True)  # one rank

    loaders = {}

    def rank(r):
        loaders[r] = Loader(0, reshard=hook)
        with CheckpointManager("dl", torch.nn.Linear(2, 2), extra_state={"loader": loaders[r]},
                               socket=daemon.socket, rank=r, world_size=2) as m:
            m.load()

    # One catch for both rank threads: catch_warnings swaps process-wide state.
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        errors = ranks_in_threads(rank, 2)
    assert not errors, errors
    said = [str(w.message) for w in seen if "was saved by 1 ranks" in str(w.message)]
    if hook:
        assert said == []
        assert loaders[1].calls == [{"saved_world_size": 1, "world_size": 2, "rank": 1, "from_rank": 0}]
        assert loaders[1].position == 50
    else:
        assert len(said) == 1 and "rank 1 gets rank 0's extra_state 'loader'" in said[0]  # once
        assert loaders[1].position == 100


def test_list_checkpoints_shows_each_step_with_its_tiers_size_and_kind(daemon):
    model = torch.nn.Linear(4, 4)
    with CheckpointManager("listed", model, socket=daemon.socket) as manager:
        manager.save(1, blocking=True)
        manager.save(2, blocking=True, ephemeral=True)
        manager.save_weights(3, dtype=torch.bfloat16)
        steps = manager.list_checkpoints()
        weights = manager.list_checkpoints("listed-weights")
    # Step 2 references what step 1 wrote of it that did not change (increments, the default).
    assert [(c["step"], c["flags"]) for c in steps] == [(1, []), (2, ["increment", "ephemeral"])]
    assert all("local" in c["tiers"] and c["bytes"] >= 64 and c["world_size"] == 1 for c in steps)
    assert "memory" in steps[-1]["tiers"]
    assert [(c["step"], c["flags"]) for c in weights] == [(3, ["weights-only"])]
    # ckptctl shows the same kinds.
    import subprocess
    from conftest import CKPTCTL
    table = subprocess.run([CKPTCTL, "--socket", daemon.socket, "list"], capture_output=True, text=True).stdout
    assert "KIND" in table and "ephemeral" in table and "weights-only" in table and "full" in table


def test_a_model_of_tens_of_thousands_of_parameters_saves(daemon):
    """The names DCP wants for parameter groups are left out where they would crowd the
    snapshot's command (they took 900 KB for an MoE of 18k parameters: no save went through)."""
    model = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(1)) for _ in range(20000)])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with CheckpointManager("many", model, optimizer, socket=daemon.socket) as manager:
        assert manager.save(1, blocking=True)


def test_a_large_train_state_travels_in_shared_memory_both_ways(daemon):
    """A loss history of a million floats (about 9 MB pickled: 36 times what a command of the
    ring carries) saves, and comes back bit-exactly from ckptd's memory and, after a restart,
    from disk (a restore's train state over 1 MiB comes back as shared memory too)."""
    model = torch.nn.Linear(2, 2)
    history = {"loss": [i / 7 for i in range(1_000_000)]}
    with CheckpointManager("big", model, extra_state={"history": history}, socket=daemon.socket) as manager:
        assert manager.save(1, blocking=True)
    saved = list(history["loss"])
    for restart in (False, True):
        if restart:
            daemon.restart()
        history["loss"].clear()
        with CheckpointManager("big", model, extra_state={"history": history}, socket=daemon.socket) as manager:
            restored = manager.load()
            assert restored == 1 and restored.source == ("disk" if restart else "memory")
        assert history["loss"] == saved


def test_train_state_past_the_staging_budget_is_refused_by_name(workdir):
    from conftest import Daemon
    from ckptd.torch import CheckpointError
    daemon = Daemon(workdir, ["--staging-bytes", "4M"]).start()
    try:
        model = torch.nn.Linear(2, 2)
        history = {"ids": list(range(1_000_000))}  # about 5 MB pickled
        with CheckpointManager("over", model, extra_state={"history": history}, socket=daemon.socket) as manager:
            with pytest.raises(CheckpointError, match=r"train state take \d+ bytes, more than ckptd's whole staging budget"):
                manager.save(1, blocking=True)
            history["ids"] = history["ids"][:1000]  # what fits goes through on the same session
            assert manager.save(2, blocking=True)
    finally:
        daemon.stop()


def test_train_state_that_cannot_come_back_is_refused_at_the_first_save(daemon):
    from ckptd.torch import CheckpointError
    model = torch.nn.Linear(2, 2)

    class Opaque:
        pass

    with CheckpointManager("odd", model, extra_state={"meta": {"x": Opaque()}}, socket=daemon.socket) as manager:
        with pytest.raises(CheckpointError, match=r"extra_state\['meta'\] holds something a checkpoint cannot load back"):
            manager.save(1)


def test_a_weights_only_step_saved_in_bf16_loads_into_fp32_with_cast(daemon):
    """What OLMo-core does with a weights-only directory: the bf16 export is the warm start
    of an fp32 model. Without cast=True the dtypes are named, with the way out."""
    from ckptd.torch import CheckpointError
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.LayerNorm(64))
    with CheckpointManager("w", model, socket=daemon.socket) as manager:
        manager.save_weights(1, dtype=torch.bfloat16)
    expected = {k: v.to(torch.bfloat16).float() for k, v in model.state_dict().items()}
    fresh = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.LayerNorm(64))
    with CheckpointManager("w-weights", fresh, socket=daemon.socket) as manager:
        with pytest.raises(CheckpointError, match=r"(?s)saved as BF16, wanted as F32.*load\(cast=True\)"):
            manager.load()
        assert manager.load(cast=True) == 1
    for name, value in fresh.state_dict().items():
        assert value.dtype == torch.float32 and torch.equal(value, expected[name]), name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_cast_rounds_as_tensor_to_does(daemon, dtype):
    """Ties, the smallest normals and subnormals, overflow and NaN: cast on load gives
    Tensor.to's bits, from memory and from disk."""
    values = torch.tensor([1.0, 1.00390625, 1.01171875, -1.00390625, 3.4e38, 1e5, 70000.0, 1e-40,
                           6e-8, float("inf"), float("-inf"), float("nan"), -0.0, 0.1, 1 / 3],
                          dtype=torch.float32)
    values = torch.cat([values, torch.randn(4096)])
    saved = torch.nn.Module()
    saved.w = torch.nn.Parameter(values.clone())
    with CheckpointManager("cast", saved, socket=daemon.socket) as manager:
        manager.save(1, blocking=True)
    expected = values.to(dtype)
    for restart in (False, True):
        if restart:
            daemon.restart()
        loaded = torch.nn.Module()
        loaded.w = torch.nn.Parameter(torch.zeros(values.numel(), dtype=dtype))
        with CheckpointManager("cast", loaded, socket=daemon.socket) as manager:
            assert manager.load(cast=True) == 1
        got = loaded.w.detach()
        # NaN stays NaN (which NaN depends on PyTorch's code path: its vectorized conversion
        # gives 0xffff, its scalar one 0x7fc0); every other value to the bit.
        assert torch.equal(got.isnan(), expected.isnan())
        bits = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float64: torch.int64}[dtype]
        assert torch.equal(got[~got.isnan()].view(bits), expected[~expected.isnan()].view(bits))

"""ckptd.torch with recommendation-model state: sparse embeddings and their optimizers
(SparseAdam, Adagrad), tables that grew since the step was saved (load(resize=True),
load(on_shapes=)), and extra_state that is not a tensor or a dict: torchtitan's TrainState
(io.BytesIO values) and plain numbers and strings."""
import io
from dataclasses import dataclass, field
from typing import List

import pytest
import torch

from ckptd.torch import CheckpointError, CheckpointManager


def same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                     b.reshape(-1).view(torch.uint8))


class Ranker(torch.nn.Module):
    """An embedding table and a dense head: the shape of a recommendation model."""

    def __init__(self, rows, sparse, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = torch.nn.Embedding(rows, 8, sparse=sparse)
        self.head = torch.nn.Linear(8, 1)

    def forward(self, ids):
        return self.head(self.emb(ids)).squeeze(-1)


def batch(step, rows):
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, rows, (16,), generator=g)
    return ids, torch.randn(16, generator=g)


def train(model, optimizers, steps, rows):
    for step in steps:
        ids, target = batch(step, rows)
        for o in optimizers:
            o.zero_grad()
        torch.nn.functional.mse_loss(model(ids), target).backward()
        for o in optimizers:
            o.step()


def optimizers_for(model, kind):
    if kind == "SparseAdam":  # it takes sparse gradients only: the dense head has its own Adam
        return [torch.optim.SparseAdam(model.emb.parameters(), lr=0.05),
                torch.optim.Adam(model.head.parameters(), lr=0.05)]
    return [torch.optim.Adagrad(model.parameters(), lr=0.05)]


def state_of(model, optimizers):
    out = {f"model.{k}": v.clone() for k, v in model.state_dict().items()}
    for i, o in enumerate(optimizers):
        for j, p in enumerate(p for g in o.param_groups for p in g["params"]):
            for key, value in o.state[p].items():
                out[f"optim{i}.{j}.{key}"] = value.clone() if torch.is_tensor(value) else value
    return out


def assert_same_state(a, b):
    assert a.keys() == b.keys()
    for key in a:
        if torch.is_tensor(a[key]):
            assert same_bits(a[key], b[key]), key
        else:
            assert a[key] == b[key], key


@pytest.mark.parametrize("kind", ["SparseAdam", "Adagrad"])
def test_sparse_embeddings_resume_bit_exactly(daemon, kind):
    """A fresh model and optimizer (as in a new process) load the step and train on to the
    uninterrupted run's weights and optimizer state, bit for bit. SparseAdam refuses the
    dense gradient that creating its state with a zero step would give it."""
    model = Ranker(200, sparse=True, seed=0)
    optimizers = optimizers_for(model, kind)
    with CheckpointManager(f"sparse-{kind}", model, optimizers, socket=daemon.socket) as manager:
        train(model, optimizers, range(1, 4), 200)
        manager.save(3, blocking=True)
        train(model, optimizers, range(4, 7), 200)
    expected = state_of(model, optimizers)

    fresh = Ranker(200, sparse=True, seed=1)
    fresh_optimizers = optimizers_for(fresh, kind)
    with CheckpointManager(f"sparse-{kind}", fresh, fresh_optimizers, socket=daemon.socket) as manager:
        assert manager.load() == 3
        train(fresh, fresh_optimizers, range(4, 7), 200)
    assert_same_state(state_of(fresh, fresh_optimizers), expected)


def test_a_table_that_grew_resumes_into_a_smaller_model_with_resize(daemon):
    """RecIS-style: the table grows while training (new ids get rows); a restart builds the
    model at its configured size and load(resize=True) takes the saved number of rows, the
    optimizer state following, then training goes on as if never stopped."""
    model = Ranker(1000, sparse=False, seed=0)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    with CheckpointManager("grown", model, optimizer, socket=daemon.socket) as manager:
        train(model, [optimizer], range(1, 3), 1000)
        manager.save(2, blocking=True)
        with torch.no_grad():  # 500 new ids: the table grows in place, Adam's state with it
            grown = torch.cat([model.emb.weight, torch.randn(500, 8)])
            model.emb.weight.data = grown
            model.emb.weight.grad = None  # PyTorch 1.13's zero_grad() keeps a gradient of the old size
            for key in ("exp_avg", "exp_avg_sq"):
                state = optimizer.state[model.emb.weight]
                state[key] = torch.cat([state[key], torch.zeros(500, 8)])
        train(model, [optimizer], range(3, 5), 1500)
        manager.save(4, blocking=True)
        train(model, [optimizer], range(5, 7), 1500)
    expected = state_of(model, [optimizer])

    fresh = Ranker(1000, sparse=False, seed=1)
    fresh_optimizer = torch.optim.Adam(fresh.parameters(), lr=0.05)
    with CheckpointManager("grown", fresh, fresh_optimizer, socket=daemon.socket) as manager:
        with pytest.raises(CheckpointError, match=r"emb\.weight.*\[1500, 8\].*\[1000, 8\]"):
            manager.load()
        restored = manager.load(resize=True)
        assert restored == 4
        assert fresh.emb.num_embeddings == 1500 and fresh.emb.weight.shape == (1500, 8)
        train(fresh, [fresh_optimizer], range(5, 7), 1500)
        manager.save(6, blocking=True)  # the resized tensors are what is registered now
    assert_same_state(state_of(fresh, [fresh_optimizer]), expected)
    assert daemon.steps("grown")[-1] == 6


def test_on_shapes_sees_the_saved_shapes_and_resizes_what_it_chooses(daemon):
    model = torch.nn.Sequential(torch.nn.Embedding(30, 4), torch.nn.Linear(4, 2))
    optimizer = torch.optim.Adagrad(model.parameters(), lr=0.1)
    model(torch.tensor([1, 2])).sum().backward()
    optimizer.step()
    with CheckpointManager("shapes", model, optimizer, socket=daemon.socket) as manager:
        manager.save(1, blocking=True)
    saved = {k: v.clone() for k, v in model.state_dict().items()}

    small = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 2))
    small_optimizer = torch.optim.Adagrad(small.parameters(), lr=0.1)
    seen = []

    def on_shapes(shapes):
        seen.append(dict(shapes))
        small[0].weight.data = torch.empty(shapes["0.weight"])

    with CheckpointManager("shapes", small, small_optimizer, socket=daemon.socket) as manager:
        assert manager.load(on_shapes=on_shapes) == 1
    assert seen == [{"0.weight": torch.Size([30, 4]), "1.weight": torch.Size([2, 4]), "1.bias": torch.Size([2])}]
    for key, value in saved.items():
        assert same_bits(small.state_dict()[key], value), key
    assert same_bits(small_optimizer.state[small[0].weight]["sum"], optimizer.state[model[0].weight]["sum"])

    # A hook that replaces the parameter instead: the optimizer would train the old one.
    other = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 2))
    other_optimizer = torch.optim.Adagrad(other.parameters(), lr=0.1)

    def replace(shapes):
        other[0].weight = torch.nn.Parameter(torch.empty(shapes["0.weight"]))

    with CheckpointManager("shapes", other, other_optimizer, socket=daemon.socket) as manager:
        with pytest.raises(CheckpointError, match=r"replaced parameter 0\.weight.*resize it in place"):
            manager.load(on_shapes=replace)
        with pytest.raises(ValueError, match="not both"):
            manager.load(on_shapes=replace, resize=True)


# torchtitan's TrainState (torchtitan/components/checkpoint.py until 2025, then train.py), as
# it was: its state_dict() holds io.BytesIO values. The installed torchtitan no longer has it.
@dataclass
class TrainState:
    step: int = 0
    global_avg_losses: List[float] = field(default_factory=list)
    global_max_losses: List[float] = field(default_factory=list)
    log_steps: List[int] = field(default_factory=list)

    def state_dict(self):
        global_avg_losses_bytes = io.BytesIO()
        torch.save(self.global_avg_losses, global_avg_losses_bytes)
        global_max_losses_bytes = io.BytesIO()
        torch.save(self.global_max_losses, global_max_losses_bytes)
        log_steps_bytes = io.BytesIO()
        torch.save(self.log_steps, log_steps_bytes)
        return {
            "step": torch.tensor(self.step, dtype=torch.int32),
            "global_avg_losses": global_avg_losses_bytes,
            "global_max_losses": global_max_losses_bytes,
            "log_steps": log_steps_bytes,
        }

    def load_state_dict(self, state_dict):
        self.step = state_dict["step"].item()
        state_dict["global_avg_losses"].seek(0)
        self.global_avg_losses = torch.load(state_dict["global_avg_losses"], weights_only=False)
        state_dict["global_max_losses"].seek(0)
        self.global_max_losses = torch.load(state_dict["global_max_losses"], weights_only=False)
        state_dict["log_steps"].seek(0)
        self.log_steps = torch.load(state_dict["log_steps"], weights_only=False)


def test_extra_state_carries_bytesio_and_gives_plain_values_back(daemon):
    model = torch.nn.Linear(2, 2)
    train_state = TrainState(step=7, global_avg_losses=[2.5, 1.25], global_max_losses=[3.0, 2.0], log_steps=[5, 7])
    history = {"buffers": [io.BytesIO(b"\x00\x01raw"), ("kept", io.BytesIO(b"tuple"))], "n": 2}
    plain = {"epoch": 3, "tag": "run-a", "blob": b"\x00\xff", "ratio": 0.5, "nothing": None, "done": False}
    with CheckpointManager("extra", model, extra_state={"train_state": train_state, "history": history, **plain},
                           socket=daemon.socket) as manager:
        manager.extra_state["epoch"] = 4  # a plain value is saved as the manager holds it
        manager.save(7, blocking=True)

    back = TrainState()
    history_back = {}
    zeros = {name: (0 if isinstance(v, int) else v) for name, v in plain.items()}
    with CheckpointManager("extra", torch.nn.Linear(2, 2), extra_state={"train_state": back, "history": history_back,
                                                                        **zeros}, socket=daemon.socket) as manager:
        restored = manager.load()
        assert restored == 7
        assert restored.extra == {**plain, "epoch": 4}
        assert manager.restored["extra"] == restored.extra
        assert manager.extra_state["epoch"] == 4  # and saved so from now on
    assert back == train_state
    assert history_back["n"] == 2
    first, (word, second) = history_back["buffers"]
    assert isinstance(first, io.BytesIO) and first.read() == b"\x00\x01raw"
    assert word == "kept" and isinstance(second, io.BytesIO) and second.read() == b"tuple"


def test_extra_state_still_refuses_what_needs_pickle(daemon):
    class Opaque:
        pass

    with pytest.raises(TypeError, match=r"extra_state\['thing'\] is a Opaque"):
        CheckpointManager("opaque", torch.nn.Linear(2, 2), extra_state={"thing": Opaque()}, socket=daemon.socket)
    with CheckpointManager("opaque", torch.nn.Linear(2, 2), extra_state={"box": {"thing": Opaque()}},
                           socket=daemon.socket) as manager:
        with pytest.raises(CheckpointError, match=r"extra_state\['box'\].*io\.BytesIO"):
            manager.save(1, blocking=True)

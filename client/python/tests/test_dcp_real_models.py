"""DCP interoperability on a real model (issue 21 item 4): a GPT-2 from `transformers`, whose
lm_head.weight is transformer.wte.weight, with AdamW, both ways:
- DCP code reads a ckptd checkpoint (CkptdStorageReader) into model.state_dict() and into
  what get_state_dict gives, nested and flattened, optimizer included, with no
  allow_partial_load;
- a job switches to ckptd from DCP checkpoints in the layouts people save: the DCP
  tutorial's {"app": AppState}, {"model", "optimizer"}, torchtitan's flat keys.

PyTorch 2 with `transformers` (the project's virtual environment; run_pytest.sh leaves this
file out on Debian's 1.13).
"""
import os
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict,
                                                     set_state_dict)
from torch.distributed.checkpoint.stateful import Stateful
import transformers

from ckptd.dcp import CkptdStorageReader
from ckptd.torch import CheckpointError, CheckpointManager

from conftest import same

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def gpt2(seed=0):
    torch.manual_seed(seed)
    config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=128,
                                     n_positions=16, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config)
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    rest = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                   {"params": rest, "weight_decay": 0.0}], lr=1e-3)
    return model, optimizer


def train(model, optimizer, steps, seed=1):
    torch.manual_seed(seed)
    for _ in range(steps):
        tokens = torch.randint(0, 128, (2, 8))
        model(tokens, labels=tokens).loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def ckptd_step_dir(daemon, job, step):
    return os.path.join(daemon.root, job, f"step-{step:08d}")


@pytest.fixture
def saved(daemon):
    """A GPT-2 trained 3 steps and saved by ckptd.torch as step 3 of job gpt."""
    model, optimizer = gpt2()
    train(model, optimizer, 3)
    with CheckpointManager("gpt", model, optimizer, socket=daemon.socket) as manager:
        manager.save(3, blocking=True)
    return model, optimizer, ckptd_step_dir(daemon, "gpt", 3)


def test_dcp_loads_a_tied_model_state_dict_from_ckptd(saved):
    model, _, path = saved
    fresh, _ = gpt2(seed=9)
    state = fresh.state_dict()
    assert "lm_head.weight" in state  # the tied name DCP asks for
    dcp.load(state, storage_reader=CkptdStorageReader(path))
    fresh.load_state_dict(state)
    assert same(fresh.state_dict(), model.state_dict())


@pytest.mark.parametrize("flatten", [False, True], ids=["nested", "flattened"])
def test_dcp_loads_model_and_optimizer_as_get_state_dict_gives_them(saved, flatten):
    model, optimizer, path = saved
    fresh, fresh_optimizer = gpt2(seed=9)
    train(fresh, fresh_optimizer, 1, seed=5)  # other values everywhere, state created
    options = StateDictOptions(flatten_optimizer_state_dict=flatten)
    model_state, optim_state = get_state_dict(fresh, fresh_optimizer, options=options)
    state = {"model": model_state, "optimizer": optim_state}
    dcp.load(state, storage_reader=CkptdStorageReader(path))  # no allow_partial_load
    set_state_dict(fresh, fresh_optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"], options=options)
    assert same(fresh.state_dict(), model.state_dict())
    assert same(fresh_optimizer.state_dict(), optimizer.state_dict())
    # And training on from there is the run that never stopped.
    train(model, optimizer, 2, seed=7)
    train(fresh, fresh_optimizer, 2, seed=7)
    assert same(fresh.state_dict(), model.state_dict())


class AppState(Stateful):
    """The DCP tutorial's wrapper: {"app": AppState(model, optimizer)}."""

    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self):
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        return {"model": model_state, "optim": optim_state}

    def load_state_dict(self, state):
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])


def dcp_layouts(model, optimizer):
    model_state, optim_state = get_state_dict(model, optimizer)
    flat_options = StateDictOptions(flatten_optimizer_state_dict=True)
    return {
        "tutorial": {"app": AppState(model, optimizer)},
        "nested": {"model": model_state, "optimizer": optim_state},
        "torchtitan": {**model_state, "optimizer": get_state_dict(model, optimizer, options=flat_options)[1]},
    }


@pytest.mark.parametrize("layout", ["tutorial", "nested", "torchtitan"])
def test_a_job_switches_from_dcp_in_each_common_layout(daemon, workdir, layout):
    model, optimizer = gpt2()
    train(model, optimizer, 3)
    path = os.path.join(workdir, "dcp", "step-3")
    dcp.save(dcp_layouts(model, optimizer)[layout], checkpoint_id=path)
    fresh, fresh_optimizer = gpt2(seed=9)
    with CheckpointManager("gpt", fresh, fresh_optimizer, socket=daemon.socket) as manager:
        assert manager.load(from_dcp=path) == 3
        assert same(fresh.state_dict(), model.state_dict())
        assert same(fresh_optimizer.state_dict(), optimizer.state_dict())
        manager.save(4, blocking=True)  # the next save is ckptd's


def test_from_dcp_finds_the_model_under_any_prefix(daemon, workdir):
    model, optimizer = gpt2()
    train(model, optimizer, 2)
    path = os.path.join(workdir, "dcp", "step-2")
    dcp.save({"trainer": {"weights": model.state_dict()}}, checkpoint_id=path)
    fresh, fresh_optimizer = gpt2(seed=9)
    with CheckpointManager("gpt", fresh, fresh_optimizer, socket=daemon.socket) as manager:
        assert manager.load(from_dcp=path) == 2
    assert same(fresh.state_dict(), model.state_dict())


def test_from_dcp_with_two_copies_of_the_model_refuses_to_guess(daemon, workdir):
    model, optimizer = gpt2()
    path = os.path.join(workdir, "dcp", "step-1")
    dcp.save({"ema": model.state_dict(), "net": model.state_dict()}, checkpoint_id=path)
    with CheckpointManager("gpt", model, optimizer, socket=daemon.socket) as manager:
        with pytest.raises(CheckpointError, match=r"under 2 prefixes equally \('ema.', 'net.'\)"):
            manager.load(from_dcp=path)


def test_from_dcp_that_holds_no_model_key_says_what_it_tried_and_what_is_there(daemon, workdir):
    model, optimizer = gpt2()
    path = os.path.join(workdir, "dcp", "step-1")
    dcp.save({"weights": {"encoder.w": torch.ones(2)}}, checkpoint_id=path)
    with CheckpointManager("gpt", model, optimizer, socket=daemon.socket) as manager:
        with pytest.raises(CheckpointError) as raised:
            manager.load(from_dcp=path)
    message = str(raised.value)
    assert "'transformer.wte.weight'" in message         # what the model wants
    assert "'model.'" in message and "'app.model.'" in message  # the prefixes tried
    assert "weights.encoder.w" in message                # what the checkpoint holds


def test_a_hugging_face_folder_warm_starts_a_model_in_its_own_dtype(daemon, workdir):
    """load(from_hf=): what ckptctl export writes (BF16 here), or a hub download, into an FP32
    model; model only, tied weights filled once; then the job saves to ckptd as usual."""
    model, optimizer = gpt2()
    train(model, optimizer, 2)
    folder = os.path.join(workdir, "hf")
    model.to(torch.bfloat16).save_pretrained(folder)  # what a hub holds: BF16, lm_head tied
    model.to(torch.float32)
    fresh, fresh_optimizer = gpt2(seed=9)
    with CheckpointManager("warm", fresh, fresh_optimizer, socket=daemon.socket) as manager:
        start = manager.load(from_hf=folder)
        assert start == 0 and start.source == "hf"
        manager.save(1, blocking=True)
    for name, tensor in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], tensor.to(torch.bfloat16).to(torch.float32)), name
    assert fresh.lm_head.weight is fresh.transformer.wte.weight
    # Names that differ are mapped with the export's rules; unknown ones are named.
    other = torch.nn.Linear(32, 32)
    with CheckpointManager("warm2", other, socket=daemon.socket) as manager:
        with pytest.raises(CheckpointError, match=r"2 of the model's tensors are not in it \(bias, weight\).*rename="):
            manager.load(from_hf=folder)
        manager.load(from_hf=folder, rename={"transformer.h.0.attn.c_proj.*": "*", "*": ""})
    assert torch.equal(other.bias, model.transformer.h[0].attn.c_proj.bias.to(torch.bfloat16).float())

"""One rank of a 2-process CPU job whose parameters are DTensors, checkpointed through ckptd.

    dtensor_worker.py --socket S --job J --mode save|load --layout tp|fsdp2 --out DIR

RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT come from the environment (as torchrun sets
them); the process group is gloo over a 1-D CPU DeviceMesh.
- layout tp: tensor parallel (`parallelize_module`: the first Linear by rows, the second
  by columns, its bias replicated); Adam state follows its parameter.
- layout fsdp2: the model wrapped with `fully_shard` (FSDP2), uneven shards included.
- layout gpt2: a tiny GPT-2 (transformers, built from a config with random weights) with
  each block and the whole model wrapped with `fully_shard`; save also has rank 0 write
  the logits of a fixed input to DIR/logits.pt and the model's config to DIR/config.json.
save: trains 3 steps, saves step 3 (blocking), and has rank 0 write the full (gathered)
tensors of the model and optimizer to DIR/saved.pt; then trains 2 more steps and writes
the losses to DIR/losses-save.pt.
load: builds the same model with other weights, loads, has rank 0 write the gathered
tensors to DIR/loaded.pt, trains the same 2 steps and writes DIR/losses-load.pt.
from_hf: builds the sharded model with other weights, warm-starts it from the Hugging Face
folder DIR/hf (load(from_hf=)), has rank 0 write the gathered model tensors to
DIR/loaded.pt, and each rank the bytes it loaded to DIR/hf-bytes-<rank>.
"""
import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from ckptd.torch import CheckpointManager


GPT2_CONFIG = dict(vocab_size=96, n_positions=32, n_embd=48, n_layer=2, n_head=4,
                   resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def gpt2_input():
    return torch.arange(24).reshape(2, 12) % GPT2_CONFIG["vocab_size"]


def build(layout, mesh, seed):
    """The layout's model and optimizer, sharded over `mesh` (None: whole)."""
    torch.manual_seed(seed)
    if layout == "gpt2":
        from torch.distributed.fsdp import fully_shard
        from transformers import GPT2Config, GPT2LMHeadModel
        model = GPT2LMHeadModel(GPT2Config(**GPT2_CONFIG))
        if mesh is not None:
            for block in model.transformer.h:
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
        return model, torch.optim.Adam(model.parameters(), lr=1e-2)
    # Tensor parallelism needs even shards (DTensor.from_local assumes them); FSDP2 pads
    # uneven ones, which the 9 rows over 2 ranks here exercise.
    hidden = 8 if layout == "tp" else 9
    model = torch.nn.Sequential(torch.nn.Linear(6, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 5))
    if mesh is None:
        pass
    elif layout == "fsdp2":
        from torch.distributed.fsdp import fully_shard
        fully_shard(model[0], mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        # Megatron-style: the first layer's rows (weight and bias Shard(0)), the second's
        # columns (weight Shard(1), bias replicated).
        from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                       parallelize_module)
        parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    return model, optimizer


def train(model, optimizer, steps, seed):
    g = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        if hasattr(model, "transformer"):  # gpt2
            ids = torch.randint(0, GPT2_CONFIG["vocab_size"], (2, 12), generator=g)
            loss = model(ids, labels=ids).loss
        else:
            x = torch.randn(4, 6, generator=g)
            loss = model(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.detach().clone())
    return torch.stack(losses)


def gathered(model, optimizer):
    """Every tensor of the model and optimizer, whole (DTensors gathered on every rank)."""
    full = lambda t: t.full_tensor() if isinstance(t, DTensor) else t.clone()
    out = {f"model.{n}": full(p.detach()) for n, p in model.named_parameters()}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, state in optimizer.state.items():
        for key, value in state.items():
            if torch.is_tensor(value):
                out[f"optim.{names[id(p)]}.{key}"] = full(value)
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--socket", required=True)
    parser.add_argument("--job", required=True)
    parser.add_argument("--mode", choices=["save", "load", "from_hf"], required=True)
    parser.add_argument("--layout", choices=["tp", "fsdp2", "gpt2"], required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    model, optimizer = build(args.layout, mesh, seed=0 if args.mode == "save" else 1)
    manager = CheckpointManager(args.job, model, optimizer, socket=args.socket)
    if args.mode == "from_hf":
        restored = manager.load(from_hf=os.path.join(args.out, "hf"))
        assert restored == 0 and restored.source == "hf"
        with open(os.path.join(args.out, f"hf-bytes-{rank}"), "w") as f:
            f.write(str(restored.bytes))
        state = gathered(model, optimizer)
        if rank == 0:
            torch.save(state, os.path.join(args.out, "loaded.pt"))
        manager.close()
        dist.barrier()
        dist.destroy_process_group()
        return
    if args.mode == "save":
        train(model, optimizer, 3, seed=10)
        manager.save(3, blocking=True)
        state = gathered(model, optimizer)
        if rank == 0:
            torch.save(state, os.path.join(args.out, "saved.pt"))
        if args.layout == "gpt2":
            model.eval()
            with torch.no_grad():
                logits = model(gpt2_input()).logits
            model.train()
            if rank == 0:
                torch.save(logits, os.path.join(args.out, "logits.pt"))
                model.config.to_json_file(os.path.join(args.out, "config.json"))
    else:
        assert manager.load() == 3
        state = gathered(model, optimizer)
        if rank == 0:
            torch.save(state, os.path.join(args.out, "loaded.pt"))
    losses = train(model, optimizer, 2, seed=20)
    if rank == 0:
        torch.save(losses, os.path.join(args.out, f"losses-{args.mode}.pt"))
    manager.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Out without the interpreter's finalization: gloo's worker threads can still hold
    # tensors then, and tearing them down aborts the process ("terminate called without an
    # active exception", seen once under CI load; pytorch/pytorch#179291). The manager is
    # closed and the group destroyed above; how ckptd's client exits is test_exit.py's.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

"""One rank of a CPU job (gloo) whose model is wrapped with FSDP1, checkpointed through ckptd.

    fsdp1_worker.py --socket S --job J --mode save|load --layout L --out DIR

RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT come from the environment (as torchrun sets
them). The model: Linear(6, 9), Linear(9, 7), Linear(7, 5) and a scale. Layouts:
- fsdp1: FullyShardedDataParallel (use_orig_params=False, the default) around the first
  Linear and around the whole model, whose FlatParameter then holds four parameters of two
  Linears and the scale: rank slices cut parameters in the middle.
- fsdp1-orig: the same with use_orig_params=True.
- fsdp2: fully_shard around the same modules.
- plain: no wrapping (each rank holds the whole model).
save: trains 2 steps, saves step 2, trains 1 more, saves step 3 (blocking) and its weights
in BF16 (save_weights), has rank 0 write the full model and
optimizer state (torch.distributed.checkpoint.state_dict's, by original FQN) to DIR/saved.pt,
trains 2 more steps and writes their losses to DIR/losses-save.pt, then prints "ready" and
waits to be killed (SIGKILL: nothing may depend on a clean exit).
load: builds the same model with other weights, loads, has rank 0 write DIR/loaded.pt,
trains the same 2 steps and writes DIR/losses-load.pt.
"""
import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from ckptd.torch import CheckpointManager


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(6, 9), torch.nn.ReLU(), torch.nn.Linear(9, 7),
                                        torch.nn.ReLU(), torch.nn.Linear(7, 5))
        self.scale = torch.nn.Parameter(torch.tensor([1.5]))  # FSDP takes no 0-d parameters

    def forward(self, x):
        return self.body(x) * self.scale


def build(layout, seed):
    torch.manual_seed(seed)
    model = Net()
    if layout in ("fsdp1", "fsdp1-orig"):
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        orig, cpu = layout == "fsdp1-orig", torch.device("cpu")
        model.body[0] = FSDP(model.body[0], use_orig_params=orig, device_id=cpu)
        model = FSDP(model, use_orig_params=orig, device_id=cpu)
    elif layout == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        fully_shard(model.body[0], mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def train(model, optimizer, steps, seed):
    # Each rank its own batch, as data parallelism has it.
    g = torch.Generator().manual_seed(seed + dist.get_rank())
    losses = []
    for _ in range(steps):
        loss = model(torch.randn(4, 6, generator=g)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.detach().clone())
    return torch.stack(losses)


def gathered(model, optimizer):
    """The full model and optimizer state by original FQN, as FSDP's own state dicts give
    them (on every rank)."""
    model_state, optim_state = get_state_dict(model, optimizer,
                                              options=StateDictOptions(full_state_dict=True))
    out = {f"model.{k}": v.detach().clone() for k, v in model_state.items()}
    for fqn, state in optim_state["state"].items():
        for key, value in state.items():
            out[f"optim.{fqn}.{key}"] = value.detach().clone()
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--socket", required=True)
    parser.add_argument("--job", required=True)
    parser.add_argument("--mode", choices=["save", "load"], required=True)
    parser.add_argument("--layout", choices=["fsdp1", "fsdp1-orig", "fsdp2", "plain"], required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model, optimizer = build(args.layout, seed=0 if args.mode == "save" else 1)
    manager = CheckpointManager(args.job, model, optimizer, socket=args.socket)
    if args.mode == "save":
        train(model, optimizer, 2, seed=10)
        manager.save(2)
        train(model, optimizer, 1, seed=30)
        manager.save(3, blocking=True)
        # Registered once: FSDP1 trains on in the shared memory it was moved into, and the
        # copies of Adam's step followed the optimizer's steps.
        assert manager._fingerprint() == manager._registered_fingerprint and manager.updates == 0
        manager.save_weights(3, dtype=torch.bfloat16)  # the job <job>-weights
        state = gathered(model, optimizer)
        if rank == 0:
            torch.save(state, os.path.join(args.out, "saved.pt"))
    else:
        assert manager.load() == 3
        state = gathered(model, optimizer)
        if rank == 0:
            torch.save(state, os.path.join(args.out, "loaded.pt"))
    losses = train(model, optimizer, 2, seed=20)
    if rank == 0:
        torch.save(losses, os.path.join(args.out, f"losses-{args.mode}.pt"))
    assert manager._fingerprint() == manager._registered_fingerprint, "FSDP left the shared memory"
    dist.barrier()
    if args.mode == "save":
        print("ready", flush=True)
        time.sleep(600)  # until the test kills this rank
        sys.exit(1)
    manager.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

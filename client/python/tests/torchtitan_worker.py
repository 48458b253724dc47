"""Trains torchtitan's llama3 debug model with torchtitan's own entry point and training loop
(torchtitan.train.main) on the CPU, checkpointing through ckptd (ckptd.torchtitan); for
test_torchtitan.py. Every argument after the worker's own is torchtitan's command line.

Prints, from the last rank (which holds the last pipeline stage, and so the loss), "step N
loss L" per training step (L as a float hex string, to compare runs bit for bit), "resumed
from step N (source)" after a resume from ckptd, "weights H" at the end (a SHA-256 over every
rank's model tensors, optimizer state tensors and learning rates, whole tensors gathered from
their shards) and "export H" (the same, by key, of the model state dict that torchtitan
exports at the last step, in bfloat16: what export_digest() computes from ckptd's files).

What this worker changes in torchtitan (nothing of it is in ckptd.torchtitan). Two changes
for a machine without an accelerator, which torchtitan 0.3.0 assumes:
- the device: torchtitan takes "cuda" when PyTorch finds no accelerator; the CPU is used
  instead, through a stand-in for the torch.cuda functions torchtitan calls (memory
  statistics, device name and properties);
- the attention: the debug model's FlexAttention has no backward pass on the CPU; torchtitan's
  own override mechanism (--override.imports __main__.cpu_attention) swaps in its
  ScaledDotProductAttention (causal attention across document boundaries, which changes
  nothing for checkpointing).
And for the test: the loss printed exactly (torchtitan logs it rounded), an optional delay
per step for the test to kill the run in the middle, and no 2 s pause at the end of a run.
"""
import argparse
import hashlib
import os
import sys
import time
import types

import torch
import torch._utils


def use_the_cpu():
    """torchtitan's device_type and device_module (torchtitan.tools.utils, read when it is
    imported) become "cpu" and a module with what it calls on torch.cuda."""
    cpu = types.ModuleType("torchtitan_cpu_device")
    for name in dir(torch.cpu):
        if not name.startswith("__"):
            setattr(cpu, name, getattr(torch.cpu, name))
    cpu.current_device = lambda: 0
    cpu.get_device_name = lambda device=None: "cpu"
    cpu.get_device_properties = lambda device=None: types.SimpleNamespace(name="cpu", total_memory=1 << 34)
    cpu.reset_peak_memory_stats = lambda device=None: None
    cpu.empty_cache = lambda: None
    cpu.memory_stats = lambda device=None: {"active_bytes.all.peak": 0, "reserved_bytes.all.peak": 0,
                                            "num_alloc_retries": 0, "num_ooms": 0}
    module_of = torch._utils._get_device_module
    torch._utils._get_available_device_type = lambda: "cpu"
    torch._utils._get_device_module = lambda device_type="cpu": cpu if device_type == "cpu" else module_of(device_type)


def say(text):
    """One line on stdout in one write: under torchrun every rank writes into the same pipe
    (run with PYTHONUNBUFFERED=1, so that torchtitan's log lines are whole writes too)."""
    os.write(1, (text + "\n").encode())


def tensor_digest(t):
    """SHA-256 of a tensor's dtype, shape and bytes (the whole tensor, for a DTensor: a
    collective over its mesh)."""
    t = t.detach()
    if type(t).__name__ == "DTensor":
        t = t.full_tensor()
    h = hashlib.sha256(f"{t.dtype} {list(t.shape)}".encode())
    h.update(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def export_digest(tensors):
    """One SHA-256 of {key: tensor} (tensor_digest of each), whatever rank held which key."""
    return hashlib.sha256(repr(sorted((k, tensor_digest(t)) for k, t in tensors.items())).encode()).hexdigest()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--delay", type=float, default=0.0, help="seconds to sleep after each step")
    args, titan_args = parser.parse_known_args()

    use_the_cpu()
    import torch.distributed as dist
    from torchtitan import train
    from torchtitan.components.checkpointer import ModelWrapper
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.config.override import override
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
    from torchtitan import trainer as titan_trainer
    from torchtitan.trainer import Trainer

    @override(target=FlexAttention.Config, description="the CPU: FlexAttention has no backward there")
    def cpu_attention(config):
        return ScaledDotProductAttention.Config()
    globals()["cpu_attention"] = cpu_attention  # --override.imports __main__.cpu_attention

    rank, world_size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    last = rank == world_size - 1
    log = MetricsProcessor.log

    def log_exactly(self, step, global_avg_loss, *rest, **kwargs):
        if last:
            say(f"step {step} loss {float(global_avg_loss).hex()}")
        log(self, step, global_avg_loss, *rest, **kwargs)
        time.sleep(args.delay)

    MetricsProcessor.log = log_exactly
    run = Trainer.train

    def train_and_report(self):
        run(self)
        restored = getattr(self.checkpointer, "restored", None)
        mine = {f"model {k}": tensor_digest(v) for m in self.model_parts for k, v in m.state_dict().items()}
        for o, optimizer in enumerate(self.optimizers.optimizers):
            names = {id(p): n for g in optimizer.param_groups for p, n in zip(g["params"], g["param_names"])}
            for p, state in optimizer.state.items():
                mine.update({f"optim {names[id(p)]} {k}": tensor_digest(v) for k, v in state.items()
                             if torch.is_tensor(v)})
            mine.update({f"lr {o} {g}": repr(group["lr"]) for g, group in enumerate(optimizer.param_groups)})
        export = ModelWrapper(self.model_parts).state_dict()
        exported = {k: tensor_digest(v.to(torch.bfloat16)) for k, v in export.items()}
        everyone = [(mine, exported)]
        if dist.is_initialized():  # pipeline stages: each rank holds its own part
            everyone = [None] * world_size
            dist.all_gather_object(everyone, (mine, exported))
        weights, export = {}, {}
        for w, e in everyone:
            weights.update(w)
            export.update(e)
        if last:
            if restored is not None:
                say(f"resumed from step {int(restored)} ({restored.source})")
            say(f"weights {hashlib.sha256(repr(sorted(weights.items())).encode()).hexdigest()}")
            say(f"export {hashlib.sha256(repr(sorted(export.items())).encode()).hexdigest()}")

    Trainer.train = train_and_report
    # torchtitan's train() ends with a 2 s sleep on rank 0 "for other ranks to complete";
    # train_and_report's all_gather already waits for them. Ten runs a test file: 20 s saved.
    titan_trainer.time = types.SimpleNamespace(perf_counter=time.perf_counter, sleep=lambda seconds: None)
    sys.argv = [sys.argv[0], *titan_args]
    train.main()


if __name__ == "__main__":
    main()

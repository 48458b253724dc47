"""Trains a small MLP in a plain Accelerate loop (one CPU process), checkpointing through
ckptd.torch.CheckpointManager with what `accelerator.prepare` returned; for
test_accelerate.py.

Prints "step N loss L" per step (L as a float hex string, to compare runs bit for bit),
"resumed from step N (SOURCE)" after a resume, and "weights H" at the end (a SHA-256 of every
parameter, the optimizer state and the learning rate). Dropout draws from the global RNG,
the data loader shuffles with its own generator and the scheduler changes the learning rate
every step, so a resume is exact only when all of them come back.
"""
import argparse
import logging
import time

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed

from training_digest import digest
from ckptd.torch import CheckpointManager


class Sampler(torch.utils.data.Sampler):
    """A shuffling sampler whose order is checkpointed: each epoch's permutation comes from
    its own generator, and `position` says how far into it the run got."""

    def __init__(self, n):
        self.n, self.epoch, self.position = n, 0, 0

    def __iter__(self):
        order = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.epoch)).tolist()
        while self.position < self.n:
            self.position += 1
            yield order[self.position - 1]
        self.epoch, self.position = self.epoch + 1, 0

    def __len__(self):
        return self.n

    def state_dict(self):
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state):
        self.epoch, self.position = state["epoch"], state["position"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--socket", required=True)
    parser.add_argument("--job", required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--delay", type=float, default=0.0)
    args = parser.parse_args()
    logging.getLogger("ckptd").setLevel(logging.INFO)

    accelerator = Accelerator(cpu=True)
    set_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                                torch.nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(48, 8, generator=generator)
    data = torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True))
    # Batches of 4 in the sampler's order; the sampler is checkpointed, the loader is not
    # prepared (Accelerate's own shards would replace the sampler). Each iterator over a
    # loader draws a seed for its workers, from the global RNG unless the loader has a
    # generator: a run resumed mid-epoch makes one more, and its dropout would differ.
    sampler = Sampler(len(data))
    loader = torch.utils.data.DataLoader(data, batch_size=4, sampler=sampler,
                                         generator=torch.Generator().manual_seed(2))
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    assert type(optimizer).__name__ == "AcceleratedOptimizer", type(optimizer)

    manager = CheckpointManager(args.job, model, optimizer, scheduler, extra_state={"sampler": sampler},
                                socket=args.socket, interval_steps=args.every)
    restored = manager.load()
    if restored is not None:
        print(f"resumed from step {int(restored)} ({restored.source})", flush=True)
    step = int(restored or 0)
    model.train()
    while step < args.steps:
        for inputs, targets in loader:
            step += 1
            loss = torch.nn.functional.mse_loss(model(inputs), targets)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            print(f"step {step} loss {loss.item().hex()}", flush=True)
            manager.maybe_save(step)
            time.sleep(args.delay)  # gives the test time to kill it mid-run
            if step == args.steps:
                break
    manager.close()
    print(f"weights {digest(accelerator.unwrap_model(model), optimizer)}", flush=True)


if __name__ == "__main__":
    main()

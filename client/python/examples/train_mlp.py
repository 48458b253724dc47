"""Trains a small MLP on synthetic data, checkpointing through ckptd.

    PYTHONPATH=bazel-bin/client/python /usr/bin/python3 client/python/examples/train_mlp.py \
        --socket /tmp/ckptd.sock --steps 100 --save-every 10 [--resume]

Prints one line per step: "step N loss L" (L as a float hex string, so that runs can be
compared bit for bit). RANK and WORLD_SIZE come from the environment, as with torchrun.
"""
import argparse

import torch

from ckptd.torch import CheckpointManager


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--save-every", type=int, default=10)
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    parser.add_argument("--job", default="train-mlp")
    parser.add_argument("--socket", default=None, help="ckptd's socket (default: $CKPTD_SOCKET)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save-on-sigterm", action="store_true",
                        help="checkpoint when preempted (SIGTERM), staged before the process ends "
                             "(also on with CKPTD_SAVE_ON_SIGTERM=1)")
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, args.hidden), torch.nn.ReLU(), torch.nn.Dropout(0.1),
        torch.nn.Linear(args.hidden, args.hidden), torch.nn.ReLU(),
        torch.nn.Linear(args.hidden, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=20, gamma=0.5)
    target = torch.nn.Linear(32, 1)  # the function to learn; fixed by the seed

    with CheckpointManager(args.job, model, optimizer, scheduler, socket=args.socket,
                           interval_steps=args.save_every,
                           save_on_sigterm=args.save_on_sigterm or None) as manager:
        start = 1
        if args.resume:
            restored = manager.load()
            if restored is not None:
                print(f"resumed from step {restored}", flush=True)
                start = restored + 1
        for step in range(start, args.steps + 1):
            x = torch.randn(64, 32)  # the global RNG: restored with the checkpoint
            with torch.no_grad():
                y = target(x)
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            print(f"step {step} loss {loss.item().hex()}", flush=True)
            manager.maybe_save(step)
        manager.wait(committed=True)


if __name__ == "__main__":
    main()

"""Runs the data-loader snippet of docs/python.md ("With a data loader") as a user's script
would, on a small model: prints `step N batch [indices] loss HEX` for every step. Used by
test_dataloader_resume.py; `--generator` gives the loader a generator, `--every N`
saves every N steps, `--job` names the job, `--delay` slows it down. ckptd's socket: $CKPTD_SOCKET."""
import argparse
import re
import time

import torch

DOC = "docs/python.md"

parser = argparse.ArgumentParser()
parser.add_argument("--job", required=True)
parser.add_argument("--steps", type=int, default=14)
parser.add_argument("--every", type=int, default=2)
parser.add_argument("--generator", action="store_true", help="the loader gets generator=")
parser.add_argument("--delay", type=float, default=0.0, help="seconds to sleep after each step")
args = parser.parse_args()

text = open(DOC).read()
code = next(m.group(1) for m in re.finditer(r"^```python\n(.*?)^```", text, re.S | re.M)
            if "StatefulDataLoader(" in m.group(1))
code = code.replace('"my-lm"', repr(args.job)).replace("interval_steps=100", f"interval_steps={args.every}")
if args.generator:
    code, n = re.subn(r"shuffle=True\)", "shuffle=True, generator=torch.Generator().manual_seed(0))", code)
    assert n == 1, code

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
lr_scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.5)
# 10 samples in batches of 4: an epoch is 3 steps.
dataset = [(torch.full((4,), float(i)) / 10, torch.tensor([float(i % 3)]), i) for i in range(10)]


def train_step(batch):
    x, y, index = batch
    loss = torch.nn.functional.mse_loss(model(x), y)  # dropout: the global RNG, every step
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    lr_scheduler.step()
    print(f"step {scope['step']} batch {index.tolist()} loss {loss.item().hex()}", flush=True)
    time.sleep(args.delay)


scope = {"torch": torch, "dataset": dataset, "model": model, "optimizer": optimizer, "lr_scheduler": lr_scheduler,
         "train_step": train_step, "num_steps": args.steps}
exec(compile(code, f"{DOC} (the data-loader snippet)", "exec"), scope)

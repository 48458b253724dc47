"""What a growing embedding table costs ckptd.torch: registering only what changed versus
registering everything again (item 5 of the PyTorch 2 issue).

    bazel build -c opt //client/python:ckptd //daemon:ckptd
    PYTHONPATH=bazel-bin/client/python .venv/bin/python client/python/bench/bench_update.py \
        [--dense-mib 1024] [--table-mib 64] [--grow 0.25] [--root /var/tmp]

A model of dense layers (--dense-mib of parameters, with Adam: three times that in state)
and one embedding table (--table-mib, Adam too). After a first save, the table grows by
--grow of its rows (and its Adam state with it), and the next save is timed:
  update      what ckptd.torch does: the grown tensors move into shared memory and one
              Update call registers them; every other tensor stays registered
  register    the alternative: a new session with every tensor (each moved again)
Each is the time of save() plus wait_staged() for the step after the growth, the median of
--repeats; beside it a save with nothing changed (the copy every save makes) and the first
save (set-up of everything), for scale. Each mode runs in a process of its own.
"""
import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from ckptd.torch import CheckpointManager


def build(dense_mib, table_mib, width=1024):
    layers = max(1, (dense_mib << 20) // (4 * width * width))
    rows = max(1, (table_mib << 20) // (4 * width))
    model = torch.nn.ModuleDict({
        "emb": torch.nn.Embedding(rows, width),
        "dense": torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)]),
    })
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def step(model, optimizer):
    rows = model["emb"].weight.shape[0]
    x = model["emb"](torch.randint(0, rows, (64,)))
    loss = model["dense"](x).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def grow(model, optimizer, fraction):
    weight = model["emb"].weight
    extra = max(1, int(weight.shape[0] * fraction))
    weight.grad = None
    weight.data = torch.cat([weight.detach(), torch.randn(extra, weight.shape[1])])
    state = optimizer.state[weight]
    for key in ("exp_avg", "exp_avg_sq"):
        state[key] = torch.cat([state[key], torch.zeros(extra, weight.shape[1])])


def timed_save(manager, step_number):
    started = time.perf_counter()
    manager.save(step_number)
    manager.wait_staged()
    return time.perf_counter() - started


def run(mode, args, socket):
    model, optimizer = build(args.dense_mib, args.table_mib)
    step(model, optimizer)
    with CheckpointManager(f"grow-{mode}", model, optimizer, socket=socket) as manager:
        if mode == "register":  # every change makes a new session, as before updates existed
            manager._update_changed = lambda entries: False
        first = timed_save(manager, 1)
        plain, times = [], []
        for r in range(args.repeats):
            step(model, optimizer)
            plain.append(timed_save(manager, 2 + 2 * r))
            grow(model, optimizer, args.grow)
            step(model, optimizer)
            times.append(timed_save(manager, 3 + 2 * r))
        state = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        state += sum(v.numel() * v.element_size() for s in optimizer.state.values()
                     for v in s.values() if torch.is_tensor(v))
    return first, statistics.median(times), statistics.median(plain), state


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dense-mib", type=int, default=1024)
    parser.add_argument("--table-mib", type=int, default=64)
    parser.add_argument("--grow", type=float, default=0.25)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--root", default="/var/tmp")
    parser.add_argument("--ckptd", default=os.path.join("bazel-bin", "daemon", "ckptd"))
    parser.add_argument("--only", help=argparse.SUPPRESS)  # one mode, against --socket
    parser.add_argument("--socket", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.only:
        first, after, plain, state = run(args.only, args, args.socket)
        print(f"{args.only:<10} {first:>10.2f}s {plain:>14.3f}s {after:>17.3f}s {state / 2**30:>8.2f} GiB")
        return
    workdir = tempfile.mkdtemp(prefix="ckptd-update-bench.", dir=args.root)
    sockdir = tempfile.mkdtemp(prefix="ckptd-bench.", dir="/tmp")
    socket = os.path.join(sockdir, "ckptd.sock")
    staging = f"{(8 * (args.dense_mib + 2 * args.table_mib)) + 512}M"
    daemon = subprocess.Popen([args.ckptd, "--root", os.path.join(workdir, "ckptd"), "--socket", socket,
                               "--staging-bytes", staging, "--keep-last", "1", "--log-level", "warn"])
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(socket) and time.monotonic() < deadline:
            time.sleep(0.05)
        print(f"dense {args.dense_mib} MiB + table {args.table_mib} MiB of parameters (x3 with Adam), "
              f"table grows by {args.grow:.0%} per save, torch {torch.__version__}")
        print(f"{'mode':<10} {'first save':>11} {'save, no change':>15} {'save after growth':>18} {'state':>10}")
        sys.stdout.flush()
        for mode in ("update", "register"):  # each in a process of its own: memory starts clean
            subprocess.run([sys.executable, __file__, "--only", mode, "--socket", socket,
                            "--dense-mib", str(args.dense_mib), "--table-mib", str(args.table_mib),
                            "--grow", str(args.grow), "--repeats", str(args.repeats)], check=True)
    finally:
        daemon.terminate()
        daemon.wait(timeout=60)
        shutil.rmtree(workdir, ignore_errors=True)
        shutil.rmtree(sockdir, ignore_errors=True)


if __name__ == "__main__":
    main()

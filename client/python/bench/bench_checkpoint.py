"""Checkpointing a PyTorch model with ckptd against torch.save and torch.distributed.checkpoint.

    bazel build //client/python:ckptd //daemon:ckptd
    PYTHONPATH=bazel-bin/client/python /usr/bin/python3 client/python/bench/bench_checkpoint.py \
        [--params 100M] [--checkpoints 3] [--root /var/tmp] [--json]

One run, one model (an MLP with Adam, so the state is 3x the parameters), the same training
loop for every method; each checkpoint follows an optimizer step. Reported per method:
  blocked  how long the training loop was held up per checkpoint (median): the save call
           plus, for ckptd, the wait before the next optimizer step until ckptd had copied;
  total    from the save call until the checkpoint is durable on storage (median).
torch.save and DCP write synchronously (then fsync), so for them blocked == total.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch

import ckptd
from ckptd.torch import CheckpointManager


def parse_count(text):
    scale = {"K": 1e3, "M": 1e6, "G": 1e9}.get(text[-1].upper(), 1)
    return int(float(text[:-1] if text[-1].isalpha() else text) * scale)


def build(params, seed=0):
    torch.manual_seed(seed)
    width = 4096
    layers = max(1, params // (width * width))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    return model, optimizer


def train_step(model, optimizer):
    x = torch.randn(8, model[0].in_features)
    model(x).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def state_bytes(model, optimizer):
    n = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    for state in optimizer.state.values():
        n += sum(v.numel() * v.element_size() for v in state.values() if torch.is_tensor(v))
    return n


def fsync_tree(path):
    for dirpath, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)


def bench_torch_save(model, optimizer, workdir, checkpoints):
    times = []
    for i in range(checkpoints):
        train_step(model, optimizer)
        path = os.path.join(workdir, f"torch-save-{i}.pt")
        start = time.perf_counter()
        with open(path, "wb") as f:
            torch.save({"model": model.state_dict(), "optim": optimizer.state_dict()}, f)
            f.flush()
            os.fsync(f.fileno())
        times.append(time.perf_counter() - start)
        os.remove(path)
    return {"blocked_s": statistics.median(times), "total_s": statistics.median(times)}


def bench_dcp(model, optimizer, workdir, checkpoints):
    try:
        import torch.distributed.checkpoint as dcp
    except ImportError:
        try:
            import torch.distributed._shard.checkpoint as dcp  # PyTorch 1.13's name
        except Exception as e:  # Debian's 1.13 build fails to import it on Python 3.11
            return {"error": f"torch.distributed.checkpoint unusable in torch {torch.__version__}: "
                             f"{type(e).__name__}: {e}"}
    times = []
    for i in range(checkpoints):
        train_step(model, optimizer)
        path = os.path.join(workdir, f"dcp-{i}")
        start = time.perf_counter()
        state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
        dcp.save_state_dict(state, dcp.FileSystemWriter(path), no_dist=True)
        fsync_tree(path)
        times.append(time.perf_counter() - start)
        shutil.rmtree(path)
    return {"blocked_s": statistics.median(times), "total_s": statistics.median(times)}


def bench_ckptd(model, optimizer, socket, checkpoints):
    blocked, total = [], []
    with CheckpointManager("bench", model, optimizer, socket=socket) as manager:
        train_step(model, optimizer)
        manager.save(0, blocking=True)  # the first save moves the state into shared memory
        for i in range(1, checkpoints + 1):
            start = time.perf_counter()
            assert manager.save(i)
            manager.wait_staged()  # what the next optimizer step would wait for
            blocked.append(time.perf_counter() - start)
            manager.wait(committed=True)
            total.append(time.perf_counter() - start)
            train_step(model, optimizer)
    return {"blocked_s": statistics.median(blocked), "total_s": statistics.median(total),
}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default="100M", help="model parameters (K, M, G)")
    parser.add_argument("--checkpoints", type=int, default=3)
    parser.add_argument("--root", default="/var/tmp", help="where checkpoints are written")
    parser.add_argument("--ckptd", default="bazel-bin/daemon/ckptd")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    workdir = tempfile.mkdtemp(prefix="ckptd-torch-bench.", dir=args.root)
    sockdir = tempfile.mkdtemp(prefix="ckptd-bench.", dir="/tmp")
    socket = os.path.join(sockdir, "ckptd.sock")
    model, optimizer = build(parse_count(args.params))
    train_step(model, optimizer)
    size = state_bytes(model, optimizer)
    staging = f"{max(1 << 30, 2 * size + (256 << 20)) >> 20}M"
    daemon = subprocess.Popen([args.ckptd, "--root", os.path.join(workdir, "ckptd"), "--socket", socket,
                               "--staging-bytes", staging, "--keep-last", "1", "--log-level", "warn"])
    try:
        for _ in range(600):
            if os.path.exists(socket):
                break
            time.sleep(0.05)
        results = {
            "torch.save": bench_torch_save(model, optimizer, workdir, args.checkpoints),
            "torch.distributed.checkpoint": bench_dcp(model, optimizer, workdir, args.checkpoints),
            "ckptd": bench_ckptd(model, optimizer, socket, args.checkpoints),
        }
    finally:
        daemon.terminate()
        daemon.wait()
        shutil.rmtree(workdir, ignore_errors=True)
        shutil.rmtree(sockdir, ignore_errors=True)
    out = {"torch": torch.__version__, "state_bytes": size, "checkpoints": args.checkpoints,
           "cpus": os.cpu_count(), "results": results}
    if args.json:
        print(json.dumps(out, indent=2))
        return
    print(f"torch {torch.__version__}, state {size / 2**30:.2f} GiB (model + Adam), "
          f"{args.checkpoints} checkpoints, {os.cpu_count()} CPUs")
    print(f"{'method':32} {'blocked per ckpt':>18} {'total per ckpt':>16}")
    for name, r in results.items():
        if "error" in r:
            print(f"{name:32} {r['error']}")
        else:
            print(f"{name:32} {r['blocked_s'] * 1e3:15.1f} ms {r['total_s']:14.2f} s")


if __name__ == "__main__":
    sys.exit(main())

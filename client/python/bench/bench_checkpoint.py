"""Checkpointing one PyTorch model with ckptd, torch.save and DCP, in one run.

    bazel build -c opt //client/python:ckptd //daemon:ckptd
    PYTHONPATH=bazel-bin/client/python .venv/bin/python client/python/bench/bench_checkpoint.py \
        [--params 230M] [--checkpoints 3] [--root /var/tmp] [--json]

One model (an MLP of 4096-wide layers with Adam: parameters, exp_avg and exp_avg_sq, so
about 2.6 GiB with the default 230M parameters), the same training step (forward,
backward, optimizer step) for every method, each used the way it is meant to be:
  torch.save          torch.save of model and optimizer state dicts, then fsync
  dcp.save            torch.distributed.checkpoint.save (writes and fsyncs)
  dcp.async_save      async_save with the thread checkpointer (stages to CPU, writes in a thread)
  dcp.async_save/proc async_save with the process checkpointer and DCP's DefaultStager over
                      shared memory (pinned memory and async staging need CUDA: off on a CPU host)
  ckptd               ckptd.torch.CheckpointManager: save() returns at once, the copy overlaps
                      the next forward and backward, the next optimizer step waits for it (or,
                      with copy-on-write snapshots, only for the parts it writes before they
                      are copied)
  ckptd/cow           the same with copy_on_write=True (not in the default list: see
                      docs/benchmarks.md)
Reported per method:
  overhead   the loop's mean step time with a checkpoint every 2 steps (--checkpoints of
             them) over the same loop without checkpoints;
  block      the worst case: how much longer the save plus the next optimizer step take than
             that optimizer step alone, when the step follows the save at once (the save
             call, the wait until the state may change again, and whatever slows the step);
  durable    from the save call until the checkpoint is on storage (fsynced; committed for ckptd).
Beside them, this machine's limits measured in the same run: memcpy (torch copy of 1 GiB)
and sequential write + fdatasync (1 GiB in 16 MiB writes) on --root's filesystem.
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
import torch.distributed as dist

from ckptd.torch import CheckpointManager


def parse_count(text):
    scale = {"K": 1e3, "M": 1e6, "G": 1e9}.get(text[-1].upper(), 1)
    return int(float(text[:-1] if text[-1].isalpha() else text) * scale)


def build(params, seed=0):
    torch.manual_seed(seed)
    width = 4096
    layers = max(1, round(params / (width * width + width)))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-6)
    return model, optimizer


def forward_backward(model):
    x = torch.randn(16, model[0].in_features)
    model(x).pow(2).mean().backward()


def train_step(model, optimizer):
    forward_backward(model)
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


# --- the machine's limits ------------------------------------------------------------------

def memcpy_gbps(size=1 << 30, tries=3):
    src, dst = torch.ones(size, dtype=torch.uint8), torch.empty(size, dtype=torch.uint8)
    dst.copy_(src)  # fault the pages in
    best = min(_timed(lambda: dst.copy_(src)) for _ in range(tries))
    return size / best / 1e9


def write_gbps(root, size=1 << 30, chunk=16 << 20):
    path = os.path.join(root, "write-limit.bin")
    block = os.urandom(chunk)
    subprocess.run(["sync"], check=False)

    def write():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            for _ in range(size // chunk):
                os.write(fd, block)
            os.fdatasync(fd)
        finally:
            os.close(fd)

    try:
        return size / _timed(write) / 1e9
    finally:
        os.remove(path)


def _timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


# --- the methods ---------------------------------------------------------------------------
# save(step) starts a checkpoint and returns a handle; state_free(handle) returns once the
# training state may change again; durable(handle) once the checkpoint is on storage.

class TorchSave:
    name = "torch.save"

    def __init__(self, model, optimizer, workdir):
        self.model, self.optimizer, self.workdir = model, optimizer, workdir

    def save(self, step):
        path = os.path.join(self.workdir, f"torch-save-{step}.pt")
        with open(path, "wb") as f:
            torch.save({"model": self.model.state_dict(), "optim": self.optimizer.state_dict()}, f)
            f.flush()
            os.fsync(f.fileno())
        os.remove(path)

    def state_free(self, handle):
        pass

    def durable(self, handle):
        pass

    def close(self):
        pass


class DcpSave(TorchSave):
    name = "dcp.save"

    def state(self):
        from torch.distributed.checkpoint.state_dict import get_state_dict
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        return {"model": model_state, "optimizer": optim_state}

    def path(self, step):
        return os.path.join(self.workdir, f"{self.name.replace('/', '-')}-{step}")

    def save(self, step):
        import torch.distributed.checkpoint as dcp
        dcp.save(self.state(), checkpoint_id=self.path(step))
        shutil.rmtree(self.path(step))


class DcpAsyncThread(DcpSave):
    name = "dcp.async_save"

    def __init__(self, *args):
        super().__init__(*args)
        self.previous = None

    def save(self, step):
        import torch.distributed.checkpoint as dcp
        self._finish_previous()  # DCP allows one async save in flight: wait for the last one
        future = dcp.async_save(self.state(), checkpoint_id=self.path(step))
        self.previous = (step, future)
        return self.previous

    def durable(self, handle):
        step, future = handle
        future.result()
        if os.path.isdir(self.path(step)):
            shutil.rmtree(self.path(step))
        if self.previous is handle:
            self.previous = None

    def _finish_previous(self):
        if self.previous is not None:
            self.durable(self.previous)

    def close(self):
        self._finish_previous()


class DcpAsyncProcess(DcpAsyncThread):
    name = "dcp.async_save/proc"

    def __init__(self, *args):
        super().__init__(*args)
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        cuda = torch.cuda.is_available()
        self.stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=True,
                                                   use_async_staging=cuda, use_non_blocking_copy=cuda))

    def save(self, step):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
        self._finish_previous()
        response = dcp.async_save(self.state(), checkpoint_id=self.path(step),
                                  async_checkpointer_type=AsyncCheckpointerType.PROCESS,
                                  async_stager=self.stager)
        upload = getattr(response, "upload_completion", response)
        staging = getattr(response, "staging_completion", None)
        self.previous = (step, upload)
        self.staging = staging
        return self.previous

    def state_free(self, handle):
        if self.staging is not None:
            self.staging.result()

    def close(self):
        super().close()
        self.stager.close()


class Ckptd:
    name = "ckptd"

    def __init__(self, model, optimizer, socket, copy_on_write=False):
        self.manager = CheckpointManager("bench", model, optimizer, socket=socket, keep_latest_k=1,
                                         copy_on_write=copy_on_write)
        # The first save moves the state into shared memory and registers it: what it holds
        # the loop up (until staged) is reported apart, with where it went; then it is let
        # finish.
        # Patched where the manager looks it up: ckptd.torch imports it from ckptd._state_dict.
        import ckptd.torch as ckptd_torch
        moved = [0.0]
        move = ckptd_torch._move_to_arena

        def timed_move(*args):
            t = time.perf_counter()
            move(*args)
            moved[0] += time.perf_counter() - t
        ckptd_torch._move_to_arena = timed_move
        try:
            start = time.perf_counter()
            assert self.manager.save(0)
            queued = time.perf_counter()
            self.manager.wait_staged()
            self.first_save_s = time.perf_counter() - start
        finally:
            ckptd_torch._move_to_arena = move
        self.first_save_parts = {"move_s": moved[0], "register_and_queue_s": queued - start - moved[0],
                                 "copy_s": self.first_save_s - (queued - start)}
        self.manager.wait(committed=True)

    def save(self, step):
        assert self.manager.save(step)
        return step

    def state_free(self, handle):
        self.manager.wait_staged()  # what the next optimizer step waits for

    def durable(self, handle):
        self.manager.wait(committed=True)

    def close(self):
        self.manager.close()


# --- the measurements ----------------------------------------------------------------------

def loop_step_time(model, optimizer, method, checkpoints, every=2):
    """Mean step time of `every * checkpoints` steps, checkpointing every `every` steps."""
    times, last = [], None
    for step in range(1, every * checkpoints + 1):
        start = time.perf_counter()
        train_step(model, optimizer)
        if method is not None and step % every == 0:
            last = method.save(step)
        times.append(time.perf_counter() - start)
    if method is not None:
        method.durable(last)
    return statistics.mean(times)


def worst_case(model, optimizer, method, checkpoints):
    """(block, durable) medians: a save followed at once by the next optimizer step. The
    block is what the save adds to that step: (save + wait + step) - (the same step alone,
    the median of 3 taken just before on the same gradients)."""
    blocks, durables = [], []
    for i in range(checkpoints):
        forward_backward(model)
        alone = []
        for _ in range(3):
            start = time.perf_counter()
            optimizer.step()
            alone.append(time.perf_counter() - start)
        start = time.perf_counter()
        handle = method.save(1000 + i)
        method.state_free(handle)
        optimizer.step()
        blocks.append(time.perf_counter() - start - statistics.median(alone))
        optimizer.zero_grad(set_to_none=True)
        method.durable(handle)
        durables.append(time.perf_counter() - start)
    return statistics.median(blocks), statistics.median(durables)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default="230M", help="model parameters (K, M, G)")
    parser.add_argument("--checkpoints", type=int, default=3)
    parser.add_argument("--root", default="/var/tmp", help="where checkpoints are written")
    parser.add_argument("--ckptd", default="bazel-bin/daemon/ckptd")
    parser.add_argument("--methods", default="torch.save,dcp.save,dcp.async_save,dcp.async_save/proc,ckptd")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("gloo", rank=0, world_size=1)  # DCP's async paths want a group
    workdir = tempfile.mkdtemp(prefix="ckptd-torch-bench.", dir=args.root)
    sockdir = tempfile.mkdtemp(prefix="ckptd-bench.", dir="/tmp")
    socket = os.path.join(sockdir, "ckptd.sock")
    model, optimizer = build(parse_count(args.params))
    train_step(model, optimizer)
    size = state_bytes(model, optimizer)
    staging = f"{(2 * size + (512 << 20)) >> 20}M"
    daemon = subprocess.Popen([args.ckptd, "--root", os.path.join(workdir, "ckptd"), "--socket", socket,
                               "--staging-bytes", staging, "--keep-last", "1", "--log-level", "warn"])
    results, limits = {}, {}
    try:
        deadline = time.monotonic() + 120
        while not os.path.exists(socket) and time.monotonic() < deadline:
            time.sleep(0.05)
        limits["memcpy_gbps"] = memcpy_gbps()
        limits["write_gbps"] = write_gbps(workdir)
        baseline = [loop_step_time(model, optimizer, None, args.checkpoints)]
        factories = {
            "torch.save": lambda: TorchSave(model, optimizer, workdir),
            "dcp.save": lambda: DcpSave(model, optimizer, workdir),
            "dcp.async_save": lambda: DcpAsyncThread(model, optimizer, workdir),
            "dcp.async_save/proc": lambda: DcpAsyncProcess(model, optimizer, workdir),
            "ckptd": lambda: Ckptd(model, optimizer, socket),
            "ckptd/cow": lambda: Ckptd(model, optimizer, socket, copy_on_write=True),
        }
        for name in args.methods.split(","):
            os.sync()  # the previous method's writes do not land on this one's figures
            try:
                method = factories[name]()
            except Exception as e:  # a method this PyTorch does not offer
                results[name] = {"error": f"{type(e).__name__}: {e}"}
                continue
            try:
                step_s = loop_step_time(model, optimizer, method, args.checkpoints)
                block_s, durable_s = worst_case(model, optimizer, method, args.checkpoints)
                results[name] = {"step_s": step_s, "block_s": block_s, "durable_s": durable_s}
                if hasattr(method, "first_save_s"):
                    results[name]["first_save_s"] = method.first_save_s
                    results[name]["first_save_parts"] = method.first_save_parts
            finally:
                method.close()
            baseline.append(loop_step_time(model, optimizer, None, args.checkpoints))
        limits["write_gbps_after"] = write_gbps(workdir)
    finally:
        daemon.terminate()
        daemon.wait()
        shutil.rmtree(workdir, ignore_errors=True)
        shutil.rmtree(sockdir, ignore_errors=True)
        dist.destroy_process_group()
    base = statistics.median(baseline)
    for r in results.values():
        if "step_s" in r:
            r["overhead"] = r["step_s"] / base - 1
    out = {"torch": torch.__version__, "state_bytes": size, "checkpoints": args.checkpoints,
           "cpus": os.cpu_count(), "baseline_step_s": base, "baseline_runs_s": baseline,
           "limits": limits, "results": results}
    if args.json:
        print(json.dumps(out, indent=2))
        return
    print(f"torch {torch.__version__}, state {size / 2**30:.2f} GiB (model + Adam), "
          f"{args.checkpoints} checkpoints per measure, {os.cpu_count()} CPUs")
    print(f"limits: memcpy {limits['memcpy_gbps']:.1f} GB/s; write + fdatasync "
          f"{limits['write_gbps']:.2f} GB/s before, {limits['write_gbps_after']:.2f} GB/s after "
          f"(the state at that rate: {size / limits['write_gbps'] / 1e9:.1f} s)")
    print(f"step without checkpoints: {base:.3f} s (median of {len(baseline)} loops: "
          + ", ".join(f"{b:.3f}" for b in baseline) + ")")
    print(f"{'method':22} {'overhead':>9} {'block':>9} {'durable':>9}")
    for name, r in results.items():
        if "error" in r:
            print(f"{name:22} {r['error']}")
            continue
        extra = ""
        if "first_save_s" in r:
            parts = r["first_save_parts"]
            extra = (f"   (first save's block, set-up included: {r['first_save_s']:.2f} s: moving "
                     f"into shared memory {parts['move_s']:.2f} s, registering "
                     f"{parts['register_and_queue_s']:.2f} s, copying {parts['copy_s']:.2f} s)")
        print(f"{name:22} {r['overhead'] * 100:8.0f}% {r['block_s']:8.3f}s {r['durable_s']:8.2f}s{extra}")


if __name__ == "__main__":
    sys.exit(main())

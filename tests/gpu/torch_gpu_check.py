"""The PyTorch path with CUDA tensors, end to end and measured (issue 45 item 4).

    torch_gpu_check.py --ckptd daemon/ckptd [--device cuda|cpu] [--params 500M] [--out DIR]

One trainer model, FSDP2 (`fully_shard`) on one rank: a stack of Linear layers whose FP32
parameters compute in BF16 (MixedPrecisionPolicy, as torchtitan trains) with FP32 AdamW
state, and a BF16 buffer, so that the checkpoint holds both dtypes. Against a ckptd this
script starts:
  resume    a trainer process saves every step through ckptd.torch.CheckpointManager, waits
            until step S is committed, records a digest of the whole state (every byte of the
            model's and the optimizer's state dicts) and the losses of the next steps, and is
            killed with SIGKILL; a new process loads and must find the same digest and
            losses: once from ckptd's memory, once from disk after ckptd restarted. While
            the first trainer is registered it records the memory ckptd holds: GPU memory
            of ckptd's process (nvidia-smi: its IPC mappings of the trainer's tensors) and
            the host staging memory ckptd pinned.
  overhead  the training loop's mean step time with a save every step and every 10 steps,
            through ckptd and through DCP `async_save` with its process checkpointer and
            pinned-memory stager (torchtitan's `async_with_pinned_mem`), each with and
            without torch.compile, against the same loop without saves, in one process.
Prints one JSON document (also written to DIR/torch_gpu_check.json); exits non-zero when
a resume is not bit-exact. `--device cpu` runs the same on a host without a GPU (small
sizes: the bundle's own test, tests/gpu/torch_bundle_test.sh).
"""
import argparse
import hashlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist

JOB = "gpu-check"
WIDTH = {"cuda": 4096, "cpu": 256}
BATCH = 16


def parse_count(text):
    scale = {"K": 1e3, "M": 1e6, "G": 1e9}.get(text[-1].upper(), 1)
    return int(float(text[:-1] if text[-1].isalpha() else text) * scale)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


# --- the model -------------------------------------------------------------------------------

def init_group(device):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    if device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=0, world_size=1)


def build(params, device, compile_backend=None):
    """The FSDP2 model and its AdamW, the same for the same arguments (seeded)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    torch.manual_seed(0)
    width = WIDTH[device]
    layers = max(1, round(params / (width * width + width)))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)]).to(device)
    model.register_buffer("scale", torch.linspace(0.5, 1.5, width, dtype=torch.bfloat16, device=device))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    run = torch.compile(model, backend=compile_backend) if compile_backend else model
    return model, optimizer, run


def train_step(run, model, optimizer, step, device):
    """One step on a batch made from the step number alone (the same after a resume)."""
    gen = torch.Generator().manual_seed(step)
    x = torch.randn(BATCH, WIDTH[device], generator=gen).to(device)
    loss = (run(x).float() * model.scale.float()).pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


def state_digest(model, optimizer):
    """sha256 over every byte of the model's and optimizer's state dicts, by name."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    digest = hashlib.sha256()

    def add(name, value):
        if isinstance(value, dict):
            for key in sorted(value, key=str):
                add(f"{name}.{key}", value[key])
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                add(f"{name}.{i}", item)
        elif torch.is_tensor(value):
            local = value.to_local() if hasattr(value, "to_local") else value
            digest.update(f"{name}:{local.dtype}:{tuple(local.shape)}".encode())
            digest.update(local.detach().reshape(-1).contiguous().cpu().view(torch.uint8).numpy().tobytes())
        else:
            digest.update(f"{name}={value!r}".encode())

    model_state, optim_state = get_state_dict(model, optimizer)
    add("model", model_state)
    add("optim", optim_state)
    return digest.hexdigest()


def state_bytes(model, optimizer):
    n = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    for state in optimizer.state.values():
        n += sum(v.numel() * v.element_size() for v in state.values() if torch.is_tensor(v))
    return n


# --- the trainer processes -----------------------------------------------------------------

def daemon_gpu_mib(pid):
    """GPU memory nvidia-smi charges to ckptd's process (its IPC mappings), or why not."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"nvidia-smi: {e}"
    for line in out.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) == 2 and fields[0] == str(pid):
            return int(fields[1])
    return f"ckptd's pid {pid} not among nvidia-smi's compute apps: {out.strip()!r}"


def role_train(args):
    """Saves every step up to --kill-at, records what a resume must find, then dies."""
    from ckptd.torch import CheckpointManager
    init_group(args.device)
    model, optimizer, run = build(args.params_n, args.device)
    manager = CheckpointManager(JOB, model, optimizer, socket=args.socket, keep_last=2)
    assert manager.load() is None, "a fresh job must start from scratch"
    for step in range(1, args.kill_at + 1):
        train_step(run, model, optimizer, step, args.device)
        manager.save(step)
    manager.wait(committed=True)
    sync(args.device)
    record = {"step": args.kill_at, "digest": state_digest(model, optimizer),
              "state_bytes": state_bytes(model, optimizer),
              "trainer_gpu_reserved_bytes": torch.cuda.memory_reserved() if args.device == "cuda" else 0,
              "ckptd_gpu_mib": daemon_gpu_mib(args.daemon_pid) if args.device == "cuda" else "no GPU"}
    record["losses"] = [train_step(run, model, optimizer, s, args.device).item()
                        for s in range(args.kill_at + 1, args.kill_at + 4)]
    with open(args.record, "w") as f:
        json.dump(record, f)
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)  # as a crashed trainer: nothing closes


def role_resume(args):
    """Loads the latest step; prints what it found against the record, as JSON."""
    from ckptd.torch import CheckpointManager
    with open(args.record) as f:
        record = json.load(f)
    init_group(args.device)
    model, optimizer, run = build(args.params_n, args.device)
    manager = CheckpointManager(JOB, model, optimizer, socket=args.socket, keep_last=2)
    start = time.perf_counter()
    restored = manager.load()
    sync(args.device)
    load_s = time.perf_counter() - start
    result = {"step": None if restored is None else int(restored),
              "source": getattr(restored, "source", None), "load_s": load_s,
              "load_gbps": record["state_bytes"] / load_s / 1e9}
    result["digest_matches"] = state_digest(model, optimizer) == record["digest"]
    result["losses_match"] = [train_step(run, model, optimizer, s, args.device).item()
                              for s in range(record["step"] + 1, record["step"] + 4)] == record["losses"]
    manager.close()
    print(json.dumps(result))


def role_overhead(args):
    """Mean loop step times with saves through ckptd and DCP, with and without compile."""
    from ckptd.torch import CheckpointManager
    init_group(args.device)
    results = {}
    for compiled in (False, True):
        backend = (args.compile_backend or "inductor") if compiled else None
        model, optimizer, run = build(args.params_n, args.device, backend)
        step = 0

        def loop(steps, save=None, every=1):
            nonlocal step
            times = []
            for _ in range(steps):
                step += 1
                start = time.perf_counter()
                train_step(run, model, optimizer, step, args.device)
                if save is not None and step % every == 0:
                    save(step)
                sync(args.device)
                times.append(time.perf_counter() - start)
            return times

        label = "compiled" if compiled else "eager"
        manager = CheckpointManager(f"{JOB}-loop-{label}", model, optimizer, socket=args.socket, keep_last=1)
        workdir = tempfile.mkdtemp(prefix="dcp.", dir=args.root)
        dcp = DcpPinned(model, optimizer, workdir, args.device)
        methods = (("ckptd", manager.save, lambda: manager.wait(committed=True)),
                   ("dcp.async_save/pinned", dcp.save, dcp.finish))
        try:
            # Warm up: compile, and each method's first save (registration, moving the state
            # into shared memory, DCP's planning and its process), and any recompilation
            # they cause; none of it is in the figures.
            loop(3)
            for _, save, done in methods:
                loop(2, save, 1)
                done()
            baselines = [statistics.mean(loop(args.loop_steps))]
            measured = {}
            for every in (1, 10):
                steps = max(args.loop_steps, 2 * every)
                for name, save, done in methods:
                    entry = {"step_s": statistics.mean(loop(steps, save, every)), "saves": steps // every}
                    try:
                        done()
                    except Exception as e:  # e.g. ckptd skipped a save: staging still busy
                        entry["last_save"] = f"{type(e).__name__}: {e}"
                    measured[f"{name} every {every}"] = entry
                baselines.append(statistics.mean(loop(args.loop_steps)))
            base = statistics.median(baselines)
            for entry in measured.values():
                entry["overhead"] = entry["step_s"] / base - 1
            results[label] = {"baseline_step_s": base, "baseline_runs_s": baselines, **measured}
        except Exception as e:  # e.g. a PyTorch whose compile cannot take this model
            results[label] = {"error": f"{type(e).__name__}: {e}"}
        finally:
            dcp.close()
            manager.close()
            shutil.rmtree(workdir, ignore_errors=True)
    print(json.dumps(results))


class DcpPinned:
    """DCP async_save as torchtitan's async_with_pinned_mem: the process checkpointer, and
    a stager that copies into pinned (and shared) memory asynchronously (on CUDA)."""

    def __init__(self, model, optimizer, workdir, device):
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        cuda = device == "cuda"
        self.model, self.optimizer, self.workdir = model, optimizer, workdir
        self.stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=True,
                                                   use_async_staging=cuda, use_non_blocking_copy=cuda))
        self.pending = None

    def save(self, step):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
        self.finish()  # DCP allows one async save in flight
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        path = os.path.join(self.workdir, f"step-{step}")
        response = dcp.async_save({"model": model_state, "optimizer": optim_state}, checkpoint_id=path,
                                  async_checkpointer_type=AsyncCheckpointerType.PROCESS,
                                  async_stager=self.stager)
        staging = getattr(response, "staging_completion", None)
        if staging is not None:
            staging.result()  # the state may change only once staged (torchtitan waits here too)
        self.pending = (path, getattr(response, "upload_completion", response))

    def finish(self):
        if self.pending is not None:
            path, upload = self.pending
            upload.result()
            shutil.rmtree(path, ignore_errors=True)
            self.pending = None

    def close(self):
        self.finish()
        self.stager.close()


# --- the parent: ckptd and the trainers ------------------------------------------------------

class Daemon:
    def __init__(self, args, root, sock):
        self.cmd = [args.ckptd, "--root", root, "--socket", sock, "--staging-bytes", args.staging,
                    "--keep-last", "2", "--log-level", "info"]
        self.sock, self.log = sock, open(os.path.join(args.out, "ckptd.log"), "ab")
        self.proc = None

    def start(self):
        if os.path.exists(self.sock):
            os.remove(self.sock)
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while not os.path.exists(self.sock):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"ckptd did not start (see {self.log.name})")
            time.sleep(0.05)

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=120)


def child(args, role, extra=(), timeout=900):
    cmd = [sys.executable, os.path.abspath(__file__), "--role", role, "--device", args.device,
           "--params", args.params, "--socket", args.socket_path, "--record", args.record_path,
           "--root", args.root, "--loop-steps", str(args.loop_steps), "--kill-at", str(args.kill_at),
           *(["--compile-backend", args.compile_backend] if args.compile_backend else []), *extra]
    env = dict(os.environ, CUBLAS_WORKSPACE_CONFIG=":4096:8")
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def last_json(proc, what):
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise SystemExit(f"{what} printed no result (rc {proc.returncode}):\n{proc.stdout}\n{proc.stderr}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ckptd", default="daemon/ckptd")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--params", default=None, help="parameters (K, M, G): 500M on cuda, 2M on cpu")
    parser.add_argument("--kill-at", type=int, default=4, help="the step the first trainer dies after")
    parser.add_argument("--loop-steps", type=int, default=20)
    parser.add_argument("--compile-backend", default=None, help="torch.compile backend (inductor)")
    parser.add_argument("--root", default=None, help="where checkpoints go (default: a temporary folder)")
    parser.add_argument("--out", default="gpu-out")
    parser.add_argument("--skip-overhead", action="store_true")
    parser.add_argument("--role", default="main", help=argparse.SUPPRESS)
    parser.add_argument("--socket", dest="socket_path", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--record", dest="record_path", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--daemon-pid", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.params = args.params or ("500M" if args.device == "cuda" else "2M")
    args.params_n = parse_count(args.params)
    args.socket, args.record = args.socket_path, args.record_path
    if args.role != "main":
        return {"train": role_train, "resume": role_resume, "overhead": role_overhead}[args.role](args)

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no GPU (torch.cuda.is_available() is False)")
    os.makedirs(args.out, exist_ok=True)
    work = tempfile.mkdtemp(prefix="ckptd-torch-gpu.", dir=args.root)
    args.root = work
    args.socket_path = os.path.join(tempfile.mkdtemp(prefix="ckptd-sock."), "ckptd.sock")
    args.record_path = os.path.join(work, "record.json")
    # Staging for two snapshots of the resume model and the loop's two jobs' (same size).
    width = WIDTH[args.device]
    state = args.params_n * 12 + width * 2  # fp32 parameters + two fp32 AdamW moments
    args.staging = f"{(4 * state + (256 << 20)) >> 20}M"
    daemon = Daemon(args, os.path.join(work, "ckptd"), args.socket_path)
    report = {"torch": torch.__version__, "device": args.device, "params": args.params_n,
              "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else None,
              "staging_bytes_pinned": 4 * state + (256 << 20)}
    ok = True
    try:
        daemon.start()
        trained = child(args, "train", ["--daemon-pid", str(daemon.proc.pid)])
        if trained.returncode != -signal.SIGKILL or not os.path.exists(args.record_path):
            raise SystemExit(f"the trainer did not save and die as planned (rc {trained.returncode}):\n"
                             f"{trained.stdout}\n{trained.stderr}")
        with open(args.record_path) as f:
            record = json.load(f)
        report["state_bytes"] = record["state_bytes"]
        report["ckptd_gpu_mib_while_registered"] = record["ckptd_gpu_mib"]
        report["trainer_gpu_reserved_bytes"] = record["trainer_gpu_reserved_bytes"]
        report["resume_from_memory"] = last_json(child(args, "resume"), "the resume from memory")
        daemon.stop()
        daemon.start()  # a new ckptd: its memory is empty, the step is on disk
        report["resume_from_disk"] = last_json(child(args, "resume"), "the resume from disk")
        for where, expected in (("resume_from_memory", "memory"), ("resume_from_disk", "disk")):
            r = report[where]
            r["bit_exact"] = (r["step"] == record["step"] and r["source"] == expected and r["digest_matches"]
                              and r["losses_match"])
            ok = ok and r["bit_exact"]
        if not args.skip_overhead:
            report["loop_overhead"] = last_json(child(args, "overhead", timeout=1800), "the loop overhead")
    finally:
        if daemon.proc is not None and daemon.proc.poll() is None:
            daemon.stop()
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(os.path.dirname(args.socket_path), ignore_errors=True)
    text = json.dumps(report, indent=2)
    print(text)
    with open(os.path.join(args.out, "torch_gpu_check.json"), "w") as f:
        f.write(text + "\n")
    if not ok:
        print("torch_gpu_check: a resume was not bit-exact", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

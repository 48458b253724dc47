"""Fixtures: a real ckptd per test, started from the Bazel-built binary."""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest
import torch

REPO = os.getcwd()  # the runfiles tree under `bazel test`, the repository root otherwise
sys.path.insert(0, os.path.join(REPO, "tools"))
from free_port import free_port  # noqa: E402,F401  (the tests import it from here)
CKPTD = os.environ.get("CKPTD_BIN") or next(
    (p for p in ("daemon/ckptd", "bazel-bin/daemon/ckptd") if os.path.exists(p)), "daemon/ckptd")
CKPTCTL = os.environ.get("CKPTCTL_BIN") or next(
    (p for p in ("client/ckptctl", "bazel-bin/client/ckptctl") if os.path.exists(p)), "client/ckptctl")
PYTHONPATH = os.environ.get("PYTHONPATH", "")


class Daemon:
    """A ckptd process on its own socket and checkpoint root."""

    def __init__(self, workdir, extra=()):
        self.workdir = workdir
        self.extra = list(extra)
        self.socket = os.path.join(workdir, "ckptd.sock")
        self.root = os.path.join(workdir, "ckpt")
        self.log = os.path.join(workdir, "ckptd.log")
        self.process = None

    def start(self):
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(
                [CKPTD, "--root", self.root, "--socket", self.socket, "--staging-bytes", "512M",
                 "--prefault-staging", "false", "--keep-last", "0", "--log-level", "info", *self.extra],
                stdout=log, stderr=log)
        deadline = time.monotonic() + 20
        while not os.path.exists(self.socket):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"ckptd did not start:\n{open(self.log).read()}")
            time.sleep(0.02)
        return self

    def stop(self, sig=signal.SIGTERM):
        if self.process and self.process.poll() is None:
            self.process.send_signal(sig)
            self.process.wait(timeout=30)
        if os.path.exists(self.socket):
            os.unlink(self.socket)

    def restart(self):
        self.stop()
        return self.start()

    def steps(self, job):
        """Committed steps of `job`, from the directory names."""
        path = os.path.join(self.root, job)
        if not os.path.isdir(path):
            return []
        return sorted(int(d[5:]) for d in os.listdir(path) if d.startswith("step-") and "." not in d)


def start_with_metrics(workdir, *extra):
    """A ckptd with /metrics on a port of its choosing (daemon.metrics_port, from its log)."""
    daemon = Daemon(workdir, ["--metrics-addr", "127.0.0.1:0", *extra]).start()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        m = re.search(r"metrics at http://127\.0\.0\.1:(\d+)/metrics", open(daemon.log).read())
        if m:
            daemon.metrics_port = int(m.group(1))
            return daemon
        time.sleep(0.02)
    raise AssertionError("ckptd did not say where its metrics are:\n" + open(daemon.log).read())


@pytest.fixture(autouse=True)
def patient_first_connection(monkeypatch):
    """A save skips itself when ckptd takes over a second to accept the connection (training
    never waits for the daemon); on a loaded 2-core test machine that happens, and a test
    that saves steps 2 and 4 would find step 2 missing. Tests wait instead."""
    try:
        import ckptd.torch
    except ImportError:  # the tests without PyTorch
        return
    monkeypatch.setattr(ckptd.torch, "_CONNECT_PATIENCE_SECONDS", 60.0)


@pytest.fixture
def workdir():
    # Unix socket paths are limited to ~100 bytes: Bazel's TEST_TMPDIR can be longer.
    path = tempfile.mkdtemp(prefix="ckptd-py.", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _serve(d):
    d.start()
    yield d
    d.stop()
    # Shown by pytest only when the test failed: what the daemon saw.
    with open(d.log, errors="replace") as log:
        print("---- ckptd log (last 200 lines) ----\n" + "".join(log.readlines()[-200:]))


@pytest.fixture
def daemon(workdir):
    yield from _serve(Daemon(workdir))


@pytest.fixture
def whole_daemon(workdir):
    """A ckptd that writes every step's files whole (--increments off, format version 4): for
    tests that read a later step's values from its file with the stock safetensors library
    (with increments that file holds only what changed)."""
    yield from _serve(Daemon(workdir, ["--increments", "off"]))


def shard_path(step_dir, rank):
    """Rank `rank`'s shard file in a committed step directory, as its manifest names it:
    rank-00000.safetensors written whole, rank-00000.<run>.safetensors with increments."""
    with open(os.path.join(step_dir, "manifest.json")) as f:
        files = {shard["rank"]: shard["file"] for shard in json.load(f)["shards"]}
    return os.path.join(step_dir, files[rank])


def run_example(*args, env=None, **kwargs):
    """Starts the example trainer with this interpreter; returns the Popen."""
    full_env = dict(os.environ, PYTHONPATH=PYTHONPATH, **(env or {}))
    return subprocess.Popen([sys.executable, "client/python/examples/train_mlp.py", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=full_env, **kwargs)


def losses(stdout):
    """{step: loss hex} from the example's output."""
    out = {}
    for line in stdout.splitlines():
        parts = line.split()
        if len(parts) == 4 and parts[0] == "step" and parts[2] == "loss":
            out[int(parts[1])] = parts[3]
    return out


def last_line(out, word):
    """What follows `word` on the last line of `out` that starts with it."""
    return next(line.split(maxsplit=1)[1] for line in reversed(out.splitlines()) if line.startswith(word + " "))


def same(a, b):
    """Bit-equal nested state (tensors, lists, dicts, numbers)."""
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def finish(process, timeout=120):
    """A worker's stdout once it exited 0 (its stderr's end in the failure otherwise)."""
    out, err = process.communicate(timeout=timeout)
    assert process.returncode == 0, err[-3000:]
    return out


def kill_after_commit(daemon, job, process, step):
    """SIGKILLs the trainer once it prints `step` and ckptd has committed a step of `job`;
    returns what it printed."""
    seen = []
    for line in process.stdout:
        seen.append(line)
        if line.startswith(f"step {step} "):
            deadline = time.monotonic() + 30
            while not daemon.steps(job) and time.monotonic() < deadline:
                time.sleep(0.05)
            process.send_signal(signal.SIGKILL)
            break
    seen.extend(process.stdout)
    process.wait(timeout=60)
    assert process.returncode == -signal.SIGKILL
    assert daemon.steps(job), "no step was committed before the kill"
    return "".join(seen)


def ranks_in_threads(rank, world, timeout=120):
    """Runs rank(r) for every r in range(world), each on a thread of its own (the ranks of one
    job in one process), and returns what they raised (an empty list when none did)."""
    import threading
    errors = []

    def run(r):
        try:
            rank(r)
        except Exception as e:  # noqa: BLE001 - the caller reports it
            errors.append(e)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    return errors

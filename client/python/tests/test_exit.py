"""The interpreter exits cleanly whatever state a CheckpointManager was left in (issue 44).

Each case runs a trainer in a subprocess that leaves a manager open and exits: after a load
that gave up on a stalled ckptd (its connection attempt still under way), mid-save with a
thread waiting for the commit, with ckptd stalled and then gone. An object collected while
the interpreter finalizes (after the atexit hooks) makes the daemon come back or go away and
gives the native calls still under way on other threads time to return then: a thread that
takes the GIL back at that moment used to abort the process ("terminate called without an
active exception"). Each case runs several times; every run must exit 0 with no
"terminate called" in its stderr.
"""
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import PYTHONPATH, Daemon

RUNS = 3

TRAINER = r'''
import os, signal, sys, threading, time, types
import torch
import ckptd, ckptd.torch

socket, state, daemon_pid = sys.argv[1], sys.argv[2], int(sys.argv[3])
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256))
optimizer = torch.optim.Adam(model.parameters())
model(torch.randn(4, 256)).sum().backward()
optimizer.step()
# Two ranks, of which only this one runs: a save waits for the other one until ckptd's
# --step-timeout (the commit never comes sooner, however fast the machine).
manager = ckptd.torch.CheckpointManager("exit-" + state, model, optimizer, socket=socket, daemon_timeout=1.0,
                                        rank=0, world_size=1 if state == "failed-load" else 2)


class AtFinalization:
    """Collected while the interpreter finalizes: runs `action`, then waits until `seconds`
    after it was made, while the native calls under way on other threads come back.
    Everything it uses is its own: module globals may be gone by then."""

    def __init__(self, action, seconds):
        self.action, self.until = action, time.monotonic() + seconds

    def __del__(self, sys=sys, time=time):
        sys.stderr.write(f"collected while finalizing: {sys.is_finalizing()}\n")
        sys.stderr.flush()
        self.action()
        time.sleep(max(0.0, self.until - time.monotonic()))


def at_finalization(action, seconds):
    """Held by a module of its own, which the interpreter drops while it finalizes (not by
    __main__, whose globals a thread still running keeps alive to the end)."""
    holder = types.ModuleType("exit_test_finalizer")
    holder.finalizer = AtFinalization(action, seconds)
    sys.modules[holder.__name__] = holder


def signal_daemon(sig, os=os, pid=daemon_pid):
    def send():
        try:
            os.kill(pid, sig)
        except OSError:
            pass
    return send


def waiting_for_the_commit():
    def wait():
        try:
            manager.wait(committed=True)
        except ckptd.torch.CheckpointError:
            pass  # the step aborted, or ckptd went away
    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    time.sleep(0.2)
    print(f"a thread waits for the commit: {waiter.is_alive()}", flush=True)


if state == "failed-load":
    # ckptd is stalled (SIGSTOP): load() gives up after daemon_timeout with the connection
    # attempt still under way on its thread; ckptd resumes while the interpreter finalizes.
    try:
        manager.load()
        print("loaded?!", flush=True)
    except ckptd.torch.CheckpointError as e:
        print(f"load failed: {e}", flush=True)
    attempt = manager._connector
    print(f"a connection attempt is under way: {attempt is not None and not attempt.done(0)}", flush=True)
    at_finalization(signal_daemon(signal.SIGCONT), 5.0)
elif state == "mid-save":
    # Step 1 waits for rank 1 until ckptd aborts it (--step-timeout 3s), as a rule while the
    # interpreter finalizes: the waiting thread comes back then.
    assert manager.save(1)
    waiting_for_the_commit()
    at_finalization(lambda: None, 7.0)
elif state == "daemon-gone":
    assert manager.save(2)
    waiting_for_the_commit()
    os.kill(daemon_pid, signal.SIGSTOP)  # stalled as the trainer exits, then gone
    at_finalization(signal_daemon(signal.SIGKILL), 5.0)
else:
    raise SystemExit(f"unknown state {state}")
print("exiting", flush=True)
'''


def run_trainer(workdir, daemon, state):
    script = os.path.join(workdir, "trainer.py")
    with open(script, "w") as f:
        f.write(TRAINER)
    env = dict(os.environ, PYTHONPATH=PYTHONPATH)
    started = time.monotonic()
    p = subprocess.run([sys.executable, script, daemon.socket, state, str(daemon.process.pid)],
                       capture_output=True, text=True, env=env, timeout=120)
    return p, time.monotonic() - started


@pytest.mark.parametrize("state", ["failed-load", "mid-save", "daemon-gone"])
def test_a_manager_left_open_never_aborts_the_interpreter_at_exit(workdir, state):
    for run in range(RUNS):
        d = Daemon(os.path.join(workdir, f"{state}-{run}"), ["--step-timeout", "3s"] if state == "mid-save" else [])
        os.makedirs(d.workdir)
        d.start()
        try:
            if state == "failed-load":
                d.process.send_signal(signal.SIGSTOP)
            p, took = run_trainer(workdir, d, state)
        finally:
            d.process.send_signal(signal.SIGCONT)
            d.stop(signal.SIGKILL)
        what = f"run {run}, exit code {p.returncode} after {took:.1f} s\nstdout:\n{p.stdout}\nstderr:\n{p.stderr}"
        assert "terminate called" not in p.stderr, what
        assert p.returncode == 0, what
        # The case was what it says: a native call under way on another thread at exit,
        # and the interpreter finalizing while it could come back.
        assert "exiting" in p.stdout, what
        assert "collected while finalizing: True" in p.stderr, what
        if state == "failed-load":
            assert "load failed: cannot load job 'exit-failed-load': ckptd is not reachable" in p.stdout, what
            assert "a connection attempt is under way: True" in p.stdout, what
        else:
            assert "a thread waits for the commit: True" in p.stdout, what
        # Exit is not held up by what was left open (the trainer, torch's import and the
        # seconds the finalizer waits, on a loaded machine).
        assert took < 60, what

"""What load() does while ckptd is not there (issue 46 item 2): it never waits in silence. It
says at once what it waits for and for how long, and again every few seconds; and it does not
wait at all for a ckptd that is neither there nor starting (no socket, or a socket file that
nothing listens on), raising at once with the path and how to start ckptd.

Real ckptd processes; a ckptd that is starting is one whose start waits on its remote tier's
first answer (an S3 endpoint that accepts connections and never answers).
"""
import logging
import os
import socket
import subprocess
import threading
import time

import pytest
import torch

import ckptd._connection
from ckptd.torch import CheckpointError, CheckpointManager

from conftest import CKPTD


def model():
    torch.manual_seed(0)
    return torch.nn.Linear(4, 4)


@pytest.fixture
def said(caplog, monkeypatch):
    """What the waiting load() logs, with a note every second instead of every 10 s."""
    monkeypatch.setattr(ckptd._connection, "_NOTE_EVERY_SECONDS", 1.0)
    caplog.set_level(logging.INFO, logger="ckptd")
    return lambda: [r.getMessage() for r in caplog.records if r.name == "ckptd" and "ckptd at" in r.getMessage()]


def test_no_socket_fails_at_once_naming_the_path_and_how_to_start_ckptd(workdir):
    path = os.path.join(workdir, "run", "ckptd.sock")  # neither the socket nor its directory
    manager = CheckpointManager("nobody", model(), socket=path)  # daemon_timeout: 120 s
    started = time.monotonic()
    with pytest.raises(CheckpointError) as raised:
        manager.load()
    assert time.monotonic() - started < 5
    message = str(raised.value)
    assert f"ckptd is not reachable at {path}: there is no socket at {path}" in message
    assert "no ckptd is starting there" in message
    assert f"start ckptd (systemctl start ckptd, or ckptd --socket {path} --root DIR)" in message
    assert "Not starting from scratch while a checkpoint may exist" in message
    manager.close()


def test_a_socket_nothing_listens_on_fails_at_once(workdir):
    """What a ckptd that was killed leaves: its socket file, nobody behind it."""
    path = os.path.join(workdir, "ckptd.sock")
    left = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    left.bind(path)
    left.close()
    manager = CheckpointManager("nobody", model(), socket=path)
    started = time.monotonic()
    with pytest.raises(CheckpointError, match=f"{path} is a socket that nothing listens on .*start ckptd"):
        manager.load()
    assert time.monotonic() - started < 5
    manager.close()


def hung_s3_endpoint():
    """A TCP port that accepts connections and never answers: what a ckptd's first look at
    its remote tier waits on."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    return server, f"http://127.0.0.1:{server.getsockname()[1]}"


def test_a_starting_daemon_is_waited_for_saying_so_at_once_and_again(workdir, said, monkeypatch):
    server, endpoint = hung_s3_endpoint()
    for key, value in (("AWS_ACCESS_KEY_ID", "test"), ("AWS_SECRET_ACCESS_KEY", "test"), ("AWS_REGION", "us-east-1")):
        monkeypatch.setenv(key, value)
    path = os.path.join(workdir, "ckptd.sock")
    with open(os.path.join(workdir, "ckptd.log"), "ab") as log:
        starting = subprocess.Popen(
            [CKPTD, "--root", os.path.join(workdir, "ckpt"), "--socket", path, "--staging-bytes", "64M",
             "--prefault-staging", "false", "--remote", "s3://bucket/ckpt", "--remote-mode", "direct",
             "--s3-endpoint", endpoint], stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 30
        while not os.path.exists(path + ".new"):
            assert starting.poll() is None, open(os.path.join(workdir, "ckptd.log")).read()
            assert time.monotonic() < deadline, "ckptd never bound its socket"
            time.sleep(0.02)

        manager = CheckpointManager("late", model(), socket=path, daemon_timeout=3.5)
        started = time.monotonic()
        with pytest.raises(CheckpointError) as raised:
            manager.load()
        took = time.monotonic() - started
        assert starting.poll() is None and not os.path.exists(path)  # still starting throughout
        assert 3.5 <= took < 20
        assert "(waited 3.5 s; a ckptd is starting there" in str(raised.value)
        notes = said()
        assert notes[0].startswith(f"ckptd: load of job 'late' waits up to 3.5 s (daemon_timeout) for "
                                   f"ckptd at {path}: a ckptd is starting there"), notes
        assert len([n for n in notes if "still waits" in n]) >= 2, notes
        manager.close()
    finally:
        starting.kill()  # its start holds SIGTERM until it serves
        starting.wait()
        server.close()


def test_load_waits_for_a_daemon_that_finishes_starting(daemon, said):
    with CheckpointManager("late", model(), socket=daemon.socket) as manager:
        manager.save(1, blocking=True)
    daemon.stop()
    # A ckptd that is starting listens at PATH.new until it serves (as the case above shows
    # of a real one); the real one takes over in 1.5 s.
    early = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    early.bind(daemon.socket + ".new")
    early.listen(16)
    starter = threading.Timer(1.5, daemon.start)
    starter.start()
    try:
        with CheckpointManager("late", model(), socket=daemon.socket, daemon_timeout=60) as manager:
            assert manager.load() == 1
    finally:
        starter.join()
        early.close()
    notes = said()
    assert "waits up to 60 s (daemon_timeout)" in notes[0] and "a ckptd is starting there" in notes[0]
    assert f"ckptd at {daemon.socket} answered after" in notes[-1]

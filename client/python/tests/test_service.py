"""ckptd under a service manager (issue 22 items 2 and 3): Type=notify readiness through
sd_notify, seen on a $NOTIFY_SOCKET as systemd would see it, and gRPC health as a Kubernetes
probe sees it through `ckptctl health`. READY=1 comes once the socket serves and, in a
group, once the group is joined (STATUS says what it waits for until then); STOPPING=1 on
SIGTERM. Health is NOT_SERVING until then, while ckptd.v1.Admin (liveness) serves.
"""
import os
import socket
import subprocess
import time

from conftest import CKPTCTL, CKPTD, free_port


class NotifySocket:
    """The service manager's end: a datagram socket ckptd's sd_notify writes to."""

    def __init__(self, path):
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(path)
        self.messages = []

    def until(self, needle, timeout=20):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(needle in m for m in self.messages):
                return True
            self.sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                self.messages.append(self.sock.recv(4096).decode())
            except socket.timeout:
                break
        return any(needle in m for m in self.messages)


def ckptd(workdir, name, notify, *flags):
    root, sock = os.path.join(workdir, name), os.path.join(workdir, name + ".sock")
    log = open(os.path.join(workdir, name + ".log"), "ab")
    process = subprocess.Popen([CKPTD, "--root", root, "--socket", sock, "--staging-bytes", "64M",
                                "--prefault-staging", "false", *flags],
                               stdout=log, stderr=log, env=dict(os.environ, NOTIFY_SOCKET=notify.path))
    return process, sock


def health(sock, *args):
    """`ckptctl health`'s exit code: 0 ready, 1 not ready, 2 unreachable."""
    return subprocess.run([CKPTCTL, "--socket", sock, "health", "--timeout", "5", *args],
                          capture_output=True, text=True, timeout=30).returncode


def stop(process):
    if process.poll() is None:
        process.terminate()
        process.wait(timeout=30)


def test_ready_once_the_socket_serves_and_stopping_on_sigterm(workdir):
    notify = NotifySocket(os.path.join(workdir, "notify"))
    process, sock = ckptd(workdir, "one", notify)
    try:
        assert notify.until("READY=1"), notify.messages
        assert health(sock) == 0 and health(sock, "--service", "ckptd.v1.Admin") == 0
        assert health(os.path.join(workdir, "nothing.sock")) == 2
        assert os.path.exists(sock)  # what READY promises: the socket is there and serves
        assert any(f"STATUS=serving on {sock}" in m for m in notify.messages)
        process.terminate()
        assert notify.until("STOPPING=1"), notify.messages
        assert process.wait(timeout=30) == 0
    finally:
        stop(process)


def test_in_a_group_ready_waits_for_the_join(workdir):
    port = free_port()
    # The token as a Kubernetes Secret volume presents it: a link into the current version.
    secret = os.path.join(workdir, "secret")
    os.makedirs(os.path.join(secret, "..2026_11_25_version"))
    with open(os.path.join(secret, "..2026_11_25_version", "token"), "w") as f:
        f.write("a-group-token-of-enough-length-0123456789\n")
    os.symlink("..2026_11_25_version", os.path.join(secret, "..data"))
    os.symlink("..data/token", os.path.join(secret, "token"))
    token = os.path.join(secret, "token")
    group = ["--num-nodes", "2", "--coordinator", f"127.0.0.1:{port}", "--group-token-file", token,
             "--group-timeout", "1s"]
    notify1 = NotifySocket(os.path.join(workdir, "notify1"))
    node1, sock1 = ckptd(workdir, "node1", notify1, "--node-rank", "1", *group)
    node0 = None
    try:
        # No coordinator yet: node 1 serves its socket but says what it waits for, not READY.
        assert notify1.until("STATUS=joining the group at"), notify1.messages
        assert not notify1.until("READY=1", timeout=1.5)
        # gRPC health says the same to a probe; the admin service, what a liveness probe
        # asks, is alive all the same: a node waiting for its group is not restarted.
        assert health(sock1) == 1
        assert health(sock1, "--service", "ckptd.v1.Trainer") == 1
        assert health(sock1, "--service", "ckptd.v1.Admin") == 0
        notify0 = NotifySocket(os.path.join(workdir, "notify0"))
        node0, _ = ckptd(workdir, "node0", notify0, "--node-rank", "0", "--group-addr", f"127.0.0.1:{port}", *group)
        assert notify0.until("READY=1"), notify0.messages
        assert notify1.until("READY=1"), notify1.messages
        deadline = time.monotonic() + 20
        while health(sock1) != 0 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert health(sock1) == 0
    finally:
        stop(node1)
        if node0 is not None:
            stop(node0)

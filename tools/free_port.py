"""A TCP port free when picked, outside the kernel's ephemeral range.

A port from a bind of port 0, once closed, can be handed out again at once to another bind of
port 0 (a daemon's own listener, an OSD's) before the process it was picked for binds it. So
tests pick from the ports the kernel never hands out by itself. Run as a program it prints one
(tools/ceph.sh); the Python tests import `free_port` (client/python/tests/conftest.py). The C++
twin: tests/integration/common.h, PickFreePort.
"""

import random
import socket


def free_port():
    lo, hi = 32768, 60999
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(v) for v in f.read().split())
    except (OSError, ValueError):
        pass
    first, last = (10000, lo - 1) if lo > 11000 else (hi + 1, 65535)
    for _ in range(1000):
        port = random.randint(first, last)
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))  # free on every address a daemon may bind
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {first}-{last}")


if __name__ == "__main__":
    print(free_port())

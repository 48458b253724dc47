"""Reaching ckptd without holding up training: whether its socket listens (answered at once),
one connection attempt on a thread of its own, the rank and world size from the environment,
and the stacklevel that points a warning at the user's line.
"""
import os
import socket
import sys
import threading

import ckptd


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def _user_stacklevel():
    """The stacklevel for warnings.warn that points at the first frame outside this package:
    the user's line (maybe_save, save, load), however deep inside the manager the warning
    is raised."""
    frame, level = sys._getframe(1), 1  # the caller of this function, the one that warns
    while frame is not None and os.path.dirname(os.path.abspath(frame.f_code.co_filename)) == _PACKAGE_DIR:
        frame, level = frame.f_back, level + 1
    return level


def _listening(path):
    """Whether a process accepts connections on the Unix socket at `path`: answered at once
    (no file, or nobody listening, is an immediate error)."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(0.5)
    try:
        probe.connect(path)
        return True
    except OSError:
        return False
    finally:
        probe.close()


class _Connector:
    """One attempt to connect to ckptd, on a thread of its own."""

    def __init__(self, connect):
        self.client = self.error = None
        self._thread = threading.Thread(target=self._run, args=(connect,), daemon=True,
                                        name="ckptd-connect")
        self._thread.start()

    def _run(self, connect):
        try:
            self.client = connect()
        except BaseException as e:  # whatever it is, the caller learns it, not a crash later
            self.error = e if isinstance(e, ckptd.Error) else ckptd.Unavailable(f"{type(e).__name__}: {e}")

    def done(self, timeout):
        self._thread.join(timeout)
        return not self._thread.is_alive()


def _env_int(*names):
    for name in names:
        if os.environ.get(name):
            return int(os.environ[name])
    return None

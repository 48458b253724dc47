"""Reaching ckptd without holding up training: whether its socket listens (answered at once),
one connection attempt on a thread of its own, what a load() that waits for ckptd says (and
when it gives up at once), the rank and world size from the environment, and the stacklevel
that points a warning at the user's line.
"""
import errno
import logging
import os
import socket
import sys
import threading
import time

import ckptd
from ckptd._errors import CheckpointError

log = logging.getLogger("ckptd")


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


# A ckptd that is starting listens at PATH.new, and renames it to PATH once it serves
# (daemon/control/unix_listener.h): a client that finds PATH.new listening waits for it.
_STARTING_SUFFIX = ".new"
# How often a load() that waits for ckptd says so again.
_NOTE_EVERY_SECONDS = 10.0
# How often a waiting load() looks at PATH.new: each look is a connection that the starting
# ckptd accepts only once it serves.
_STARTING_LOOK_SECONDS = 1.0


def _connect_errno(path):
    """0 when a process accepts connections at the Unix socket `path`, else connect()'s errno
    (EAGAIN for a listener too busy to take one now). Answered at once."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(0.5)
    try:
        probe.connect(path)
        return 0
    except socket.timeout:
        return errno.EAGAIN
    except OSError as e:
        return e.errno or errno.EIO
    finally:
        probe.close()


def _socket_state(path, starting=None):
    """What is at ckptd's socket `path`: ("listening", why), ("starting", why) when a ckptd is
    starting there, or a state in which nothing will answer: ("missing", why), ("refused",
    why: a socket file left by a ckptd that exited) or ("denied", why). `starting`, when
    given, is whether PATH.new was found listening (so that a caller can look less often)."""
    error = _connect_errno(path)
    if error in (0, errno.EAGAIN):
        return "listening", f"ckptd at {path} accepts connections"
    if error in (errno.EACCES, errno.EPERM):
        return "denied", f"this user may not connect to {path} (permission denied)"
    if starting is None:
        starting = _connect_errno(path + _STARTING_SUFFIX) in (0, errno.EAGAIN)
    if starting:
        return "starting", f"a ckptd is starting there (it listens at {path}{_STARTING_SUFFIX} until it serves)"
    if error == errno.ECONNREFUSED:
        return "refused", (f"{path} is a socket that nothing listens on (its ckptd exited?), and no "
                           f"ckptd is starting there")
    return "missing", f"there is no socket at {path} ({os.strerror(error)}), and no ckptd is starting there"


def _what_to_do(state, path):
    if state == "denied":
        return (f"join the group that owns {path} (ls -l {path}), or have ckptd allow this user "
                "(--allow-uid, --allow-gid; docs/security.md)")
    return (f"start ckptd (systemctl start ckptd, or ckptd --socket {path} --root DIR), or point "
            "the socket (socket=, $CKPTD_SOCKET) at the one that runs")


class _DaemonWait:
    """What a load() says while it waits for ckptd at `path`, for `timeout` seconds: at once
    what it waits for and how long, then every _NOTE_EVERY_SECONDS (on `speaks`: one rank of
    the node, the others log at INFO). Nothing waits for a ckptd that is neither there nor
    starting: that raises at once."""

    _FATAL = ("missing", "refused", "denied")

    def __init__(self, path, what, timeout, speaks=True):
        self.path, self.what, self.timeout = path, what, timeout
        self.level = logging.WARNING if speaks else logging.INFO
        self.started = time.monotonic()
        self._next_note = self.started
        self._next_look = self.started
        self._starting = None
        self._noted = False

    def failed(self, error=None):
        """After an attempt that did not connect (`error`: why, when a connection was made):
        raises CheckpointError when nothing will answer or the time is up; else says what it
        waits for when it is time to, and returns how long to sleep before the next attempt."""
        now = time.monotonic()
        starting = self._starting if now < self._next_look else None
        state, why = _socket_state(self.path, starting)
        if starting is None:
            self._starting, self._next_look = state == "starting", now + _STARTING_LOOK_SECONDS
        if state == "listening" and error is not None:
            why = f"ckptd at {self.path} accepts connections but has not answered ({error})"
        advice = ("Not starting from scratch while a checkpoint may exist: {}; to train without "
                  "ckptd, catch this error")
        if state in self._FATAL:
            raise CheckpointError(f"cannot load {self.what}: ckptd is not reachable at {self.path}: "
                                  f"{why}. " + advice.format(_what_to_do(state, self.path)))
        left = self.started + self.timeout - now
        if left <= 0:
            raise CheckpointError(f"cannot load {self.what}: ckptd is not reachable at {self.path} "
                                  f"(waited {self.timeout:g} s; {why}). "
                                  + advice.format("start ckptd, or raise daemon_timeout"))
        if now >= self._next_note:
            if not self._noted:
                log.log(self.level, "ckptd: load of %s waits up to %g s (daemon_timeout) for ckptd at %s: %s",
                        self.what, self.timeout, self.path, why)
            else:
                log.log(self.level, "ckptd: load of %s still waits for ckptd at %s (%.0f of %g s): %s",
                        self.what, self.path, now - self.started, self.timeout, why)
            self._noted = True
            self._next_note = now + _NOTE_EVERY_SECONDS
        return min(0.25, left)

    def answered(self):
        if self._noted:
            log.log(self.level, "ckptd: ckptd at %s answered after %.1f s; loading %s",
                    self.path, time.monotonic() - self.started, self.what)


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

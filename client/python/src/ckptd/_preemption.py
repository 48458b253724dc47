"""A checkpoint when the process is told to stop (SIGTERM: preemption, a job rescheduled).

The signal can arrive anywhere in a training step: between the optimizer step and the LR
scheduler's, halfway through a data loader's batch. Only the training loop knows when its
state is whole, and it says so by calling maybe_save(step) at the end of every step. So the
handler only takes note, and the next maybe_save() saves that step whatever the interval,
waits until ckptd has copied it (staged), and then lets the stop go on: the handler that was
installed before runs, and the default one ends the process. ckptd writes and commits the
checkpoint on its own after the trainer is gone. The job scheduler's grace period must
cover the rest of one training step plus the staging (the `block` figure of
docs/benchmarks.md); the node must stay up until ckptd has written the checkpoint.
"""
import logging
import os
import signal
import threading
import warnings

log = logging.getLogger("ckptd")


class PreemptionSaver:
    def __init__(self):
        self.requested = False
        self._previous = None
        if threading.current_thread() is not threading.main_thread():
            warnings.warn("save_on_sigterm: signal handlers can only be installed from the main "
                          "thread; no checkpoint will be taken on SIGTERM", RuntimeWarning, stacklevel=3)  # the user's CheckpointManager(...)
            return
        self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum, frame):
        if not self.requested:
            log.warning("ckptd: SIGTERM: the next maybe_save() saves its step, then the process stops")
        self.requested = True

    def stop(self, save):
        """Saves (`save()`: True once staged) and lets the stop go on."""
        self.requested = False
        try:
            if not save():
                log.warning("ckptd: SIGTERM: no checkpoint (ckptd unreachable)")
        except Exception as e:  # never keep the process from stopping
            log.error("ckptd: SIGTERM: no checkpoint: %s", e)
        self._resume_stop()

    def close(self):
        """The manager closes: a stop that was asked for and not yet carried out (no
        maybe_save came after the signal) goes on now, without a checkpoint; otherwise the
        previous handler is simply put back."""
        if self.requested:
            self.requested = False
            log.warning("ckptd: SIGTERM arrived after the last maybe_save(): stopping without "
                        "a checkpoint of the last steps")
            self._resume_stop()
        else:
            self.uninstall()

    def uninstall(self):
        """Puts the previous handler back; returns it."""
        previous, self._previous = self._previous, None
        if previous is not None and signal.getsignal(signal.SIGTERM) == self._on_sigterm:
            signal.signal(signal.SIGTERM, previous)
        return previous

    def _resume_stop(self):
        previous = self.uninstall()
        if callable(previous):
            previous(signal.SIGTERM, None)
        elif previous == signal.SIG_IGN:
            pass  # SIGTERM was ignored before the manager came: it still is
        else:  # the default action (or a handler installed from C, seen as None): end
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            # Still here: PID 1 in a container ignores its own default-action signals.
            os._exit(128 + signal.SIGTERM)

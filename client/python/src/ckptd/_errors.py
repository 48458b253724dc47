"""The package's own error, in a module of its own: every module raises it without importing
the manager (ckptd.torch, which re-exports it as its public name)."""
import ckptd


class CheckpointError(ckptd.Error):
    """A checkpoint that was asked for could not be taken, committed or loaded."""


# Its public home: tracebacks and reprs name it ckptd.torch.CheckpointError, as users import it.
CheckpointError.__module__ = "ckptd.torch"

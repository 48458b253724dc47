"""ckptd: checkpoint training state through the node's ckptd daemon.

`ckptd.torch.CheckpointManager` is what PyTorch trainers use; `ckptd.connect()` is the
underlying client (the C++ client, bound with pybind11) for other frameworks.
"""
import os

from ._native import ArenaBuffer, Client, Error, Unavailable, connect, list_checkpoints

__all__ = ["ArenaBuffer", "Client", "Error", "Unavailable", "connect", "default_socket",
           "list_checkpoints"]
__version__ = "0.1.0"


def default_socket():
    """The daemon's socket: $CKPTD_SOCKET, else the packaged default."""
    return os.environ.get("CKPTD_SOCKET", "/run/ckptd/ckptd.sock")

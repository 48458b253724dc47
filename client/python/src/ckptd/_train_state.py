"""The train state's encoding: the small entries beside the tensors (the step, RNG states, LR
scheduler, optimizer hyper-parameters, extra_state) are torch.save or pickle bytes, and are
read back as data only, never code (docs/security.md).
"""
import io
import pickle

import torch


def _to_bytes(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _from_bytes(data):
    # A checkpoint is data from a file: never code. weights_only loads tensors, containers
    # and numbers (state dicts), nothing that runs on load. PyTorch 1.13's weights-only
    # loader lacks opcodes (floats): there the same rule is kept by an allowlist.
    if _TORCH_MAJOR >= 2:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    # 1.13's torch.load ignores pickle_module unless weights_only (a bug): its zip loader is
    # called directly, with the allowlist.
    from torch import serialization
    with serialization._open_zipfile_reader(io.BytesIO(data)) as archive:
        return serialization._load(archive, "cpu", _StateDictPickle, encoding="utf-8")


_TORCH_MAJOR = int(torch.__version__.split(".")[0])


class _StateDictUnpickler(pickle.Unpickler):
    """What a state dict is made of (tensors, their storages, ordered dicts, sizes) and
    nothing else: no class or function that could run code on load."""

    _ALLOWED = {("collections", "OrderedDict"), ("torch._utils", "_rebuild_tensor_v2"),
                ("torch._utils", "_rebuild_parameter"), ("torch", "Size"), ("torch", "device"),
                ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "complex")}

    def find_class(self, module, name):
        if (module, name) in self._ALLOWED or (module == "torch" and name.endswith("Storage")):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"train state refers to {module}.{name}: refused")


class _StateDictPickle:
    """A pickle module for torch.load that unpickles with _StateDictUnpickler."""
    Unpickler = _StateDictUnpickler
    __name__ = "ckptd_state_dict_pickle"

    @staticmethod
    def load(file, **kwargs):
        return _StateDictUnpickler(file, **kwargs).load()


class _PlainUnpickler(pickle.Unpickler):
    """Unpickles ints, tuples and None (the step, Python's RNG state) and nothing that
    names a class or function: a crafted blob cannot run code."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"train state refers to {module}.{name}: refused")


def _plain_loads(data):
    return _PlainUnpickler(io.BytesIO(data)).load()

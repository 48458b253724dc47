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
                ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "complex"),
                # bytes in torch.save's pickle protocol 2 (PyTorch 2's weights-only reader
                # allows it too): it turns a string into bytes, nothing else.
                ("_codecs", "encode")}

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


# --- io.BytesIO in extra_state ----------------------------------------------------------
# Some state_dict()s hold io.BytesIO objects (torchtitan's TrainState torch.saves its loss
# history into them). A BytesIO is not plain data for the weights-only reader, but its
# content is bytes, which is: it travels as bytes, and where it was (its path of keys and
# indices) travels beside the value, so load_state_dict() gets a BytesIO back, at position 0.


def _bytesio_out(value, path=()):
    """`value` with every io.BytesIO in its dicts, lists and tuples replaced by its bytes, and
    the paths of those that were replaced."""
    if isinstance(value, io.BytesIO):
        return value.getvalue(), [path]
    if isinstance(value, dict) and _holds_bytesio(value):
        out, paths = {}, []
        for k, v in value.items():
            out[k], found = _bytesio_out(v, path + (k,))
            paths += found
        return out, paths
    if isinstance(value, (list, tuple)) and _holds_bytesio(value):
        items, paths = [], []
        for i, v in enumerate(value):
            item, found = _bytesio_out(v, path + (i,))
            items.append(item)
            paths += found
        return (items if isinstance(value, list) else tuple(items)), paths
    return value, []


def _holds_bytesio(value):
    if isinstance(value, io.BytesIO):
        return True
    if isinstance(value, dict):
        return any(_holds_bytesio(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_bytesio(v) for v in value)
    return False


def _bytesio_in(value, paths):
    """The inverse of _bytesio_out: the bytes at each of `paths` become an io.BytesIO again."""
    for path in paths:
        if not path:
            return io.BytesIO(value)
        value = _replaced(value, list(path))
    return value


def _replaced(node, path):
    key = path[0]
    if isinstance(node, tuple):
        items = list(node)
        items[key] = io.BytesIO(items[key]) if len(path) == 1 else _replaced(items[key], path[1:])
        return tuple(items)
    node[key] = io.BytesIO(node[key]) if len(path) == 1 else _replaced(node[key], path[1:])
    return node

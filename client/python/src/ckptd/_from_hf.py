"""Loading a Hugging Face folder (safetensors files, with or without their index) into a model:
a warm start from weights (`CheckpointManager.load(from_hf=PATH)`), the way OLMo-core loads a
weights-only directory. What `ckptctl export` writes loads back, and so does a folder
downloaded from a hub.

The files are data: every header is checked (its size, each tensor's dtype, shape and byte
range inside the file) before a byte of it is used. Names map onto the model's keys through
the same rules as `ckptctl export --rename` (exact names, "prefix.*" rules, "" to leave a
tensor out), and each tensor is cast to the dtype of the parameter it fills.
"""
import json
import math
import mmap
import os

import torch

from ckptd._errors import CheckpointError
from ckptd._state_dict import _TORCH_DTYPES

_MAX_HEADER_BYTES = 100 << 20  # what the safetensors library itself accepts


def read_folder(path):
    """{name: tensor} of every tensor in the folder (or the one .safetensors file), each a view
    of a read-only mapping of its file."""
    path = os.fspath(path)
    if os.path.isfile(path):
        files = [path]
    else:
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.isfile(index):
            with open(index) as f:
                weight_map = json.load(f).get("weight_map")
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index}: no weight_map")
            names = sorted(set(weight_map.values()))
            for name in names:
                if os.path.basename(name) != name or not name.endswith(".safetensors"):
                    raise CheckpointError(f"{index}: {name!r} is not a .safetensors file of the folder")
            files = [os.path.join(path, name) for name in names]
        else:
            files = sorted(os.path.join(path, n) for n in os.listdir(path) if n.endswith(".safetensors"))
        if not files:
            raise CheckpointError(f"{path}: no .safetensors file (a Hugging Face folder has "
                                  "model.safetensors, or shards and model.safetensors.index.json)")
    tensors = {}
    for file in files:
        for name, tensor in _read_file(file).items():
            if name in tensors:
                raise CheckpointError(f"{path}: tensor {name} is in two files")
            tensors[name] = tensor
    return tensors


def _read_file(file):
    with open(file, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 8:
            raise CheckpointError(f"{file}: not a safetensors file (too short)")
        # Copy-on-write: a writable buffer for torch.frombuffer that costs no memory until
        # written (nothing writes it) and never writes the file.
        data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    header_len = int.from_bytes(data[:8], "little")
    if header_len > min(_MAX_HEADER_BYTES, size - 8):
        raise CheckpointError(f"{file}: its header claims {header_len} bytes")
    try:
        header = json.loads(bytes(data[8:8 + header_len]))
    except ValueError as e:
        raise CheckpointError(f"{file}: its header is not JSON: {e}") from e
    if not isinstance(header, dict):
        raise CheckpointError(f"{file}: its header is not a JSON object")
    start = 8 + header_len
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = _TORCH_DTYPES[entry["dtype"]]
            shape = [int(d) for d in entry["shape"]]
            lo, hi = (int(x) for x in entry["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{file}: tensor {name}: a header entry safetensors cannot have ({e})") from e
        itemsize = torch.empty(0, dtype=dtype).element_size()
        nbytes = math.prod(shape) * itemsize
        if any(d < 0 for d in shape) or lo < 0 or hi - lo != nbytes or start + hi > size:
            raise CheckpointError(f"{file}: tensor {name}: shape {shape} of {entry['dtype']} does not "
                                  f"fit bytes [{lo}, {hi}) of the data")
        raw = torch.frombuffer(data, dtype=torch.uint8, count=nbytes, offset=start + lo) if nbytes \
            else torch.empty(0, dtype=torch.uint8)
        if (start + lo) % itemsize:
            raw = raw.clone()  # an offset the dtype cannot view in place: copied, not refused
        tensors[name] = raw.view(dtype).view(shape)
    return tensors


def rename(name, rules):
    """`ckptctl export --rename`'s rules (client/export/rename_rules.h), applied in Python:
    an exact name beats every prefix, the longest "prefix.*" wins, "" leaves a tensor out;
    None when it is left out."""
    if name in rules:
        return rules[name] or None
    best = None
    for old, new in rules.items():
        if old.endswith("*") and name.startswith(old[:-1]) and (best is None or len(old) > len(best)):
            best = old
    if best is None:
        return name
    new = rules[best]
    return new[:-1] + name[len(best) - 1:] if new else None


def check_rules(rules):
    if not isinstance(rules, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in rules.items()):
        raise TypeError("rename is a dict of names (or 'prefix.*' rules) to names ('' leaves one out)")
    for old, new in rules.items():
        if ("*" in old[:-1]) or ("*" in new[:-1]) or (new and old.endswith("*") != new.endswith("*")):
            raise ValueError(f"rename rule {old!r}: {new!r}: a '*' may only end both sides")

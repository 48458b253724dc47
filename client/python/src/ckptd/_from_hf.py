"""Loading a Hugging Face folder (safetensors files, with or without their index) into a model:
a warm start from weights (`CheckpointManager.load(from_hf=PATH)`), the way OLMo-core loads a
weights-only directory. What `ckptctl export` writes loads back, and so does a folder
downloaded from a hub.

The files are data: every header is checked (its size, each tensor's dtype, shape and byte
range inside the file) before a byte of it is used. Names map onto the model's keys through
the same rules as `ckptctl export --rename` (exact names, "prefix.*" rules, "" to leave a
tensor out), and each tensor is cast to the dtype of the parameter it fills.

A model already sharded (DTensor: FSDP2's `fully_shard`, tensor parallelism) is loaded shard
by shard: each rank asks the read planner that restores ckptd steps (format/read_plan.h,
through `ckptd._native.plan_read`), with the folder's files as the saved shards, for the
bytes of the box it holds, and reads only those (from a mapping of each file: the pages of
other ranks' rows are never read), so a model larger than one rank's memory warm-starts.
"""
import json
import math
import mmap
import os

import torch

from ckptd import _placement
from ckptd._errors import CheckpointError
from ckptd._state_dict import _TORCH_DTYPES, _aliases, _named_parameters, _persistent_buffers

_MAX_HEADER_BYTES = 100 << 20  # what the safetensors library itself accepts


class _File:
    """One safetensors file, mapped: `entries` {name: (dtype name, shape, begin, end)}, byte
    ranges of the data region, which starts at byte `start` of `data`."""

    __slots__ = ("path", "data", "start", "entries")

    def __init__(self, path, data, start, entries):
        self.path, self.data, self.start, self.entries = path, data, start, entries

    def bytes_at(self, offset, count):
        """A uint8 view of `count` bytes at `offset` of the data region (no copy)."""
        if count == 0:
            return torch.empty(0, dtype=torch.uint8)
        return torch.frombuffer(self.data, dtype=torch.uint8, count=count, offset=self.start + offset)

    def tensor(self, name):
        dtype_name, shape, lo, hi = self.entries[name]
        dtype = _TORCH_DTYPES[dtype_name]
        raw = self.bytes_at(lo, hi - lo)
        if (self.start + lo) % _itemsize(dtype):
            raw = raw.clone()  # an offset the dtype cannot view in place: copied, not refused
        return raw.view(dtype).view(shape)


def folder_files(path):
    """The folder's (or the one .safetensors file's) files, each mapped with its header
    checked; no tensor is in two of them."""
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
    opened, seen = [], set()
    for file in files:
        opened.append(_open_file(file))
        for name in opened[-1].entries:
            if name in seen:
                raise CheckpointError(f"{path}: tensor {name} is in two files")
            seen.add(name)
    return opened


def read_folder(path):
    """{name: tensor} of every tensor in the folder (or the one .safetensors file), each a view
    of a read-only mapping of its file."""
    return {name: f.tensor(name) for f in folder_files(path) for name in f.entries}


def _open_file(file):
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
    entries = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = _TORCH_DTYPES[entry["dtype"]]
            shape = [int(d) for d in entry["shape"]]
            lo, hi = (int(x) for x in entry["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{file}: tensor {name}: a header entry safetensors cannot have ({e})") from e
        itemsize = _itemsize(dtype)
        nbytes = math.prod(shape) * itemsize
        if any(d < 0 for d in shape) or lo < 0 or hi - lo != nbytes or start + hi > size:
            raise CheckpointError(f"{file}: tensor {name}: shape {shape} of {entry['dtype']} does not "
                                  f"fit bytes [{lo}, {hi}) of the data")
        entries[name] = (entry["dtype"], shape, lo, hi)
    return _File(file, data, start, entries)


def load_into(path, model, rules, strict, warn):
    """Loads the folder's tensors into `model`'s parameters and persistent buffers in place,
    each rank its own shard of a sharded one; returns (tensors loaded, bytes this rank
    filled). Names and shapes that do not match raise CheckpointError (with `strict`) or
    are passed to `warn` (without)."""
    files = folder_files(path)
    where = {name: (i, f.entries[name]) for i, f in enumerate(files) for name in f.entries}
    wanted = dict(_named_parameters(model))
    for name, module, leaf in _persistent_buffers(model):
        wanted.setdefault(name, module._buffers[leaf])
    aliases = _aliases(model)  # a tied name fills the one tensor behind both
    pieces, unexpected = [], []  # pieces: (folder name, model key, local tensor, box)
    for name in sorted(where):
        key = rename(name, rules)
        if key is None:
            continue
        key = aliases.get(key, key)
        if key not in wanted:
            unexpected.append(name)
            continue
        target, shape = wanted[key], where[name][1][1]
        if tuple(shape) != tuple(target.shape):  # a DTensor's shape is the global one
            raise CheckpointError(f"load(from_hf={path!r}): {name} is {list(shape)} in the "
                                  f"folder, {key} is {list(target.shape)} in the model")
        if _placement.is_dtensor(target):
            local, global_shape, offset = _placement.box(key, target, CheckpointError)
        else:
            local, global_shape, offset = target, [], []
        pieces.append((name, key, local, global_shape, offset))
    missing = sorted(set(wanted) - {key for _, key, *_ in pieces})
    if missing or unexpected:
        what = "; ".join(part for part in (
            f"{len(missing)} of the model's tensors are not in it ({', '.join(missing[:5])}"
            f"{', ...' if len(missing) > 5 else ''})" if missing else "",
            f"{len(unexpected)} of its tensors are not in the model ({', '.join(unexpected[:5])}"
            f"{', ...' if len(unexpected) > 5 else ''})" if unexpected else "") if part)
        if strict:
            raise CheckpointError(f"load(from_hf={path!r}): {what}. What to do: rename=... maps "
                                  "the folder's names onto the model's (as ckptctl export "
                                  "--rename), or strict=False loads what matches")
        warn(f"ckptd: load(from_hf={path!r}) (strict=False): {what}")
    from ckptd._native import plan_read
    saved = [(name, dtype, shape, i, lo, hi) for name, (i, (dtype, shape, lo, hi)) in where.items()]
    try:
        plans = plan_read(saved, [(name, where[name][1][0], list(local.shape), global_shape, offset)
                                  for name, _, local, global_shape, offset in pieces])
    except ValueError as e:
        raise CheckpointError(f"load(from_hf={path!r}): {e}") from e
    nbytes = 0
    with torch.no_grad():
        for (name, _, local, _, _), (size, reads) in zip(pieces, plans):
            local.copy_(_read_piece(files, where[name][1][0], list(local.shape), size, reads))  # cast
            nbytes += local.numel() * local.element_size()
    return len(pieces), nbytes


def _read_piece(files, dtype_name, shape, size, reads):
    """The planned piece as a tensor of the folder's dtype: a view of the file where it is one
    run of it, else gathered run by run (only those bytes of the file are touched)."""
    dtype = _TORCH_DTYPES[dtype_name]
    if len(reads) == 1 and len(reads[0][2]) == 1 and reads[0][2][0][2] == size:
        file, begin, [(source, _, _)] = reads[0]
        raw = files[file].bytes_at(begin + source, size)
        if (files[file].start + begin + source) % _itemsize(dtype) == 0:
            return raw.view(dtype).view(shape)
    piece = torch.empty(size, dtype=torch.uint8)
    for file, begin, runs in reads:
        for source, destination, count in runs:
            piece[destination:destination + count].copy_(files[file].bytes_at(begin + source, count))
    return piece.view(dtype).view(shape)


def _itemsize(dtype):
    return torch.empty(0, dtype=dtype).element_size()  # dtype.itemsize: PyTorch 2.1 on


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

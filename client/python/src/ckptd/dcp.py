"""torch.distributed.checkpoint (DCP) over ckptd's files: no daemon needed.

    import torch.distributed.checkpoint as dcp
    from ckptd.dcp import CkptdStorageReader

    state = model.state_dict()
    dcp.load(state, storage_reader=CkptdStorageReader("/ckpt/llm/step-00001200"))
    model.load_state_dict(state)

The step may also be on an object store, `s3://bucket/prefix/llm/step-00001200` (ckptd's
remote tier), read through the same storage library as ckptd and ckptctl: endpoint, region
and keys from the AWS environment (AWS_ENDPOINT_URL_S3, AWS_REGION, AWS_ACCESS_KEY_ID, ...),
each piece fetched with ranged GETs.

The reader offers every tensor of a ckptd checkpoint under the keys DCP-based code uses:
model tensors under their fully qualified names (torchtitan's layout) and under `model.<fqn>`
(what `{"model": ..., "optimizer": ...}` of `get_state_dict` gives), tied parameters under
each of their names, ckptd.torch's optimizer tensors `optim.<fqn>.<key>` as
`optimizer.state.<fqn>.<key>`, and the optimizer's parameter groups and non-tensor state in
both of `get_state_dict`'s forms (`optimizer.param_groups.<g>.<hyper>` with `.params`, and
flattened, `optimizer.param_groups.<fqn>.<hyper>`). Sharded tensors
(DTensor, FSDP2, any placement ckptd recorded) are offered as the global tensor with one
chunk per saved shard, so DCP reshards them onto whatever the loading side uses. Every
piece read is checked against its XXH3-64 checksum before it is copied. The rest of
ckptd.torch's train state (RNG, LR scheduler, extra state) is not offered: load it with
CheckpointManager.

DCP interoperability needs PyTorch 2 (its torch.distributed.checkpoint); ckptd.torch itself
also runs on 1.13.
"""
import io
import json
import math
import os
import pickle
import re

import torch

if int(torch.__version__.split(".")[0]) < 2:
    raise ImportError(f"ckptd.dcp needs PyTorch 2 (torch.distributed.checkpoint as it is there); "
                      f"this is PyTorch {torch.__version__}. ckptd.torch works without it.")

from torch.futures import Future
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                   MetadataIndex, TensorProperties,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import LoadItemType
from torch.distributed.checkpoint.storage import StorageReader

from ckptd._native import open_store, xxh3_64
from ckptd._state_dict import _TORCH_DTYPES
from ckptd._train_state import _from_bytes, _plain_loads

__all__ = ["CkptdStorageReader", "dcp_key"]

# Manifests are read whole, up to what ckptd writes (format::CheckpointStore::kMaxManifestBytes).
_MAX_MANIFEST_BYTES = 64 << 20


class _ObjectFile:
    """An object of a store, read like a file opened "rb"."""

    def __init__(self, reader):
        self._reader, self._at = reader, 0

    def read(self, n):
        data = self._reader.read(self._at, n)
        self._at += len(data)
        return data

    def seek(self, at):
        self._at = at

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _StepFiles:
    """A step's files: a directory, or an s3:// URL (through ckptd's storage library)."""

    def __init__(self, path):
        self.path = path
        self._store = open_store(path) if path.startswith("s3://") else None

    def name(self, file_name):
        return self.path.rstrip("/") + "/" + file_name if self._store else os.path.join(self.path, file_name)

    def read_text(self, file_name):
        """A manifest file's bytes, at most _MAX_MANIFEST_BYTES of them."""
        if self._store is not None:
            return self._store.get(file_name, _MAX_MANIFEST_BYTES)
        with open(self.name(file_name), "rb") as f:
            data = f.read(_MAX_MANIFEST_BYTES + 1)
        if len(data) > _MAX_MANIFEST_BYTES:
            raise ValueError(f"{self.name(file_name)} is larger than a manifest may be ({_MAX_MANIFEST_BYTES} bytes)")
        return data

    def read_manifest(self):
        manifest = json.loads(self.read_text("manifest.json"))
        if isinstance(manifest, dict) and manifest.get("format_version") == _INDEX_FORMAT_VERSION:
            manifest = _join_index(manifest, self.read_text)
        return manifest

    def open(self, file_name):
        if self._store is None:
            return open(self.name(file_name), "rb")
        return _ObjectFile(self._store.open(file_name))


# An index (docs/format.md, "Indexed manifests"): a step too large for one manifest, its
# tensors in one node-scoped manifest (version 3) per node, each named by its checksum.
_INDEX_FORMAT_VERSION = 4
_DIGEST = re.compile(r"xxh3:[0-9a-f]{16}")
# What the part of a node must say as the index does (ckptd's NotAPartOf).
_PART_HEADER = ("job", "step", "world_size", "run", "checksum_chunk_bytes")


def _join_index(index, read_text):
    """The whole step's manifest from an index and its nodes' parts, checked as ckptd checks
    them: the index gives every rank of the world to one node, in order; each part is the one
    the index names (size and XXH3-64 checksum), of the same step and commit, listing exactly
    the ranks the index gives its node."""
    try:
        return _join_checked(index, read_text)
    except (KeyError, TypeError, AttributeError, IndexError) as e:
        raise ValueError(f"an index or part that is not well formed: {e!r}") from e


def _join_checked(index, read_text):
    spec, nodes, world = index.get("index"), index.get("nodes"), index.get("world_size")
    if (not isinstance(spec, dict) or not isinstance(spec.get("parts"), list) or not isinstance(nodes, list)
            or not nodes or len(nodes) != len(spec["parts"]) or not isinstance(world, int)):
        raise ValueError('an index (format version 4) whose "nodes" and "index.parts" do not pair up')
    digest = spec.get("digest")
    if not isinstance(digest, str) or not _DIGEST.fullmatch(digest):
        raise ValueError(f"the index's digest {digest!r} is not xxh3: and 16 hex digits")
    held, last = set(), -1
    for holder, entry in zip(nodes, spec["parts"]):
        node, ranks = holder["node"], holder["ranks"]
        if not isinstance(node, int) or node <= last or not isinstance(ranks, list) or not ranks:
            raise ValueError('the index\'s "nodes" are not in strictly ascending order, each with ranks')
        last = node
        for r in ranks:
            if not isinstance(r, int) or not 0 <= r < world or r in held:
                raise ValueError(f"rank {r!r} is outside the world of {world} or on two nodes of the index")
            held.add(r)
        if entry["node"] != node or entry["file"] != f"manifest-node-{node:05d}.json":
            raise ValueError(f"the index's part for node {node} is not manifest-node-{node:05d}.json")
    if len(held) != world:
        raise ValueError(f"the index's nodes hold {len(held)} of the {world} ranks of the world")
    joined = {k: v for k, v in index.items() if k != "index"}
    joined["shards"], joined["tensors"] = [], {}
    for holder, entry in zip(nodes, spec["parts"]):
        file = entry["file"]
        data = read_text(file)
        if isinstance(data, str):
            data = data.encode()
        if len(data) != entry["bytes"] or f"xxh3:{xxh3_64(data):016x}" != entry["checksum"]:
            raise ValueError(f"{file}: not the part the index names (edited or damaged)")
        part = json.loads(data)
        scope = part["scope"]
        if (part["format_version"] != 3 or scope["node"] != holder["node"] or scope["digest"] != digest
                or any(part.get(k) != index.get(k) for k in _PART_HEADER)
                or [shard["rank"] for shard in part["shards"]] != holder["ranks"]):
            raise ValueError(f"{file}: not node {holder['node']}'s part of this step")
        joined["shards"].extend(part["shards"])
        for name, tensor in part["tensors"].items():
            mine = joined["tensors"].setdefault(
                name, {"dtype": tensor["dtype"], "global_shape": tensor["global_shape"], "shards": []})
            if mine["dtype"] != tensor["dtype"] or mine["global_shape"] != tensor["global_shape"]:
                raise ValueError(f"tensor {name}: the nodes' parts disagree on its dtype or shape")
            mine["shards"].extend(tensor["shards"])
    joined["shards"].sort(key=lambda shard: shard["rank"])
    flat = any("flat" in piece for t in joined["tensors"].values() for piece in t["shards"])
    joined["format_version"] = 2 if flat else 1  # what the joined pieces need, as ckptd writes it
    return joined


def dcp_key(name):
    """The DCP key of a ckptd tensor name (see the module's docstring)."""
    return "optimizer.state." + name[len("optim."):] if name.startswith("optim.") else name


def _dcp_keys(name, aliases_of):
    """Every DCP key a ckptd tensor is offered under: model tensors at the top (torchtitan)
    and under "model." (get_state_dict's {"model": ...}), each under its tied names too."""
    if name.startswith("optim."):
        return [dcp_key(name)]
    names = [name] + aliases_of.get(name, [])
    return names + ["model." + n for n in names]


# A checkpoint's alias table is data from a file: bounded like the one ckptd.torch writes.
_MAX_ALIASES = 1024


class CkptdStorageReader(StorageReader):
    """Reads one committed ckptd step: `path` is its directory (`<root>/<job>/step-NNNNNNNN`)."""

    def __init__(self, path):
        super().__init__()
        self.path = os.fspath(path)
        self._files = None      # opened on first use: a URL is not fetched before DCP asks
        self._pieces = {}       # MetadataIndex -> (file, data_offsets, dtype, shape, checksum)
        self._data_start = {}   # file -> offset of its data region

    def reset(self, checkpoint_id=None):
        if checkpoint_id is not None:
            self.path = os.fspath(checkpoint_id)
        self._files, self._pieces, self._data_start = None, {}, {}

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id):
        path = os.fspath(checkpoint_id)
        return path.startswith("s3://") or os.path.isfile(os.path.join(path, "manifest.json"))

    def _step(self):
        if self._files is None:
            self._files = _StepFiles(self.path)
        return self._files

    def read_metadata(self, *args, **kwargs):
        manifest_path = self._step().name("manifest.json")
        try:
            manifest = self._step().read_manifest()
        except (OSError, ValueError, RuntimeError) as e:
            raise ValueError(f"{manifest_path}: not a ckptd manifest: {e}") from e
        if manifest.get("format") != "ckptd-manifest" or manifest.get("format_version", 0) > 1:
            raise ValueError(f"{manifest_path}: not a ckptd manifest of a version this reader knows")
        state = {}
        self._pieces = {}
        aliases_of = _aliases_of(manifest, manifest_path)
        for name, tensor in sorted(manifest["tensors"].items()):
            dtype = _TORCH_DTYPES.get(tensor["dtype"])
            if dtype is None:
                raise ValueError(f"tensor {name}: dtype {tensor['dtype']} has no torch equivalent")
            keys = _dcp_keys(name, aliases_of)
            size = torch.Size(tensor["global_shape"])
            chunks, seen = [], {}
            for shard in tensor["shards"]:
                if "flat" in shard:
                    raise ValueError(f"tensor {name}: rank {shard['rank']} saved a flat shard (FSDP "
                                     "element ranges), which DCP cannot describe: export the step "
                                     "with `ckptctl export --format safetensors` instead")
                offsets = tuple(shard.get("offset") or [0] * len(size))
                shape = tuple(shard["shape"])
                _check_piece(name, dtype, size, offsets, shape, shard["data_offsets"])
                if not shard.get("checksum"):
                    raise ValueError(f"tensor {name}: a piece without a checksum")
                if (offsets, shape) in seen:  # a replica: one copy serves, if they agree
                    if seen[(offsets, shape)] != shard["checksum"]:
                        raise ValueError(f"tensor {name}: replicas of the piece at {list(offsets)} "
                                         "hold different bytes")
                    continue
                seen[(offsets, shape)] = shard["checksum"]
                chunks.append(ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(shape)))
                _check_file_name(shard["file"])
                for key in keys:
                    self._pieces[MetadataIndex(key, torch.Size(offsets))] = (
                        shard["file"], shard["data_offsets"], dtype, shape, shard.get("checksum"))
            _check_tiling(name, size, list(seen))
            for key in keys:
                state[key] = TensorStorageMetadata(properties=TensorProperties(dtype=dtype), size=size,
                                                   chunks=chunks)
        for key, value in self._optimizer_objects(manifest).items():
            state[key] = BytesStorageMetadata()
            self._pieces[MetadataIndex(key)] = value  # bytes: small, and DCP hands them round
        metadata = Metadata(state_dict_metadata=state)
        metadata.storage_data = dict(self._pieces)
        return metadata

    def set_up_storage_reader(self, metadata, is_coordinator, *args, **kwargs):
        if metadata.storage_data:
            self._pieces = dict(metadata.storage_data)

    def prepare_local_plan(self, plan):
        return plan

    def prepare_global_plan(self, plans):
        return plans

    def read_data(self, plan, planner):
        by_file = {}
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO:
                value = self._pieces.get(MetadataIndex(item.storage_index.fqn))
                if not isinstance(value, bytes):
                    raise ValueError(f"{item.dest_index.fqn}: this ckptd checkpoint offers no such "
                                     "object (its train state: load it with "
                                     "ckptd.torch.CheckpointManager)")
                planner.load_bytes(item, io.BytesIO(value))
                continue
            by_file.setdefault(self._pieces[item.storage_index][0], []).append(item)
        for file_name, items in sorted(by_file.items()):
            with self._step().open(file_name) as f:
                start = self._data_region(f, file_name)
                for item in sorted(items, key=lambda i: self._pieces[i.storage_index][1][0]):
                    stored = self._read_piece(f, start, item.storage_index)
                    for dim, (offset, length) in enumerate(zip(item.storage_offsets, item.lengths)):
                        stored = stored.narrow(dim, offset, length)
                    target = planner.resolve_tensor(item).detach()
                    if target.size() != stored.size():
                        raise ValueError(f"{item.dest_index.fqn}: DCP asked for {tuple(target.size())}, "
                                         f"the checkpoint's piece gives {tuple(stored.size())}")
                    target.copy_(stored)
                    planner.commit_tensor(item, target)
        done = Future()
        done.set_result(None)
        return done

    def _optimizer_objects(self, manifest):
        """The optimizer's parameter groups and non-tensor state, as DCP stores objects
        (torch.save bytes) under get_state_dict's keys in both its forms. From rank 0's train
        state (every rank's groups are the same); empty for a step saved without them."""
        blobs = self._train_state(manifest, ("optim.param_groups", "optim.param_names", "optim.other_state"))
        if "optim.param_groups" not in blobs or "optim.param_names" not in blobs:
            return {}
        try:
            groups = _from_bytes(blobs["optim.param_groups"])
            names = _plain_loads(blobs["optim.param_names"])
            other = _from_bytes(blobs["optim.other_state"]) if "optim.other_state" in blobs else {}
        except (pickle.UnpicklingError, RuntimeError, ValueError, EOFError) as e:
            raise ValueError(f"{self.path}: the optimizer's train state is not usable: {e}") from e
        if not (isinstance(groups, list) and isinstance(names, list) and len(groups) == len(names)
                and all(isinstance(g, dict) and all(isinstance(k, str) for k in g) for g in groups)
                and all(isinstance(n, list) and all(isinstance(f, str) for f in n) for n in names)
                and isinstance(other, dict) and all(isinstance(v, dict) for v in other.values())):
            raise ValueError(f"{self.path}: the optimizer's train state is not what ckptd.torch writes")
        objects = {}
        for g, (group, params) in enumerate(zip(groups, names)):
            objects[f"optimizer.param_groups.{g}.params"] = list(params)
            for hyper, value in group.items():
                objects[f"optimizer.param_groups.{g}.{hyper}"] = value
                for fqn in params:
                    objects[f"optimizer.param_groups.{fqn}.{hyper}"] = value
        for fqn, state in other.items():
            for key, value in state.items():
                objects[f"optimizer.state.{fqn}.{key}"] = value
        encoded = {}
        for key, value in objects.items():
            buffer = io.BytesIO()
            torch.save(value, buffer)
            encoded[key] = buffer.getvalue()
        return encoded

    def _train_state(self, manifest, names):
        """Rank 0's train-state blobs of these names that the step has, each checked."""
        shard = next((s for s in manifest.get("shards", []) if s.get("rank") == 0), None)
        entries = (shard or {}).get("train_state") or {}
        wanted = {n: entries[n] for n in names if n in entries}
        if not wanted:
            return {}
        _check_file_name(shard["file"])
        blobs = {}
        with self._step().open(shard["file"]) as f:
            start = self._data_region(f, shard["file"])
            for name, entry in wanted.items():
                lo, hi = entry["data_offsets"]
                if not (isinstance(lo, int) and isinstance(hi, int) and 0 <= lo <= hi <= lo + (64 << 20)):
                    raise ValueError(f"{shard['file']}: train state {name}: bad data_offsets {[lo, hi]}")
                f.seek(start + lo)
                data = f.read(hi - lo)
                if len(data) != hi - lo or entry.get("checksum") != f"xxh3:{xxh3_64(data):016x}":
                    raise ValueError(f"{shard['file']}: train state {name} is damaged (truncated or "
                                     "a checksum mismatch)")
                blobs[name] = bytes(data)
        return blobs

    def _data_region(self, f, file_name):
        header = f.read(8)
        if len(header) != 8:
            raise ValueError(f"{file_name}: truncated safetensors header")
        return 8 + int.from_bytes(header, "little")

    def _read_piece(self, f, start, index):
        file_name, (lo, hi), dtype, shape, checksum = self._pieces[index]
        f.seek(start + lo)
        data = bytearray(f.read(hi - lo))
        if len(data) != hi - lo:
            raise ValueError(f"{index.fqn} in {file_name}: the file ends {hi - lo - len(data)} bytes "
                             "early (truncated)")
        if checksum is not None and checksum != f"xxh3:{xxh3_64(data):016x}":
            raise ValueError(f"{index.fqn} in {file_name}: checksum mismatch (damaged file); "
                             "nothing of it was copied")
        return torch.frombuffer(data, dtype=torch.uint8).view(dtype).view(shape)


def _aliases_of(manifest, where):
    """{stored name: [its other names]} from the step's `ckptd.aliases` (tied parameters)."""
    text = (manifest.get("metadata") or {}).get("ckptd.aliases")
    if not text:
        return {}
    try:
        aliases = json.loads(text)
    except ValueError as e:
        raise ValueError(f"{where}: ckptd.aliases is not JSON: {e}") from e
    # An alias names a model tensor by a name no tensor has, so it can never stand in for
    # another key (an optimizer's, or a "model." one).
    if not isinstance(aliases, dict) or len(aliases) > _MAX_ALIASES or not all(
            isinstance(k, str) and isinstance(v, str) and v in manifest["tensors"]
            and not v.startswith("optim.") and not k.startswith(("optim.", "optimizer.", "model."))
            and k not in manifest["tensors"] and "model." + k not in manifest["tensors"]
            for k, v in aliases.items()):
        raise ValueError(f"{where}: ckptd.aliases must map at most {_MAX_ALIASES} new names onto "
                         "the step's tensors")
    aliases_of = {}
    for alias, name in sorted(aliases.items()):
        aliases_of.setdefault(name, []).append(alias)
    return aliases_of


def _check_piece(name, dtype, size, offsets, shape, data_offsets):
    """A manifest is data from a file: every piece must lie inside its tensor and hold
    exactly its elements' bytes before anything is read for it."""
    if len(offsets) != len(size) or len(shape) != len(size):
        raise ValueError(f"tensor {name}: a piece of rank {len(shape)} in a tensor of rank {len(size)}")
    for dim, (offset, length, whole) in enumerate(zip(offsets, shape, size)):
        if not (isinstance(offset, int) and isinstance(length, int)) or offset < 0 or length < 0 \
                or offset + length > whole:
            raise ValueError(f"tensor {name}: piece [{offset}, +{length}) outside dimension {dim} "
                             f"of size {whole}")
    lo, hi = data_offsets
    elements = math.prod(shape)
    if not (isinstance(lo, int) and isinstance(hi, int)) or lo < 0 or hi - lo != elements * dtype.itemsize:
        raise ValueError(f"tensor {name}: data_offsets {data_offsets} do not hold "
                         f"{elements} elements of {dtype}")


def _check_tiling(name, size, pieces):
    """The pieces cover the global tensor exactly once: DCP itself would load a partial
    cover without a word, leaving the rest of the target as it was."""
    if sum(math.prod(shape) for _, shape in pieces) != math.prod(size):
        raise ValueError(f"tensor {name}: its pieces do not cover its global shape {list(size)} "
                         "exactly")
    for i, (a_off, a_shape) in enumerate(pieces):
        for b_off, b_shape in pieces[i + 1:]:
            if all(ao < bo + bs and bo < ao + as_
                   for ao, as_, bo, bs in zip(a_off, a_shape, b_off, b_shape)):
                raise ValueError(f"tensor {name}: pieces at {list(a_off)} and {list(b_off)} overlap")


def _check_file_name(name):
    """Only the shard files ckptd writes are opened (never a path from the manifest)."""
    if not (name.startswith("rank-") and name.endswith(".safetensors") and
            name[5:-12].isdigit() and len(name) == 5 + 5 + 12):
        raise ValueError(f"shard file {name!r} is not rank-NNNNN.safetensors")

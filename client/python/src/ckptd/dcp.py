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
piece read is checked against its XXH3-64 checksum before it is copied. An incremental step
(format version 5) is read through its references: a piece whose unchanged chunks are in an
earlier step's file is assembled from there (`step-M/`, or `step-M.held-<run>/` beside the
step) and checked chunk by chunk, so DCP sees it whole. The rest of
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

from ckptd import _increment
from ckptd._references import PieceReader
from ckptd._state_dict import _TORCH_DTYPES
from ckptd._step_files import _StepFiles, _check_file_name
from ckptd._train_state import _from_bytes, _plain_loads

__all__ = ["CkptdStorageReader", "dcp_key"]

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
        # MetadataIndex -> (tensor name, piece, dtype name, dtype, shape, its rank's files),
        # or the bytes of an object: what any rank needs to read it (DCP hands it round).
        self._pieces = {}

    def reset(self, checkpoint_id=None):
        if checkpoint_id is not None:
            self.path = os.fspath(checkpoint_id)
        self._files, self._pieces = None, {}

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
        version = manifest.get("format_version", 0) if isinstance(manifest, dict) else 0
        if not isinstance(manifest, dict) or manifest.get("format") != "ckptd-manifest" \
                or not isinstance(version, int) or version > _increment.NEWEST_VERSION:
            raise ValueError(f"{manifest_path}: not a ckptd manifest of a version this reader knows "
                             f"(format_version {version!r}; it reads 1 to {_increment.NEWEST_VERSION})")
        try:
            rank_files = _increment.check(manifest)
        except (KeyError, TypeError, IndexError) as e:
            raise ValueError(f"{manifest_path}: a manifest that is not well formed: {e!r}") from e
        except ValueError as e:
            raise ValueError(f"{manifest_path}: {e}") from e
        reader = PieceReader(self._step())
        try:
            reader.check_origins(rank_files)  # before DCP copies a byte of any piece
        finally:
            reader.close()
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
                whole = "extents" not in shard  # else its chunks' runs, checked by _increment
                _check_piece(name, dtype, size, offsets, shape, shard["data_offsets"] if whole else None)
                if not shard.get("checksum"):
                    raise ValueError(f"tensor {name}: a piece without a checksum")
                if (offsets, shape) in seen:  # a replica: one copy serves, if they agree
                    if seen[(offsets, shape)] != shard["checksum"]:
                        raise ValueError(f"tensor {name}: replicas of the piece at {list(offsets)} "
                                         "hold different bytes")
                    continue
                seen[(offsets, shape)] = shard["checksum"]
                chunks.append(ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(shape)))
                if whole:
                    _check_file_name(shard["file"], version, shard["rank"])
                for key in keys:
                    self._pieces[MetadataIndex(key, torch.Size(offsets))] = (
                        name, shard, tensor["dtype"], dtype, shape, rank_files[shard["rank"]])
            _check_tiling(name, size, list(seen))
            for key in keys:
                state[key] = TensorStorageMetadata(properties=TensorProperties(dtype=dtype), size=size,
                                                   chunks=chunks)
        for key, value in self._optimizer_objects(manifest, rank_files).items():
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
        tensors = []
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO:
                value = self._pieces.get(MetadataIndex(item.storage_index.fqn))
                if not isinstance(value, bytes):
                    raise ValueError(f"{item.dest_index.fqn}: this ckptd checkpoint offers no such "
                                     "object (its train state: load it with "
                                     "ckptd.torch.CheckpointManager)")
                planner.load_bytes(item, io.BytesIO(value))
                continue
            tensors.append(item)
        reader = PieceReader(self._step())
        try:
            # In file order: whole pieces by where they are, then those assembled from extents.
            for item in sorted(tensors, key=lambda i: _file_order(self._pieces[i.storage_index][1])):
                stored = self._read_piece(reader, item.storage_index)
                for dim, (offset, length) in enumerate(zip(item.storage_offsets, item.lengths)):
                    stored = stored.narrow(dim, offset, length)
                target = planner.resolve_tensor(item).detach()
                if target.size() != stored.size():
                    raise ValueError(f"{item.dest_index.fqn}: DCP asked for {tuple(target.size())}, "
                                     f"the checkpoint's piece gives {tuple(stored.size())}")
                target.copy_(stored)
                planner.commit_tensor(item, target)
        finally:
            reader.close()
        done = Future()
        done.set_result(None)
        return done

    def _optimizer_objects(self, manifest, rank_files):
        """The optimizer's parameter groups and non-tensor state, as DCP stores objects
        (torch.save bytes) under get_state_dict's keys in both its forms. From rank 0's train
        state (every rank's groups are the same); empty for a step saved without them."""
        blobs = self._train_state(manifest, rank_files,
                                  ("optim.param_groups", "optim.param_names", "optim.other_state"))
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

    def _train_state(self, manifest, rank_files, names):
        """Rank 0's train-state blobs of these names that the step has, each checked (in an
        earlier step's file where this one references it)."""
        shard = next((s for s in manifest.get("shards", []) if s.get("rank") == 0), None)
        entries = (shard or {}).get("train_state") or {}
        wanted = {n: entries[n] for n in names if n in entries}
        if not wanted:
            return {}
        reader = PieceReader(self._step())
        try:
            return reader.train_state(dict(shard, train_state=wanted), rank_files[0])
        finally:
            reader.close()

    def _read_piece(self, reader, index):
        name, piece, dtype_name, dtype, shape, rank_files = self._pieces[index]
        data = reader.piece(name, dtype_name, piece, rank_files)
        return torch.frombuffer(data, dtype=torch.uint8).view(dtype).view(shape)


def _file_order(piece):
    if "extents" in piece:
        return (1, piece["rank"], 0)
    return (0, piece["file"], piece["data_offsets"][0])


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
    if data_offsets is None:
        return  # a version 5 piece of extents: _increment checked its chunks against its bytes
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

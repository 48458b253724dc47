"""A committed step's files, read without the daemon: its manifest (an index joined with its
nodes' parts, checked as ckptd checks them) and its shard files, from a directory or an s3://
URL through ckptd's own storage library. What ckptd.dcp's reader and load(from_path=) read
through; needs nothing of torch.distributed.
"""
import json
import os
import re

from ckptd._native import open_store, xxh3_64

# Manifests are read whole, up to what ckptd writes (format::CheckpointStore::kMaxManifestBytes).
_MAX_MANIFEST_BYTES = 64 << 20


# One train-state entry at most (what ckptd itself accepts: each under 4 GiB).
MAX_TRAIN_STATE_BLOB_BYTES = 4 << 30


def read_train_state(f, start, entries, label):
    """The train-state entries {name: entry} of a shard file open as `f`, whose data begins
    at `start`, each read and checked against its checksum; ValueError naming `label` (the
    file) and the entry otherwise."""
    blobs = {}
    for name, entry in entries.items():
        lo, hi = entry["data_offsets"]
        if not (isinstance(lo, int) and isinstance(hi, int) and 0 <= lo <= hi <= lo + MAX_TRAIN_STATE_BLOB_BYTES):
            raise ValueError(f"{label}: train state {name}: bad data_offsets {[lo, hi]}")
        f.seek(start + lo)
        data = f.read(hi - lo)
        if len(data) != hi - lo or entry.get("checksum") != f"xxh3:{xxh3_64(data):016x}":
            raise ValueError(f"{label}: train state {name} is damaged (truncated, or a checksum mismatch)")
        blobs[name] = bytes(data)
    return blobs


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

    def size(self):
        return self._reader.size

    def close(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _StepFiles:
    """A step's files: a directory, or an s3:// URL (through ckptd's storage library)."""

    def __init__(self, path):
        self.path = path
        self._store = open_store(path) if path.startswith("s3://") else None
        self._parent_store = None  # the job's prefix, opened for a version 5 step's origins

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
        if isinstance(manifest, dict) and (manifest.get("format_version") == _INDEX_FORMAT_VERSION or (
                manifest.get("format_version") == _INCREMENT_FORMAT_VERSION and "index" in manifest)):
            manifest = _join_index(manifest, self.read_text)
        return manifest

    def open(self, file_name):
        if self._store is None:
            return open(self.name(file_name), "rb")
        return _ObjectFile(self._store.open(file_name))

    def open_origin(self, origin):
        """An origin's file (a version 5 step's `increment.origins` entry: an earlier step's
        file of one rank), beside this step: `step-M/<file>`, else `step-M.held-<run hex>/<file>`
        (that step retired but held, on a local disk); its size checked against the origin's.
        Returns (file open "rb", its path); ValueError naming both paths when it is in neither."""
        step_dir = f"step-{origin['step']:08d}"
        tried = []
        for folder in (step_dir, f"{step_dir}.held-{origin['run']:016x}"):
            key = folder + "/" + origin["file"]
            if self._store is None:
                where = os.path.join(os.path.dirname(os.path.abspath(self.path)), folder, origin["file"])
                try:
                    f = open(where, "rb")
                except (FileNotFoundError, NotADirectoryError):
                    f = None
            else:
                parent = self.path.rstrip("/").rsplit("/", 1)[0]
                if self._parent_store is None:
                    self._parent_store = open_store(parent)
                where = parent + "/" + key
                f = _ObjectFile(self._parent_store.open(key)) if self._parent_store.exists(key) else None
            if f is None:
                tried.append(where)
                continue
            size = f.size() if self._store is not None else os.fstat(f.fileno()).st_size
            if size != origin["bytes"]:
                f.close()
                raise ValueError(f"{where}: step {origin['step']}'s file of rank {origin['rank']}, which this step "
                                 f"references, is {size} bytes, not the {origin['bytes']} it was (damaged, or "
                                 "replaced by another file)")
            return f, where
        raise ValueError(f"step {origin['step']}'s file of rank {origin['rank']}, which this step references, is "
                         f"missing: neither {tried[0]} nor {tried[1]} exists")


# An index (docs/format.md, "Indexed manifests"): a step too large for one manifest, its
# tensors in one node-scoped manifest (version 3) per node, each named by its checksum. An
# incremental step's index is version 5, its parts too (docs/design/incremental.md).
_INDEX_FORMAT_VERSION = 4
_INCREMENT_FORMAT_VERSION = 5
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
    version = index.get("format_version")
    part_version = 3 if version == _INDEX_FORMAT_VERSION else _INCREMENT_FORMAT_VERSION
    if (not isinstance(spec, dict) or not isinstance(spec.get("parts"), list) or not isinstance(nodes, list)
            or not nodes or len(nodes) != len(spec["parts"]) or not isinstance(world, int)):
        raise ValueError(f'an index (format version {version}) whose "nodes" and "index.parts" do not pair up')
    if "scope" in index:
        raise ValueError("an index with a scope (an index is the whole step's)")
    if version == _INCREMENT_FORMAT_VERSION and not isinstance(index.get("increment"), dict):
        raise ValueError('an index of format version 5 without its "increment"')
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
    origins = []
    for holder, entry in zip(nodes, spec["parts"]):
        file = entry["file"]
        data = read_text(file)
        if isinstance(data, str):
            data = data.encode()
        if len(data) != entry["bytes"] or f"xxh3:{xxh3_64(data):016x}" != entry["checksum"]:
            raise ValueError(f"{file}: not the part the index names (edited or damaged)")
        part = json.loads(data)
        scope = part["scope"]
        if (part["format_version"] != part_version or "index" in part or scope["node"] != holder["node"]
                or scope["digest"] != digest or any(part.get(k) != index.get(k) for k in _PART_HEADER)
                or [shard["rank"] for shard in part["shards"]] != holder["ranks"]):
            raise ValueError(f"{file}: not node {holder['node']}'s part of this step")
        joined["shards"].extend(part["shards"])
        if part_version == _INCREMENT_FORMAT_VERSION:
            # Ranks are disjoint across parts: so are their origins (one per step and rank).
            mine = part["increment"].get("origins", [])  # left out where a part references nothing
            if not isinstance(mine, list) or any(o.get("rank") not in holder["ranks"] for o in mine):
                raise ValueError(f"{file}: origins of ranks that node {holder['node']}'s part does not hold")
            origins.extend(mine)
        for name, tensor in part["tensors"].items():
            mine = joined["tensors"].setdefault(
                name, {"dtype": tensor["dtype"], "global_shape": tensor["global_shape"], "shards": []})
            if mine["dtype"] != tensor["dtype"] or mine["global_shape"] != tensor["global_shape"]:
                raise ValueError(f"tensor {name}: the nodes' parts disagree on its dtype or shape")
            mine["shards"].extend(tensor["shards"])
    joined["shards"].sort(key=lambda shard: shard["rank"])
    if version == _INCREMENT_FORMAT_VERSION:
        # The index's own_bytes, referenced_bytes and origin_steps; its parts' origins.
        joined["increment"] = dict(index["increment"], origins=origins)
        return joined
    flat = any("flat" in piece for t in joined["tensors"].values() for piece in t["shards"])
    joined["format_version"] = 2 if flat else 1  # what the joined pieces need, as ckptd writes it
    return joined


# The shard file names ckptd writes: rank-NNNNN.safetensors in format versions 1 to 4, and
# rank-NNNNN.<tag>.safetensors in 5 (the tag: 16 hex digits of the writing session).
_SHARD_FILE = re.compile(r"rank-([0-9]{5})\.safetensors")
_TAGGED_SHARD_FILE = re.compile(r"rank-([0-9]{5})\.[0-9a-f]{16}\.safetensors")


def _check_file_name(name, version=1, rank=None):
    """Only the shard files ckptd writes are opened (never a path from the manifest): of the
    form of the manifest's format `version`, and rank `rank`'s when it is given."""
    tagged = version >= _INCREMENT_FORMAT_VERSION
    match = isinstance(name, str) and (_TAGGED_SHARD_FILE if tagged else _SHARD_FILE).fullmatch(name)
    form = "rank-NNNNN.<16 hex digits>.safetensors" if tagged else "rank-NNNNN.safetensors"
    if not match:
        raise ValueError(f"shard file {name!r} is not {form}")
    if rank is not None and int(match.group(1)) != rank:
        raise ValueError(f"shard file {name!r} is not rank {rank}'s ({form} with NNNNN the rank)")

"""What a reader checks of a step's manifest before it reads a byte, and what format version 5
(an incremental step, docs/design/incremental.md sections 2 and 8) adds: the `increment`
table of origins (the earlier steps' files this step references), tagged shard file names,
and per piece its chunking and either a whole entry in this step's file or `extents`, runs of
chunks in this step's file (`__delta__` entries) or in an origin's. Pure: nothing is opened.
"""
import re

from ckptd._step_files import _DIGEST, _check_file_name

NEWEST_VERSION = 5   # the newest format version these readers understand
INCREMENT_VERSION = 5
MAX_CHUNKS = 1 << 20  # a piece's chunk count at most (format/increment.h, kMaxReadPieceChunks)
ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
            "BOOL": 1}


def _int(v, low=0):
    return isinstance(v, int) and not isinstance(v, bool) and v >= low


def check(manifest):
    """The step's files per rank, {rank: {"own": file name, "origins": {step: origin}}}, once
    the manifest is one of a whole step that these readers read; ValueError naming what is
    not (a version newer than 5, a node-scoped manifest, a malformed version 5 table or piece)."""
    version = manifest.get("format_version")
    if not _int(version, 1):
        raise ValueError(f"format_version {version!r} is not a version number")
    if version > NEWEST_VERSION:
        raise ValueError(f"format version {version} is newer than this reader understands ({NEWEST_VERSION})")
    if "scope" in manifest or version == 3:
        raise ValueError(f"a node-scoped manifest (format version {version}: one node's ranks of step "
                         f"{manifest.get('step')}): read the step where its whole manifest is (node 0's disk, "
                         "the remote tier, or a shared root)")
    if "index" in manifest or version == 4:
        raise ValueError("an index whose parts were not joined")  # _StepFiles.read_manifest joins them
    files = {}
    for shard in manifest["shards"]:
        rank = shard["rank"]
        if not _int(rank) or rank in files:
            raise ValueError(f"shard rank {rank!r} is not a rank, or listed twice")
        _check_file_name(shard["file"], version, rank)
        files[rank] = {"own": shard["file"], "origins": {}}
    if version < INCREMENT_VERSION:
        if any("extents" in p for t in manifest["tensors"].values() for p in t["shards"]) or any(
                "step" in e for s in manifest["shards"] for e in (s.get("train_state") or {}).values()):
            raise ValueError(f"references (extents, or train state in another step) in format version {version}: "
                             f"only version {INCREMENT_VERSION} has them")
        return files
    for (step, rank), origin in _origins(manifest).items():
        if rank not in files:
            raise ValueError(f"an origin of rank {rank}, which the shards do not list")
        files[rank]["origins"][step] = origin
    for shard in manifest["shards"]:
        for name, entry in (shard.get("train_state") or {}).items():
            if "step" in entry and entry["step"] not in files[shard["rank"]]["origins"]:
                raise ValueError(f"train state {name} of rank {shard['rank']}: in step {entry['step']!r}, of "
                                 "which increment.origins lists no file of that rank")
    for name, tensor in manifest["tensors"].items():
        itemsize = ITEMSIZE.get(tensor.get("dtype"))
        if itemsize is None:
            raise ValueError(f"tensor {name}: dtype {tensor.get('dtype')!r} is not one ckptd stores")
        for piece in tensor["shards"]:
            rank = piece.get("rank")
            if rank not in files:
                raise ValueError(f"tensor {name}: a piece of rank {rank!r}, which the shards do not list")
            try:
                _check_piece(piece, itemsize, files[rank])
            except (TypeError, KeyError, IndexError) as e:
                raise ValueError(f"tensor {name}: rank {rank}'s piece is not well formed ({e!r})") from None
            except ValueError as e:
                raise ValueError(f"tensor {name}: rank {rank}'s piece: {e}") from None
    return files


def _origins(manifest):
    """{(step, rank): origin} of a version 5 manifest's `increment`, checked."""
    increment = manifest.get("increment")
    if not isinstance(increment, dict):
        raise ValueError('no "increment" table (every format version 5 manifest has one)')
    if not (_int(increment.get("own_bytes")) and _int(increment.get("referenced_bytes"))):
        raise ValueError("increment: own_bytes and referenced_bytes must be byte counts")
    # ckptd leaves `origins` out of a step that references nothing (a first or whole save).
    steps, origins = increment.get("origin_steps"), increment.get("origins", [])
    if not isinstance(steps, list) or not isinstance(origins, list):
        raise ValueError("increment: origin_steps and origins must be lists")
    listed = set()
    for s in steps:
        if not (isinstance(s, dict) and _int(s.get("step")) and _int(s.get("run"))) or (s["step"], s["run"]) in listed:
            raise ValueError(f"increment: origin step {s!r} is not a (step, run) listed once")
        listed.add((s["step"], s["run"]))
    table, used = {}, set()
    for o in origins:
        if not (isinstance(o, dict) and all(_int(o.get(k)) for k in ("step", "run", "rank", "bytes"))):
            raise ValueError(f"increment: origin {o!r} lacks a step, run, rank or bytes")
        _check_file_name(o.get("file"), INCREMENT_VERSION, o["rank"])
        if o["step"] == manifest.get("step"):
            raise ValueError(f"increment: an origin of rank {o['rank']} in step {o['step']}, this step itself")
        if (o["step"], o["rank"]) in table:
            raise ValueError(f"increment: two origins of step {o['step']} for rank {o['rank']}")
        table[(o["step"], o["rank"])] = o
        used.add((o["step"], o["run"]))
    if used != listed:
        raise ValueError(f"increment: origin_steps {sorted(listed)} are not the (step, run) of its origins "
                         f"{sorted(used)}")
    return table


def piece_bytes(piece, itemsize):
    """How many bytes a piece holds: a box's elements, or an FSDP flat piece's ranges."""
    if "flat" in piece:
        return sum(int(e) - int(b) for b, e in piece["flat"]) * itemsize
    n = 1
    for d in piece["shape"]:
        n *= int(d)
    return n * itemsize


def chunk_count(nbytes, chunk_bytes):
    """A piece's chunks as ckptd counts them (format/increment.cc, PieceChunks): one for a
    piece of at most one chunk, an empty one (an empty GPU shard) included."""
    return 1 if nbytes <= chunk_bytes else -(-nbytes // chunk_bytes)


def _check_piece(piece, itemsize, files):
    nbytes, cb = piece_bytes(piece, itemsize), piece.get("chunk_bytes")
    if not _int(cb, 1) or cb % itemsize:
        raise ValueError(f"chunk_bytes {cb!r} is not a positive multiple of its dtype's {itemsize} bytes")
    chunks = chunk_count(nbytes, cb)
    if chunks > MAX_CHUNKS:
        raise ValueError(f"{chunks} chunks of {cb} bytes, more than {MAX_CHUNKS}")
    sums = piece.get("chunk_checksums")
    if not isinstance(piece.get("checksum"), str) or not _DIGEST.fullmatch(piece["checksum"]):
        raise ValueError(f"checksum {piece.get('checksum')!r} is not xxh3: and 16 hex digits")
    if (sums is not None or chunks >= 2) and not (
            isinstance(sums, list) and len(sums) == chunks
            and all(isinstance(s, str) and _DIGEST.fullmatch(s) for s in sums)):
        raise ValueError(f"chunk_checksums must be {chunks} xxh3 digests, one per chunk of {cb} bytes")
    if "extents" not in piece:
        if piece.get("file") != files["own"]:
            raise ValueError(f"whole in file {piece.get('file')!r}, not its rank's file {files['own']}")
        lo, hi = piece["data_offsets"]
        if not (_int(lo) and _int(hi)) or hi - lo != nbytes:
            raise ValueError(f"data_offsets {piece['data_offsets']} do not hold its {nbytes} bytes")
        return
    if "file" in piece or "data_offsets" in piece:
        raise ValueError("both extents and a whole entry (file, data_offsets)")
    extents, at = piece["extents"], 0
    if not isinstance(extents, list):
        raise ValueError("extents must be a list")
    for e in extents:
        c0, c1 = e["chunks"]
        if not (_int(c0) and _int(c1)) or c0 != at or c1 <= c0 or not _int(e.get("at")):
            raise ValueError(f"extent {e!r} does not begin at chunk {at} with a byte offset \"at\" "
                             f"(extents are ascending and contiguous runs of its {chunks} chunks)")
        if "step" in e and e["step"] not in files["origins"]:
            raise ValueError(f"extent {e!r} is in step {e['step']!r}, of which increment.origins lists no "
                             "file of this rank")
        at = c1
    if at != chunks:
        raise ValueError(f"its extents cover chunks [0, {at}) of its {chunks} (every chunk exactly once)")


def delta_entry(tensor):
    """The names of a safetensors entry that may hold a run of `tensor`'s chunks."""
    return re.compile(r"__delta__\.[0-9]+-[0-9]+\." + re.escape(tensor))

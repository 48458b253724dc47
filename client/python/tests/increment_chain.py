"""Writes incremental steps (format version 5, docs/design/incremental.md sections 1 and 2)
by hand, as ckptd's writer will: nothing writes them yet, and the readers must read exactly
this layout. A step's files are tagged `rank-NNNNN.<16 hex>.safetensors`; against a base
step, each piece's chunks that equal the base's are referenced where the base has them (its
own file, or the step it references: one hop), changed runs are `__delta__.<c0>-<c1>.<name>`
entries of this step's file, and a piece whose every chunk changed is written whole.
"""
import json
import os

import torch

from ckptd._native import xxh3_64

DTYPES = {torch.float32: "F32", torch.float64: "F64", torch.float16: "F16", torch.bfloat16: "BF16",
          torch.int64: "I64", torch.int32: "I32", torch.uint8: "U8"}


def digest(data):
    return f"xxh3:{xxh3_64(bytes(data)):016x}"


def step_dir(job_dir, step):
    return os.path.join(job_dir, f"step-{step:08d}")


def tensor_bytes(t):
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def write_safetensors(path, entries, metadata=None):
    """A safetensors file of `entries` [(name, dtype name, shape, bytes)], in that order, its
    data region 4096-aligned as ckptd writes it. Returns ({name: [lo, hi]}, the file's size)."""
    header, offsets, at = {"__metadata__": metadata or {"framework": "torch"}}, {}, 0
    for name, dtype, shape, data in entries:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [at, at + len(data)]}
        offsets[name] = [at, at + len(data)]
        at += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 4096)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text)
        for _, _, _, data in entries:
            f.write(data)
    return offsets, 8 + len(text) + at


def read_header(path):
    """A safetensors file's header: {name: {"dtype", "shape", "data_offsets"}}."""
    with open(path, "rb") as f:
        return json.loads(f.read(int.from_bytes(f.read(8), "little")))


def chunk_bytes_of(shape, itemsize):
    """Row blocks of one row for a matrix; windows of 4 elements otherwise (tiny, so that the
    test's small tensors have several chunks)."""
    return (int(torch.Size(shape[1:]).numel()) if len(shape) >= 2 else 4) * itemsize


def write_step(job_dir, step, run, tag, world_size, tensors, layout, train_state, base=None,
               referenced_state=(), metadata=None, whole=()):
    """Writes step `step` of run `run` (a version 5 manifest and one tagged file per rank,
    `tag(rank)` its tag) into `job_dir`: `tensors` {name: global tensor}, `layout` {name:
    [(rank, offset, shape)]} its box pieces, `train_state` {rank: {name: bytes}}. With `base`
    (what this function returned for an earlier step), pieces reference the base's equal
    chunks, except those named in `whole` (written whole); so do the train-state blobs named
    in `referenced_state` that equal the base's. Returns the step's record, for the next."""
    folder = step_dir(job_dir, step)
    os.makedirs(folder)
    files = {rank: f"rank-{rank:05d}.{tag(rank):016x}.safetensors" for rank in range(world_size)}
    own = {rank: [] for rank in range(world_size)}          # entries of each rank's file
    pending = {rank: [] for rank in range(world_size)}      # (piece, extent, entry) to place
    record = {"step": step, "run": run, "files": files, "sizes": {}, "pieces": {}, "train_state": {}}
    manifest_tensors, used = {}, {rank: set() for rank in range(world_size)}
    for name, pieces in layout.items():
        t = tensors[name].contiguous()
        dtype, itemsize = DTYPES[t.dtype], t.element_size()
        out = []
        for rank, offset, shape in pieces:
            region = t
            for dim, (o, n) in enumerate(zip(offset, shape)):
                region = region.narrow(dim, o, n)
            data = tensor_bytes(region)
            cb = chunk_bytes_of(shape, itemsize)
            count = 1 if len(data) <= cb else -(-len(data) // cb)  # an empty piece is one chunk, as in ckptd
            sums = [digest(data[c * cb:(c + 1) * cb]) for c in range(count)]
            piece = {"rank": rank, "offset": list(offset), "shape": list(shape), "chunk_bytes": cb,
                     "checksum": digest(data)}
            if count >= 2:
                piece["chunk_checksums"] = sums
            old = (base or {}).get("pieces", {}).get((name, tuple(offset)))
            same = [old is not None and old["rank"] == rank and old["cb"] == cb and old["sums"][c] == sums[c]
                    for c in range(count)]
            if name in whole or not any(same):
                piece["file"] = files[rank]
                own[rank].append((name, dtype, shape, data))
                pending[rank].append((piece, None, name, cb))
            else:
                extents, c = [], 0
                while c < count:
                    c1 = c + 1
                    if same[c]:
                        src_step, at = old["where"][c]
                        while c1 < count and same[c1] and old["where"][c1] == (src_step, at + (c1 - c) * cb):
                            c1 += 1
                        extent = {"chunks": [c, c1], "step": src_step, "at": at}
                        used[rank].add(src_step)
                    else:
                        while c1 < count and not same[c1]:
                            c1 += 1
                        extent = {"chunks": [c, c1]}
                        entry = f"__delta__.{c}-{c1}.{name}"
                        rows = [(c1 - c) * cb // itemsize]
                        own[rank].append((entry, dtype, rows, data[c * cb:min(c1 * cb, len(data))]))
                        pending[rank].append((piece, extent, entry, cb))
                    extents.append(extent)
                    c = c1
                piece["extents"] = extents
            record["pieces"][(name, tuple(offset))] = {"rank": rank, "cb": cb, "sums": sums, "piece": piece,
                                                        "bytes": len(data)}
            out.append(piece)
        manifest_tensors[name] = {"dtype": dtype, "global_shape": list(t.shape), "shards": out}
    shards = []
    for rank in range(world_size):
        state, referenced = {}, {}
        for name, blob in sorted(train_state.get(rank, {}).items()):
            old = (base or {}).get("train_state", {}).get((rank, name))
            if name in referenced_state and old is not None and old["checksum"] == digest(blob):
                referenced[name] = dict(old)
                used[rank].add(old["step"])
            else:
                own[rank].append((f"__train_state__.{name}", "U8", [len(blob)], blob))
                state[name] = {"checksum": digest(blob)}
        offsets, size = write_safetensors(os.path.join(folder, files[rank]), own[rank], metadata)
        record["sizes"][rank] = size
        for name, entry in state.items():
            entry["data_offsets"] = offsets[f"__train_state__.{name}"]
            record["train_state"][(rank, name)] = dict(entry, step=step)
        for name, entry in referenced.items():
            record["train_state"][(rank, name)] = entry
            state[name] = entry
        for piece, extent, entry, cb in pending[rank]:
            if extent is None:
                piece["data_offsets"] = offsets[entry]
            else:
                extent["at"] = offsets[entry][0]
        shards.append({"rank": rank, "file": files[rank], "bytes": size, "metadata": {}, "train_state": state})
    referenced = 0
    for info in record["pieces"].values():  # where each chunk's bytes are: (step, at), for the next step
        piece, cb = info["piece"], info["cb"]
        extents = piece.get("extents") or [{"chunks": [0, len(info["sums"])], "at": piece["data_offsets"][0]}]
        info["where"] = [(e.get("step", step), e["at"] + (c - e["chunks"][0]) * cb)
                         for e in extents for c in range(*e["chunks"])]
        referenced += sum(min(e["chunks"][1] * cb, info["bytes"]) - e["chunks"][0] * cb
                          for e in extents if "step" in e)
    origins = []
    for rank in range(world_size):
        for s in sorted(used[rank]):
            assert s == base["step"], "this helper references one base step (itself one hop from its own)"
            origins.append({"step": s, "run": base["run"], "rank": rank, "file": base["files"][rank],
                            "bytes": base["sizes"][rank]})
    own_bytes = sum(record["sizes"].values())
    manifest = {
        "format": "ckptd-manifest", "format_version": 5, "job": os.path.basename(job_dir), "step": step,
        "run": run, "world_size": world_size, "unix_time": 1.0 * step, "wall_time": "2026-01-01T00:00:00Z",
        "ckptd_version": "0.1.0", "checksum_chunk_bytes": 8 << 20, "metadata": metadata or {},
        "increment": {"own_bytes": own_bytes, "referenced_bytes": referenced,
                      "origin_steps": sorted({(o["step"], o["run"]) for o in origins}), "origins": origins},
        "shards": shards, "tensors": manifest_tensors}
    manifest["increment"]["origin_steps"] = [{"step": s, "run": r} for s, r in manifest["increment"]["origin_steps"]]
    if not origins:
        del manifest["increment"]["origins"]  # as ckptd writes a step that references nothing
    write_manifest(folder, manifest)
    record["manifest"] = manifest
    return record


def write_manifest(folder, manifest, name="manifest.json"):
    text = json.dumps(manifest, indent=1, sort_keys=True).encode()
    with open(os.path.join(folder, name), "wb") as f:
        f.write(text)
    return text


def publish_as_index(folder, manifest, node_ranks):
    """Rewrites a version 5 step's manifest as an index (version 5, its `increment` without
    origins) and one node-scoped part (version 5) per node of `node_ranks` [[rank, ...]]."""
    digest_ = "xxh3:00000000000000bb"
    header = {k: v for k, v in manifest.items() if k not in ("shards", "tensors", "increment")}
    step_tensors = len(manifest["tensors"])
    step_bytes = sum(s["bytes"] for s in manifest["shards"])
    index = dict(header, shards=[], tensors={}, nodes=[],
                 increment={k: v for k, v in manifest["increment"].items() if k != "origins"},
                 index={"digest": digest_, "parts": [], "step_tensors": step_tensors, "step_bytes": step_bytes})
    for node, ranks in enumerate(node_ranks):
        origins = [o for o in manifest["increment"].get("origins", []) if o["rank"] in ranks]
        steps = sorted({(o["step"], o["run"]) for o in origins})
        tensors = {}
        for name, t in manifest["tensors"].items():
            mine = [p for p in t["shards"] if p["rank"] in ranks]
            if mine:
                tensors[name] = dict(t, shards=mine)
        part = dict(header, shards=[s for s in manifest["shards"] if s["rank"] in ranks], tensors=tensors,
                    nodes=[{"node": node, "ranks": ranks}],
                    increment=dict(manifest["increment"], origins=origins,
                                   origin_steps=[{"step": s, "run": r} for s, r in steps]),
                    scope={"node": node, "nodes": len(node_ranks), "digest": digest_, "step_bytes": step_bytes,
                           "step_tensors": step_tensors})
        name = f"manifest-node-{node:05d}.json"
        text = write_manifest(folder, part, name)
        index["nodes"].append({"node": node, "ranks": ranks})
        index["index"]["parts"].append({"node": node, "file": name, "bytes": len(text), "checksum": digest(text)})
    write_manifest(folder, index)

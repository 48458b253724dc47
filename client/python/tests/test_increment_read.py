"""ckptd's Python readers (ckptd.dcp and load(from_path=)) read incremental steps, format
version 5 (issue 48, step 1: docs/design/incremental.md sections 2, 3 and 8): a step whose
pieces reference an earlier step's file is read through the references, bit-exact, also when
that step was retired aside (`step-M.held-<run>`); a damaged, replaced or missing origin and
a malformed version 5 manifest are refused, naming what is wrong. Nothing writes version 5
yet: a real step saved through ckptd gives the state, and increment_chain.py lays it out as
a chain by hand (step 10 full, step 20 referencing it), 2 ranks. PyTorch 2 (ckptd.dcp).
"""
import json
import os
import re
import shutil
import sys
import tempfile

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import increment_chain as chain  # noqa: E402
from conftest import Daemon, same  # noqa: E402

from ckptd import _increment  # noqa: E402
from ckptd.torch import CheckpointError, CheckpointManager  # noqa: E402

RUN = 0x18F3A9C2D4E5B6A7
WORLD = 2
REFERENCED_STATE = ("file/tokenizer.json", "optim.param_groups")
TOKENIZER = bytes(range(256)) * 300  # a file stored with each step, unchanged: referenced


def make(seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    return model, optimizer, scheduler


def read_real_step(folder):
    """A version 1 step's tensors and rank 0's train state, straight from its file."""
    with open(os.path.join(folder, "manifest.json")) as f:
        manifest = json.load(f)
    with open(os.path.join(folder, "rank-00000.safetensors"), "rb") as f:
        data = f.read()
    start = 8 + int.from_bytes(data[:8], "little")
    types = {"F32": torch.float32}
    tensors = {}
    for name, t in manifest["tensors"].items():
        lo, hi = t["shards"][0]["data_offsets"]
        tensors[name] = torch.frombuffer(bytearray(data[start + lo:start + hi]),
                                         dtype=types[t["dtype"]]).view(t["global_shape"]).clone()
    state = {name: data[start + e["data_offsets"][0]:start + e["data_offsets"][1]]
             for name, e in manifest["shards"][0]["train_state"].items()}
    return tensors, state


@pytest.fixture(scope="module")
def source():
    """A real step saved through ckptd (model, Adam, StepLR, a stored file), read back:
    (tensors, rank 0's train state, the scheduler's state, the RNG after the save)."""
    workdir = tempfile.mkdtemp(prefix="ckptd-py.", dir="/tmp")
    daemon = Daemon(workdir, ["--increments", "off"]).start()  # a whole step to build chains from
    try:
        model, optimizer, scheduler = make(0)
        for _ in range(3):
            model(torch.randn(3, 4)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
        with CheckpointManager("real", model, optimizer, scheduler, socket=daemon.socket) as manager:
            torch.manual_seed(11)
            manager.save(5, blocking=True, files={"tokenizer.json": TOKENIZER})
            rng_after = torch.rand(2)
        tensors, state = read_real_step(os.path.join(daemon.root, "real", "step-00000005"))
        yield tensors, state, scheduler.state_dict(), rng_after
    finally:
        daemon.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def layout(tensors):
    """Matrices split by rows between the 2 ranks, the rest on rank 0."""
    out = {}
    for name, t in tensors.items():
        if t.dim() == 2 and t.shape[0] % 2 == 0:
            half = t.shape[0] // 2
            out[name] = [(0, (0, 0), (half, t.shape[1])), (1, (half, 0), (half, t.shape[1]))]
        else:
            out[name] = [(0, (0,) * t.dim(), tuple(t.shape))]
    return out


def step20_tensors(tensors):
    """Step 10's tensors, some changed: pieces partly changed (own __delta__ runs between
    references), wholly changed (written whole) and unchanged (referenced whole)."""
    new = {k: v.clone() for k, v in tensors.items()}
    new["0.weight"][1] += 1.0                    # rank 0: chunk 1 of 4 own; rank 1: referenced
    new["0.bias"][5] -= 0.5                      # chunk 1 of 2 own
    new["2.weight"][0] *= 2.0                    # rank 0: its one chunk changed: whole
    new["optim.0.weight.exp_avg"] += 0.25        # every chunk: whole on both ranks
    new["optim.0.weight.exp_avg_sq"][[2, 6]] = 3.0  # a chunk in the middle of each rank's piece
    for name in new:
        if name.endswith(".step"):
            new[name] += 10.0
    return new


@pytest.fixture
def steps(source, workdir):
    """The job folder holding step 10 (full) and step 20 (its increment), both version 5:
    (the job folder, step 20's tensors, step 20's record)."""
    tensors, state, _, _ = source
    job = os.path.join(workdir, "chains", "inc")
    os.makedirs(job)
    state = {0: state}
    ten = chain.write_step(job, 10, RUN, lambda r: RUN + r, WORLD, tensors, layout(tensors), state)
    new = step20_tensors(tensors)
    twenty = chain.write_step(job, 20, RUN, lambda r: RUN + 0x100 + r, WORLD, new, layout(new), state, base=ten,
                              referenced_state=REFERENCED_STATE)
    return job, new, twenty


def test_the_chain_is_what_the_format_says(steps):
    """The helper wrote what the cases below read: whole pieces, references mixed with own
    runs, unchanged pieces referenced whole, referenced train state."""
    _, _, twenty = steps
    m = twenty["manifest"]
    assert m["format_version"] == 5 and m["increment"]["origin_steps"] == [{"step": 10, "run": RUN}]
    assert [(o["rank"], o["file"]) for o in m["increment"]["origins"]] == [
        (0, f"rank-00000.{RUN:016x}.safetensors"), (1, f"rank-00001.{RUN + 1:016x}.safetensors")]
    pieces = {(n, p["rank"]): p for n, t in m["tensors"].items() for p in t["shards"]}
    assert [{k: v for k, v in e.items() if k != "at"} for e in pieces[("0.weight", 0)]["extents"]] == [
        {"chunks": [0, 1], "step": 10}, {"chunks": [1, 2]}, {"chunks": [2, 4], "step": 10}]
    assert [e.get("step") for e in pieces[("0.weight", 1)]["extents"]] == [10]
    assert "file" in pieces[("2.weight", 0)] and "file" in pieces[("optim.0.weight.exp_avg", 1)]
    assert [e.get("step") for e in pieces[("2.bias", 0)]["extents"]] == [10]
    state = m["shards"][0]["train_state"]
    assert state["file/tokenizer.json"]["step"] == 10 and "step" not in state["rng.torch"]


def dcp_state(new):
    """A state dict of DCP's model and optimizer keys, filled with 7."""
    state = {k: torch.full_like(v, 7.0) for k, v in new.items() if not k.startswith("optim.")}
    optim = {}
    for k, v in new.items():
        if k.startswith("optim."):
            fqn, key = k[len("optim."):].rsplit(".", 1)
            optim.setdefault(fqn, {})[key] = torch.full_like(v, 7.0)
    state["optimizer"] = {"state": optim, "param_groups": [{"lr": -1.0}]}
    return state


def check_dcp(folder, new, lr):
    import torch.distributed.checkpoint as dcp
    from ckptd.dcp import CkptdStorageReader

    state = dcp_state(new)
    dcp.load(state, storage_reader=CkptdStorageReader(folder))
    for k, v in new.items():
        if k.startswith("optim."):
            fqn, key = k[len("optim."):].rsplit(".", 1)
            got = state["optimizer"]["state"][fqn][key]
        else:
            got = state[k]
        assert same(got, v), k
    # The parameter groups come from a train-state blob that step 20 references in step 10.
    assert state["optimizer"]["param_groups"][0]["lr"] == lr


def check_from_path(daemon, folder, source, new):
    _, _, scheduler_state, rng_after = source
    model, optimizer, scheduler = make(5)
    with CheckpointManager("inc-load", model, optimizer, scheduler, socket=daemon.socket) as manager:
        restored = manager.load(from_path=folder)
        assert restored.step == 20
        for k, v in model.state_dict().items():
            assert same(v, new[k]), k
        for fqn, p in zip(("0.weight", "0.bias", "2.weight", "2.bias"), model.parameters()):
            for key in ("exp_avg", "exp_avg_sq", "step"):
                assert same(optimizer.state[p][key], new[f"optim.{fqn}.{key}"]), (fqn, key)
        assert scheduler.state_dict() == scheduler_state
        assert manager.restored_files == {"tokenizer.json": TOKENIZER}  # referenced in step 10
        assert torch.equal(torch.rand(2), rng_after)


def test_an_unchanged_empty_piece_is_one_referenced_chunk(workdir):
    """ckptd counts an empty piece (an empty GPU shard of an unevenly split tensor) as one
    chunk (format/increment.cc, PieceChunks), so an unchanged one is a reference to chunks
    [0, 1) of its base; the readers count it alike (they counted none, and refused every such
    step)."""
    from ckptd._references import PieceReader
    from ckptd._step_files import _StepFiles

    tensors = {"w": torch.arange(32, dtype=torch.float32).reshape(8, 4), "empty": torch.zeros(0, 4)}
    whole = {name: [(0, (0, 0), tuple(t.shape))] for name, t in tensors.items()}
    job = os.path.join(workdir, "chains", "empty")
    os.makedirs(job)
    ten = chain.write_step(job, 10, RUN, lambda r: RUN + r, 1, tensors, whole, {})
    new = dict(tensors, w=tensors["w"] + 1.0)
    chain.write_step(job, 20, RUN, lambda r: RUN + 0x100 + r, 1, new, whole, {}, base=ten)
    folder = chain.step_dir(job, 20)
    with open(os.path.join(folder, "manifest.json")) as f:
        manifest = json.load(f)
    piece = manifest["tensors"]["empty"]["shards"][0]
    assert [e["chunks"] for e in piece["extents"]] == [[0, 1]] and piece["extents"][0]["step"] == 10
    files = _increment.check(manifest)
    reader = PieceReader(_StepFiles(folder))
    try:
        reader.check_origins(files)
        assert reader.piece("empty", "F32", piece, files[0]) == b""
        w = reader.piece("w", "F32", manifest["tensors"]["w"]["shards"][0], files[0])
        assert torch.equal(torch.frombuffer(w, dtype=torch.float32).reshape(8, 4), new["w"])
    finally:
        reader.close()


def test_dcp_and_from_path_read_an_increment_bit_exact(daemon, source, steps):
    job, new, _ = steps
    folder = chain.step_dir(job, 20)
    check_dcp(folder, new, source[2]["_last_lr"][0])
    check_from_path(daemon, folder, source, new)
    # Step 10, the full step, reads as itself.
    check_dcp(chain.step_dir(job, 10), source[0], source[2]["_last_lr"][0])


def test_a_retired_origin_held_aside_still_reads(daemon, source, steps):
    job, new, _ = steps
    os.rename(chain.step_dir(job, 10), chain.step_dir(job, 10) + f".held-{RUN:016x}")
    folder = chain.step_dir(job, 20)
    check_dcp(folder, new, source[2]["_last_lr"][0])
    check_from_path(daemon, folder, source, new)
    # Held by another run's number: not this step's origin, which is then missing, named.
    os.rename(chain.step_dir(job, 10) + f".held-{RUN:016x}", chain.step_dir(job, 10) + f".held-{RUN + 1:016x}")
    from ckptd.dcp import CkptdStorageReader
    with pytest.raises(ValueError, match=r"step 10's file of rank 0, "
                                         r"which this step references, is missing: neither .*step-00000010/rank-"
                                         r".* nor .*step-00000010\.held-18f3a9c2d4e5b6a7/rank-"):
        CkptdStorageReader(folder).read_metadata()
    model, optimizer, scheduler = make(5)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with CheckpointManager("inc-load", model, optimizer, scheduler, socket=daemon.socket) as manager:
        with pytest.raises(CheckpointError, match=r"step 10's file of rank 0, .* is missing"):
            manager.load(from_path=folder)
    assert same(model.state_dict(), before)


def flip(path, at):
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x10]))


def test_a_damaged_referenced_chunk_is_named_and_not_loaded(daemon, steps):
    import torch.distributed.checkpoint as dcp
    from ckptd.dcp import CkptdStorageReader

    job, new, twenty = steps
    piece = next(p for p in twenty["manifest"]["tensors"]["0.weight"]["shards"] if p["rank"] == 0)
    origin = os.path.join(chain.step_dir(job, 10), f"rank-00000.{RUN:016x}.safetensors")
    at = piece["extents"][2]["at"]  # chunk 2 (row 2) of rank 0's piece, referenced in step 10
    with open(origin, "rb") as f:
        start = 8 + int.from_bytes(f.read(8), "little")
    flip(origin, start + at + 5)
    folder = chain.step_dir(job, 20)
    named = (r"step-00000010/rank-00000\.18f3a9c2d4e5b6a7\.safetensors \(step 10's file of rank 0\): tensor "
             rf"0\.weight: chunk 2 of 4, bytes \[{at}, {at + 16}\) of its data region, does not match its checksum")

    state = dcp_state(new)
    with pytest.raises(dcp.api.CheckpointException) as error:
        dcp.load(state, storage_reader=CkptdStorageReader(folder))
    assert any(re.search(named, str(f)) for f in error.value.failures.values()), error.value.failures
    assert torch.all(state["0.weight"][:4] == 7.0)  # nothing of the piece

    model, optimizer, scheduler = make(5)
    before = model[0].weight.detach().clone()
    with CheckpointManager("inc-load", model, optimizer, scheduler, socket=daemon.socket) as manager:
        with pytest.raises(CheckpointError, match=named):
            manager.load(from_path=folder)
    assert torch.equal(model[0].weight.detach(), before)


def test_an_extent_outside_its_tensors_entries_is_refused(daemon, steps):
    """An extent must lie in an entry of its file's header that holds the tensor: the piece
    itself (in an origin) or a __delta__ of it, of its dtype; here one points at another
    tensor's bytes in step 10's file."""
    from ckptd.dcp import CkptdStorageReader
    import torch.distributed.checkpoint as dcp

    job, new, twenty = steps
    folder = chain.step_dir(job, 20)
    manifest = json.loads(json.dumps(twenty["manifest"]))
    bias_at = chain.read_header(os.path.join(chain.step_dir(job, 10), f"rank-00000.{RUN:016x}.safetensors"))[
        "0.bias"]["data_offsets"][0]
    _piece(manifest, "0.weight", 0)["extents"][0]["at"] = bias_at
    chain.write_manifest(folder, manifest)
    named = (rf"step-00000010/rank-00000\.18f3a9c2d4e5b6a7\.safetensors \(step 10's file of rank 0\): tensor 0\.weight: "
             rf"bytes \[{bias_at}, {bias_at + 16}\) of its data region are in no F32 entry of 0\.weight \(or of a "
             r"__delta__ of it\)")
    with pytest.raises(dcp.api.CheckpointException) as error:
        dcp.load(dcp_state(new), storage_reader=CkptdStorageReader(folder))
    assert any(re.search(named, str(f)) for f in error.value.failures.values()), error.value.failures
    model, optimizer, scheduler = make(5)
    with CheckpointManager("inc-load", model, optimizer, scheduler, socket=daemon.socket) as manager:
        with pytest.raises(CheckpointError, match=named):
            manager.load(from_path=folder)


@pytest.mark.parametrize("change", ["longer", "shorter"])
def test_an_origin_file_of_another_size_is_refused(daemon, steps, change):
    from ckptd.dcp import CkptdStorageReader

    job, _, twenty = steps
    origin = os.path.join(chain.step_dir(job, 10), f"rank-00001.{RUN + 1:016x}.safetensors")
    size = os.path.getsize(origin)
    with open(origin, "r+b") as f:
        if change == "longer":
            f.seek(0, 2)
            f.write(b"\0")
        else:
            f.truncate(size - 1)
    named = (rf"step-00000010/rank-00001\.18f3a9c2d4e5b6a8\.safetensors: step 10's file of rank 1, which this step "
             rf"references, is {size + (1 if change == 'longer' else -1)} bytes, not the {size} it was")
    folder = chain.step_dir(job, 20)
    with pytest.raises(ValueError, match=named):
        CkptdStorageReader(folder).read_metadata()
    model, optimizer, scheduler = make(5)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with CheckpointManager("inc-load", model, optimizer, scheduler, socket=daemon.socket) as manager:
        with pytest.raises(CheckpointError, match=named):
            manager.load(from_path=folder)
    assert same(model.state_dict(), before)  # refused before a byte is copied


def _piece(m, name, rank):
    return next(p for p in m["tensors"][name]["shards"] if p["rank"] == rank)


def _shard_file(m, name):
    m["shards"][0]["file"] = name
    for t in m["tensors"].values():
        for p in t["shards"]:
            if p["rank"] == 0 and "file" in p:
                p["file"] = name


def _as_version_1(m):
    """Version 1's names, its extents and referenced train state left as they were."""
    m["format_version"] = 1
    for shard in m["shards"]:
        shard["file"] = f"rank-{shard['rank']:05d}.safetensors"
    for t in m["tensors"].values():
        for p in t["shards"]:
            if "file" in p:
                p["file"] = f"rank-{p['rank']:05d}.safetensors"


# Each: (what is changed in step 20's manifest, what the refusal says).
MALFORMED = {
    "a path": (lambda m: _shard_file(m, "../x"), r"shard file '\.\./x' is not rank-NNNNN\.<16 hex digits>\.safetensors"),
    "a path in a piece": (lambda m: _piece(m, "2.weight", 0).update(file="../step-00000010/rank-00000.safetensors"),
                          r"tensor 2\.weight: rank 0's piece: whole in file '\.\./step-00000010/"),
    "a tag of 15 digits": (lambda m: _shard_file(m, "rank-00000.18f3a9c2d4e5b6a.safetensors"),
                           r"shard file 'rank-00000\.18f3a9c2d4e5b6a\.safetensors' is not rank-NNNNN\.<16 hex"),
    "an untagged name": (lambda m: _shard_file(m, "rank-00000.safetensors"),
                         r"shard file 'rank-00000\.safetensors' is not rank-NNNNN\.<16 hex digits>\.safetensors"),
    "another rank's origin": (lambda m: m["increment"]["origins"][0].update(
                                  file=f"rank-00001.{RUN + 1:016x}.safetensors"),
                              r"shard file 'rank-00001\.18f3a9c2d4e5b6a8\.safetensors' is not rank 0's"),
    "another rank's shard file": (lambda m: _shard_file(m, f"rank-00001.{RUN:016x}.safetensors"),
                                  r"shard file 'rank-00001\.18f3a9c2d4e5b6a7\.safetensors' is not rank 0's"),
    "an uncovered chunk": (lambda m: _piece(m, "0.weight", 0)["extents"].pop(1),
                           r"tensor 0\.weight: rank 0's piece: extent .* does not begin at chunk 1"),
    "a chunk past the end": (lambda m: _piece(m, "0.weight", 0)["extents"][-1].update(chunks=[2, 5]),
                             r"tensor 0\.weight: rank 0's piece: its extents cover chunks \[0, 5\) of its 4"),
    "extents and a whole entry": (lambda m: _piece(m, "0.bias", 0).update(data_offsets=[0, 32]),
                                  r"tensor 0\.bias: rank 0's piece: both extents and a whole entry"),
    "an origin of its own step": (lambda m: [o.update(step=20) for o in m["increment"]["origins"]] and [
                                      s.update(step=20) for s in m["increment"]["origin_steps"]],
                                  r"increment: an origin of rank 0 in step 20, this step itself"),
    "an extent in a step without origin": (lambda m: _piece(m, "0.weight", 0)["extents"][0].update(step=15),
                                           r"extent .* is in step 15, of which increment\.origins lists no file"),
    "origin_steps unlike the origins": (lambda m: m["increment"]["origin_steps"][0].update(run=RUN + 1),
                                        r"increment: origin_steps .* are not the \(step, run\) of its origins"),
    "no increment": (lambda m: m.pop("increment"), r'no "increment" table'),
    "a chunk size not of the dtype": (lambda m: _piece(m, "0.bias", 0).update(chunk_bytes=6),
                                      r"tensor 0\.bias: rank 0's piece: chunk_bytes 6 is not a positive multiple"),
    "too few chunk checksums": (lambda m: _piece(m, "0.weight", 0)["chunk_checksums"].pop(),
                                r"chunk_checksums must be 4 xxh3 digests"),
    "a node-scoped manifest": (lambda m: m.update(scope={"node": 1}), r"a node-scoped manifest \(format version 5"),
    "a newer version": (lambda m: m.update(format_version=6), r"6"),
    "references in version 1": (_as_version_1,
                                r"references \(extents, or train state in another step\) in format version 1"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_malformed_version_5_manifest_is_refused(daemon, steps, case):
    from ckptd.dcp import CkptdStorageReader
    from ckptd import _sources

    job, _, twenty = steps
    folder = chain.step_dir(job, 20)
    manifest = json.loads(json.dumps(twenty["manifest"]))
    change, said = MALFORMED[case]
    change(manifest)
    chain.write_manifest(folder, manifest)
    with pytest.raises(ValueError, match=said if case != "a newer version" else
                       r"not a ckptd manifest of a version this reader knows \(format_version 6; it reads 1 to 5\)"):
        CkptdStorageReader(folder).read_metadata()
    with pytest.raises(CheckpointError, match=said if case != "a newer version" else
                       r"format version 6 is newer than this reader understands \(5\)"):
        _sources.StepDirectory(folder)


def test_an_index_of_version_5_joins_its_parts(daemon, source, steps):
    """A step too large for one manifest: an index (version 5) and one part per node (version
    5, node-scoped), each with its ranks' origins; read alike. A part that leaves out its
    origins no longer matches the index's origin steps."""
    from ckptd.dcp import CkptdStorageReader

    job, new, twenty = steps
    folder = chain.step_dir(job, 20)
    chain.publish_as_index(folder, twenty["manifest"], [[0], [1]])
    with open(os.path.join(folder, "manifest.json")) as f:
        index = json.load(f)
    assert index["format_version"] == 5 and "origins" not in index["increment"] and index["index"]["parts"]
    check_dcp(folder, new, source[2]["_last_lr"][0])
    check_from_path(daemon, folder, source, new)

    # Node 1's part has no origins (its rank's references then name a step it lists no file of).
    part = os.path.join(folder, "manifest-node-00001.json")
    with open(part) as f:
        text = json.load(f)
    text["increment"]["origins"] = []
    data = json.dumps(text, indent=1, sort_keys=True).encode()
    with open(part, "wb") as f:
        f.write(data)
    index["index"]["parts"][1].update(bytes=len(data), checksum=chain.digest(data))
    chain.write_manifest(folder, index)
    with pytest.raises(ValueError, match=r"tensor 0\.weight: rank 1's piece: extent .* is in step 10, of which "
                                         r"increment\.origins lists no file of this rank"):
        CkptdStorageReader(folder).read_metadata()

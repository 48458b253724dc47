"""ckptd.torch with what only PyTorch 2 has: torch.compile, DTensor, FSDP2 (fully_shard).

Run by //client/python:python_torch2_parallel_test only (run_pytest.sh leaves this file out on
Debian's PyTorch 1.13).
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import pytest
import torch

from ckptd.torch import CheckpointError, CheckpointManager

from conftest import CKPTCTL, PYTHONPATH, free_port

WORKER = "client/python/tests/dtensor_worker.py"


def manifest(daemon, job, step):
    with open(os.path.join(daemon.root, job, f"step-{step:08d}", "manifest.json")) as f:
        return json.load(f)


def equal_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def test_a_compiled_model_saves_plain_keys_and_restores_into_compiled_and_plain(daemon):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    compiled = torch.compile(model, backend="eager")  # an OptimizedModule, as with inductor
    optimizer = torch.optim.AdamW(compiled.parameters(), lr=1e-2)
    assert all(name.startswith("_orig_mod.") for name, _ in compiled.named_parameters())
    with CheckpointManager("compiled", compiled, optimizer, socket=daemon.socket) as manager:
        compiled(torch.randn(3, 4)).sum().backward()
        optimizer.step()
        manager.save(1, blocking=True)
        saved = {k: v.clone() for k, v in model.state_dict().items()}
    keys = set(manifest(daemon, "compiled", 1)["tensors"])
    assert {"0.weight", "0.bias", "2.weight", "2.bias", "optim.0.weight.exp_avg"} <= keys
    assert not any("_orig_mod" in k for k in keys)

    for compile_it in (True, False):
        torch.manual_seed(1)
        fresh = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        target = torch.compile(fresh, backend="eager") if compile_it else fresh
        with CheckpointManager("compiled", target, torch.optim.AdamW(target.parameters()),
                               socket=daemon.socket) as manager:
            assert manager.load() == 1
        for k, v in fresh.state_dict().items():
            assert equal_bits(v, saved[k]), k


def test_mixed_precision_keeps_every_dtype(daemon):
    """BF16 parameters trained through FP32 master weights held by the optimizer."""
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16).to(torch.bfloat16)
    master = [torch.nn.Parameter(p.detach().float()) for p in model.parameters()]
    optimizer = torch.optim.Adam(master, lr=1e-2)
    for p in master:
        p.grad = torch.randn_like(p)
    optimizer.step()
    with torch.no_grad():
        for p, m in zip(model.parameters(), master):
            p.copy_(m)
    with CheckpointManager("mixed", model, optimizer, socket=daemon.socket) as manager:
        manager.save(1, blocking=True)
    tensors = manifest(daemon, "mixed", 1)["tensors"]
    assert tensors["weight"]["dtype"] == "BF16"
    assert tensors["optim.group0.param0.exp_avg"]["dtype"] == "F32"
    saved_model = {k: v.clone() for k, v in model.state_dict().items()}
    saved_master = [m.detach().clone() for m in master]

    model2 = torch.nn.Linear(16, 16).to(torch.bfloat16)
    master2 = [torch.nn.Parameter(torch.zeros_like(m)) for m in saved_master]
    optimizer2 = torch.optim.Adam(master2, lr=1e-2)
    with CheckpointManager("mixed", model2, optimizer2, socket=daemon.socket) as manager:
        assert manager.load() == 1
    for k, v in model2.state_dict().items():
        assert v.dtype == torch.bfloat16 and equal_bits(v, saved_model[k])
    for state in optimizer2.state.values():
        assert state["exp_avg"].dtype == torch.float32


def run_ranks(daemon, job, mode, layout, out, world=2):
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, PYTHONPATH=PYTHONPATH, RANK=str(rank), WORLD_SIZE=str(world),
                   LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen(
            [sys.executable, WORKER, "--socket", daemon.socket, "--job", job, "--mode", mode,
             "--layout", layout, "--out", out],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
    for p in procs:
        out_text, err = p.communicate(timeout=300)
        assert p.returncode == 0, f"{mode} rank exited {p.returncode}:\n{out_text}\n{err}"


def check_dtensor_round_trip(daemon, workdir, layout):
    job = f"dtensor-{layout}"
    run_ranks(daemon, job, "save", layout, workdir)
    daemon.restart()  # restore from disk: the manifest's placements put the shards back
    run_ranks(daemon, job, "load", layout, workdir)
    saved = torch.load(os.path.join(workdir, "saved.pt"))
    loaded = torch.load(os.path.join(workdir, "loaded.pt"))
    assert saved.keys() == loaded.keys()
    for k in saved:
        assert equal_bits(saved[k], loaded[k]), k
    # Training goes on from the restored state exactly as it did from the saved one.
    assert equal_bits(torch.load(os.path.join(workdir, "losses-save.pt")),
                      torch.load(os.path.join(workdir, "losses-load.pt")))
    return manifest(daemon, job, 3)["tensors"]


def test_tensor_parallel_dtensors_save_their_shards_with_global_placement(daemon, workdir):
    tensors = check_dtensor_round_trip(daemon, workdir, "tp")
    weight = tensors["0.weight"]  # Linear(6, 8) sharded by rows over 2 ranks
    assert weight["global_shape"] == [8, 6]
    assert sorted((s["offset"], s["shape"]) for s in weight["shards"]) == [([0, 0], [4, 6]), ([4, 0], [4, 6])]
    by_column = tensors["2.weight"]  # Linear(8, 5) sharded by columns
    assert by_column["global_shape"] == [5, 8]
    assert sorted((s["offset"], s["shape"]) for s in by_column["shards"]) == [([0, 0], [5, 4]), ([0, 4], [5, 4])]
    exp_avg = tensors["optim.0.weight.exp_avg"]  # Adam state follows its parameter
    assert exp_avg["global_shape"] == [8, 6]
    assert sorted(s["offset"] for s in exp_avg["shards"]) == [[0, 0], [4, 0]]
    assert sorted((s["offset"], s["shape"]) for s in tensors["0.bias"]["shards"]) == [([0], [4]), ([4], [4])]
    replicated = tensors["2.bias"]  # a whole copy per rank
    assert replicated["global_shape"] == [5]
    assert [(s["offset"], s["shape"]) for s in replicated["shards"]] == [([0], [5]), ([0], [5])]


def test_fsdp2_fully_shard_saves_and_resumes_bit_exactly(daemon, workdir):
    tensors = check_dtensor_round_trip(daemon, workdir, "fsdp2")
    weight = tensors["0.weight"]  # FSDP2 shards dim 0 and pads the last rank's
    assert weight["global_shape"] == [9, 6]
    assert sorted((s["offset"], s["shape"]) for s in weight["shards"]) == [([0, 0], [5, 6]), ([5, 0], [4, 6])]
    assert tensors["2.bias"]["global_shape"] == [5]


@pytest.mark.parametrize("layout,world", [("tp", 4), ("fsdp2", 3), ("fsdp2", 1)])
def test_dtensor_models_restore_on_another_mesh_size(daemon, workdir, layout, world):
    # Saved on a mesh of 2, restored on 4, 3 (FSDP2 pads the uneven last shard) or 1: the
    # full tensors are the saved ones, bit for bit. (Uneven tensor-parallel shards are
    # views that ckptd.torch cannot register yet.)
    job = f"mesh-{layout}"
    run_ranks(daemon, job, "save", layout, workdir)
    daemon.restart()
    run_ranks(daemon, job, "load", layout, workdir, world=world)
    saved = torch.load(os.path.join(workdir, "saved.pt"))
    loaded = torch.load(os.path.join(workdir, "loaded.pt"))
    assert saved.keys() == loaded.keys()
    for k in saved:
        assert equal_bits(saved[k], loaded[k]), k


# --- Warm start of a sharded model from a Hugging Face folder ------------------------------

def write_hf_folder(model, folder):
    """The model's weights as a Hugging Face folder of two files and their index, the second
    layer's weight in BF16 (loaded into the FP32 model by a cast)."""
    from safetensors.torch import save_file
    os.makedirs(folder)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    state["2.weight"] = state["2.weight"].to(torch.bfloat16)
    files = {"model-00001-of-00002.safetensors": ["0.weight", "0.bias"],
             "model-00002-of-00002.safetensors": ["2.weight", "2.bias"]}
    for file, names in files.items():
        save_file({n: state[n] for n in names}, os.path.join(folder, file))
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": {n: file for file, names in files.items() for n in names}}, f)


@pytest.mark.parametrize("layout", ["fsdp2", "tp", "gpt2"])
def test_a_sharded_model_warm_starts_from_a_hugging_face_folder_each_rank_reading_its_shards(
        daemon, workdir, layout):
    # FSDP2 (uneven row shards), tensor parallelism (row and column shards, a replicated
    # bias) and a GPT-2 wrapped with fully_shard loading a save_pretrained folder of several
    # files (BF16, tied lm_head): each of 2 ranks loads its shards of the folder into the
    # already sharded model; gathered, the model is what the same folder loads into the
    # model unsharded, bit for bit, and the ranks between them loaded each byte once.
    from dtensor_worker import build
    source, _ = build(layout, None, seed=0)
    folder = os.path.join(workdir, "hf")
    if layout == "gpt2":
        source.to(torch.bfloat16).save_pretrained(folder, max_shard_size="20KB")
        assert os.path.exists(os.path.join(folder, "model.safetensors.index.json"))
    else:
        write_hf_folder(source, folder)
    whole, _ = build(layout, None, seed=2)
    with CheckpointManager(f"hf-whole-{layout}", whole, socket=daemon.socket) as manager:
        assert manager.load(from_hf=folder).source == "hf"
    run_ranks(daemon, f"hf-{layout}", "from_hf", layout, workdir)
    loaded = torch.load(os.path.join(workdir, "loaded.pt"))
    expected = {f"model.{n}": p.detach() for n, p in whole.named_parameters()}
    assert loaded.keys() == expected.keys()
    for k in expected:
        assert equal_bits(loaded[k], expected[k]), k
    # What the ranks started from differs (every matrix; biases and norms may be
    # initialized alike by every seed, as GPT-2's are).
    before = dict(build(layout, None, seed=1)[0].named_parameters())
    assert all(not torch.equal(before[k[len("model."):]], v) for k, v in expected.items() if v.dim() == 2)
    per_rank = [int(open(os.path.join(workdir, f"hf-bytes-{r}")).read()) for r in range(2)]
    total = sum(p.numel() * p.element_size() for p in whole.parameters())
    # Each rank filled its shards alone; only tensor parallelism's replicated bias is on both.
    replicated = whole[2].bias.numel() * 4 if layout == "tp" else 0
    assert sum(per_rank) == total + replicated and all(0 < b < total for b in per_rank), (per_rank, total)


# --- Export to Hugging Face -----------------------------------------------------------------

def export(daemon, job, step, out, *args):
    r = subprocess.run([CKPTCTL, "export", "--root", daemon.root, "--job", job, str(step), out, *args],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"ckptctl export exited {r.returncode}:\n{r.stdout}\n{r.stderr}"
    return r.stdout


def test_a_gpt2_saved_by_2_fsdp2_ranks_exports_to_what_transformers_loads(daemon, workdir):
    # A tiny GPT-2 from a config (random weights, no downloads), sharded by FSDP2 over 2
    # ranks, saved through ckptd.torch; exported with the daemon stopped; transformers loads
    # the folder and gives the logits the sharded model gave, from weights equal bit for bit.
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file
    run_ranks(daemon, "gpt2", "save", "gpt2", workdir)
    daemon.stop()
    out = os.path.join(workdir, "hf")
    printed = export(daemon, "gpt2", 3, out, "--max-shard-size", "100KB",
                     "--with", os.path.join(workdir, "config.json"))
    assert "optimizer tensors (optim.*)" in printed  # Adam's state is left out
    index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors", files
    assert not any(k.startswith("optim.") for k in index["weight_map"])

    model = transformers.GPT2LMHeadModel.from_pretrained(out)
    model.eval()
    saved = torch.load(os.path.join(workdir, "saved.pt"))
    for name, p in model.named_parameters():
        assert equal_bits(p.detach(), saved[f"model.{name}"]), name
    from dtensor_worker import gpt2_input
    with torch.no_grad():
        logits = model(gpt2_input()).logits
    torch.testing.assert_close(logits, torch.load(os.path.join(workdir, "logits.pt")))

    # In BF16 and FP16: each tensor as PyTorch's own .to() rounds it.
    for flag, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        one = os.path.join(workdir, f"model-{flag}.safetensors")
        export(daemon, "gpt2", 3, one, "--format", "safetensors", "--dtype", flag)
        tensors = load_file(one)
        assert set(tensors) == set(index["weight_map"])
        for name, t in tensors.items():
            assert t.dtype == dtype, name
            assert equal_bits(t, saved[f"model.{name}"].to(dtype)), (flag, name)


# --- DCP interoperability -----------------------------------------------------------------

def test_dcp_loads_a_ckptd_checkpoint_without_a_daemon(daemon):
    import torch.distributed.checkpoint as dcp
    from ckptd.dcp import CkptdStorageReader

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    with CheckpointManager("for-dcp", model, optimizer, socket=daemon.socket) as manager:
        model(torch.randn(3, 4)).sum().backward()
        optimizer.step()
        manager.save(1, blocking=True)
        saved = {k: v.clone() for k, v in model.state_dict().items()}
        saved_avg = optimizer.state[model[0].weight]["exp_avg"].clone()
    daemon.stop()  # DCP reads the files alone
    step_dir = os.path.join(daemon.root, "for-dcp", "step-00000001")

    torch.manual_seed(1)
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    state = fresh.state_dict()
    dcp.load(state, storage_reader=CkptdStorageReader(step_dir))
    fresh.load_state_dict(state)
    for k, v in fresh.state_dict().items():
        assert equal_bits(v, saved[k]), k
    # Optimizer tensors, under torchtitan's keys.
    optim_state = {"optimizer": {"state": {"0.weight": {"exp_avg": torch.zeros(8, 4)}}}}
    dcp.load(optim_state, storage_reader=CkptdStorageReader(step_dir))
    assert equal_bits(optim_state["optimizer"]["state"]["0.weight"]["exp_avg"], saved_avg)

    # A damaged shard is refused, naming the tensor; nothing of it reaches the target.
    piece = manifest(daemon, "for-dcp", 1)["tensors"]["2.weight"]["shards"][0]
    with open(os.path.join(step_dir, piece["file"]), "r+b") as f:
        at = 8 + int.from_bytes(f.read(8), "little") + piece["data_offsets"][0] + 3
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x10]))
    target = {k: torch.full_like(v, 7.0) for k, v in saved.items()}
    with pytest.raises(dcp.api.CheckpointException) as error:
        dcp.load(target, storage_reader=CkptdStorageReader(step_dir))
    assert f"{piece['file']}: tensor 2.weight: checksum mismatch" in str(error.value.failures[0])
    assert torch.all(target["2.weight"] == 7.0)

    # A crafted manifest (a piece claiming more bytes than its elements) is refused before
    # anything is read.
    with open(os.path.join(step_dir, "manifest.json")) as f:
        crafted = json.load(f)
    crafted["tensors"]["0.bias"]["shards"][0]["data_offsets"][1] += 4096
    with open(os.path.join(step_dir, "manifest.json"), "w") as f:
        json.dump(crafted, f)
    with pytest.raises(ValueError, match=r"tensor 0\.bias: rank 0's piece: data_offsets .* do not hold its 32 bytes"):
        CkptdStorageReader(step_dir).read_metadata()


def publish_as_index(step_dir):
    """Rewrites a committed step's whole manifest as an index and one node-scoped part per
    rank, as a shared root's coordinator writes a step too large for one manifest
    (docs/format.md, "Indexed manifests")."""
    from ckptd._native import xxh3_64

    with open(os.path.join(step_dir, "manifest.json")) as f:
        whole = json.load(f)
    digest = "xxh3:00000000000000aa"
    header = {k: v for k, v in whole.items() if k not in ("shards", "tensors", "nodes", "manifest_checksum")}
    index = dict(header, format_version=4, shards=[], tensors={}, nodes=[],
                 index={"digest": digest, "parts": [], "step_tensors": len(whole["tensors"]),
                        "step_bytes": sum(s["bytes"] for s in whole["shards"])})
    for shard in whole["shards"]:
        rank = shard["rank"]
        tensors = {}
        for name, t in whole["tensors"].items():
            mine = [p for p in t["shards"] if p["rank"] == rank]
            if mine:
                tensors[name] = dict(t, shards=mine)
        part = dict(header, format_version=3, shards=[shard], tensors=tensors, nodes=[{"node": rank, "ranks": [rank]}],
                    scope={"node": rank, "nodes": len(whole["shards"]), "digest": digest,
                           "step_bytes": index["index"]["step_bytes"], "step_tensors": len(whole["tensors"])})
        text = json.dumps(part, indent=1, sort_keys=True).encode()
        name = f"manifest-node-{rank:05d}.json"
        with open(os.path.join(step_dir, name), "wb") as f:
            f.write(text)
        index["nodes"].append({"node": rank, "ranks": [rank]})
        index["index"]["parts"].append({"node": rank, "file": name, "bytes": len(text),
                                        "checksum": f"xxh3:{xxh3_64(text):016x}"})
    with open(os.path.join(step_dir, "manifest.json"), "w") as f:
        json.dump(index, f, indent=1, sort_keys=True)


def test_dcp_assembles_a_tensor_parallel_checkpoint_into_whole_tensors(whole_daemon, workdir):
    """Saved by 2 ranks as shards; DCP reshards it onto one process's plain tensors. Written
    whole (format version 4): publish_as_index makes an index of that version of it
    (test_increment_read.py reads version 5's)."""
    daemon = whole_daemon
    import torch.distributed.checkpoint as dcp
    from ckptd.dcp import CkptdStorageReader

    run_ranks(daemon, "tp-for-dcp", "save", "tp", workdir)
    saved = torch.load(os.path.join(workdir, "saved.pt"))
    state = {k[len("model."):]: torch.zeros_like(v) for k, v in saved.items() if k.startswith("model.")}
    state["optimizer"] = {"state": {"0.weight": {"exp_avg": torch.zeros(8, 6)}}}
    dcp.load(state, storage_reader=CkptdStorageReader(
        os.path.join(daemon.root, "tp-for-dcp", "step-00000003")))
    for k, v in saved.items():
        if k.startswith("model."):
            assert equal_bits(state[k[len("model."):]], v), k
    assert equal_bits(state["optimizer"]["state"]["0.weight"]["exp_avg"], saved["optim.0.weight.exp_avg"])

    # The same step published as a shared root publishes a step too large for one manifest:
    # an index and one part per node (here a node per rank). DCP reads it alike; a part that
    # is not the one its index names is refused.
    step_dir = os.path.join(daemon.root, "tp-for-dcp", "step-00000003")
    shutil.copy(os.path.join(step_dir, "manifest.json"), os.path.join(workdir, "whole.json"))
    publish_as_index(step_dir)
    state = {k[len("model."):]: torch.zeros_like(v) for k, v in saved.items() if k.startswith("model.")}
    dcp.load(state, storage_reader=CkptdStorageReader(step_dir))
    for k, v in saved.items():
        if k.startswith("model."):
            assert equal_bits(state[k[len("model."):]], v), k
    with open(os.path.join(step_dir, "manifest-node-00001.json"), "r+") as f:
        text = f.read().replace('"metadata"', '"metadatb"', 1)
        f.seek(0)
        f.write(text)
    with pytest.raises(ValueError, match=r"manifest-node-00001\.json: not the part the index names"):
        CkptdStorageReader(step_dir).read_metadata()
    # An index that leaves a node out is refused, not read as a step without its tensors.
    with open(os.path.join(step_dir, "manifest.json")) as f:
        index = json.load(f)
    index["nodes"].pop()
    index["index"]["parts"].pop()
    with open(os.path.join(step_dir, "manifest.json"), "w") as f:
        json.dump(index, f)
    with pytest.raises(ValueError, match=r"hold 1 of the 2 ranks"):
        CkptdStorageReader(step_dir).read_metadata()
    shutil.copy(os.path.join(workdir, "whole.json"), os.path.join(step_dir, "manifest.json"))

    # A manifest that leaves part of a tensor uncovered is refused (DCP would load the
    # covered part and leave the rest as it was, without a word).
    with open(os.path.join(step_dir, "manifest.json")) as f:
        crafted = json.load(f)
    crafted["tensors"]["0.weight"]["shards"].pop()
    with open(os.path.join(step_dir, "manifest.json"), "w") as f:
        json.dump(crafted, f)
    with pytest.raises(ValueError, match=r"tensor 0\.weight: its pieces do not cover"):
        CkptdStorageReader(step_dir).read_metadata()


@pytest.mark.parametrize("layout", ["nested", "torchtitan"])  # the tutorial's: test_dcp_real_models
def test_a_job_switches_from_dcp_to_ckptd(daemon, workdir, layout):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    for _ in range(3):
        model(torch.randn(3, 4)).sum().backward()
        optimizer.step()
        scheduler.step()
    if layout == "nested":
        state = {"model": model.state_dict(), "optimizer": get_optimizer_state_dict(model, optimizer)}
    else:  # torchtitan: model keys at the top, optimizer state flattened
        from torch.distributed.checkpoint.state_dict import StateDictOptions
        flat = StateDictOptions(flatten_optimizer_state_dict=True)
        state = {"optimizer": get_optimizer_state_dict(model, optimizer, options=flat), **model.state_dict()}
    state["lr_scheduler"] = scheduler.state_dict()
    dcp_dir = os.path.join(workdir, "dcp", "step-1200")
    dcp.save(state, checkpoint_id=dcp_dir)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    expected_avg = optimizer.state[model[2].weight]["exp_avg"].clone()

    torch.manual_seed(1)
    model2 = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    optimizer2 = torch.optim.Adam(model2.parameters(), lr=1e-2)
    scheduler2 = torch.optim.lr_scheduler.StepLR(optimizer2, step_size=2, gamma=0.5)
    with CheckpointManager("switched", model2, optimizer2, scheduler2, socket=daemon.socket) as manager:
        assert manager.load(from_dcp=dcp_dir) == 1200
        for k, v in model2.state_dict().items():
            assert equal_bits(v, expected[k]), k
        assert equal_bits(optimizer2.state[model2[2].weight]["exp_avg"], expected_avg)
        assert scheduler2.state_dict()["last_epoch"] == 3
        manager.save(1201, blocking=True)  # from here on, ckptd
    assert daemon.steps("switched") == [1201]
    model3 = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    optimizer3 = torch.optim.Adam(model3.parameters(), lr=1e-2)
    scheduler3 = torch.optim.lr_scheduler.StepLR(optimizer3, step_size=2, gamma=0.5)
    with CheckpointManager("switched", model3, optimizer3, scheduler3, socket=daemon.socket) as manager:
        assert manager.load() == 1201
    for k, v in model3.state_dict().items():
        assert equal_bits(v, expected[k]), k


def test_from_dcp_names_what_the_checkpoint_lacks(daemon, workdir):
    import torch.distributed.checkpoint as dcp

    dcp_dir = os.path.join(workdir, "dcp-small")
    dcp.save({"model": torch.nn.Sequential(torch.nn.Linear(4, 8)).state_dict()}, checkpoint_id=dcp_dir)
    bigger = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    with CheckpointManager("lacking", bigger, socket=daemon.socket) as manager:
        with pytest.raises(CheckpointError, match=r"cannot load DCP checkpoint .*dcp-small: Missing key in checkpoint state_dict: model\.1\.weight"):
            manager.load(from_dcp=dcp_dir, step=7)
        # A checkpoint of another model altogether: what was tried and what it holds.
        other = os.path.join(workdir, "dcp-other")
        dcp.save({"model": torch.nn.Linear(4, 8).state_dict()}, checkpoint_id=other)
        with pytest.raises(CheckpointError, match=r"cannot load DCP checkpoint .*dcp-other: none of the "
                           r"model's keys \(e.g. '0.weight'\) .* holds 2 keys under 'model', e.g. model.bias"):
            manager.load(from_dcp=other, step=7)


# --- the remote tier (ckptd --remote, a real Ceph RGW) -------------------------------------

@pytest.fixture(scope="module")
def bucket():
    """A single-node Ceph cluster with an S3 gateway (tools/ceph.sh) for this module; the
    AWS environment points at it. A machine where it cannot start fails the test."""
    where = tempfile.mkdtemp(prefix="ckptd-ceph.", dir="/tmp")
    script = os.path.join(os.getcwd(), "tools", "ceph.sh")
    started = subprocess.run([script, "start", os.path.join(where, "ceph")], capture_output=True, text=True)
    assert started.returncode == 0, f"tools/ceph.sh could not start a cluster:\n{started.stdout}{started.stderr}"
    env = dict(line.strip().split("=", 1) for line in open(os.path.join(where, "ceph", "s3.env")) if "=" in line)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    yield f"s3://{env['CKPTD_TEST_BUCKET']}/py"
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    subprocess.run([script, "stop", os.path.join(where, "ceph")], capture_output=True)
    shutil.rmtree(where, ignore_errors=True)


def remote_steps(bucket, job):
    """The steps `ckptctl list` shows in the remote tier for `job`."""
    listed = subprocess.run([CKPTCTL, "--job", job, "list", "--root", bucket], capture_output=True, text=True)
    assert listed.returncode == 0, listed.stderr
    rows = [line.split() for line in listed.stdout.splitlines()]  # JOB STEP ... WHERE KIND
    return {int(row[1]) for row in rows if row and row[0] == job and "remote" in row[-2]}  # WHERE, then KIND


def test_a_job_chooses_which_of_its_steps_go_to_the_bucket(bucket, workdir):
    from conftest import Daemon

    model = torch.nn.Linear(8, 8)
    with pytest.raises(ValueError, match="upload_every_steps must be at least 1"):
        CheckpointManager("picky", model, upload_every_steps=0)
    with pytest.raises(ValueError, match="upload_interval_seconds must be 0"):
        CheckpointManager("picky", model, upload_interval_seconds=-1)
    os.makedirs(os.path.join(workdir, "p"))
    # The node uploads every step; this job asks for every 2nd.
    daemon = Daemon(os.path.join(workdir, "p"), ["--remote", bucket, "--keep-last", "0"]).start()
    try:
        with CheckpointManager("picky", model, socket=daemon.socket, upload_every_steps=2) as manager:
            for step in range(1, 6):
                manager.save(step, blocking=True)
        deadline = time.monotonic() + 30
        while 4 not in remote_steps(bucket, "picky"):
            assert time.monotonic() < deadline, f"step 4 never reached the bucket:\n{open(daemon.log).read()}"
            time.sleep(0.2)
        time.sleep(1)  # an upload of step 5, were one wrongly queued, would be under way
        assert remote_steps(bucket, "picky") <= {2, 4}, open(daemon.log).read()
    finally:
        daemon.stop()


def test_a_lost_node_resumes_from_the_bucket_and_dcp_reads_it(bucket, workdir):
    import torch.distributed.checkpoint as dcp
    from ckptd.dcp import CkptdStorageReader
    from conftest import Daemon

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    os.makedirs(os.path.join(workdir, "a"))
    first = Daemon(os.path.join(workdir, "a"), ["--remote", bucket]).start()
    try:
        with CheckpointManager("remote", model, optimizer, socket=first.socket) as manager:
            model(torch.randn(5, 16)).sum().backward()
            optimizer.step()
            manager.save(3, blocking=True)
            saved = {k: v.clone() for k, v in model.state_dict().items()}
        _bucket_lists(bucket, "remote", first.log, lambda steps: 3 in steps, "step 3 never reached the bucket")
    finally:
        first.stop()
    shutil.rmtree(first.root)  # the node is lost, and its disk with it

    # A new node, an empty disk, the same --remote: the job resumes from the bucket.
    os.makedirs(os.path.join(workdir, "b"))
    second = Daemon(os.path.join(workdir, "b"), ["--remote", bucket]).start()
    try:
        torch.manual_seed(1)
        fresh = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
        with CheckpointManager("remote", fresh, torch.optim.AdamW(fresh.parameters(), lr=1e-2),
                               socket=second.socket) as manager:
            assert manager.load() == 3
            assert manager.restored["source"] == "remote"
        for k, v in fresh.state_dict().items():
            assert equal_bits(v, saved[k]), k
    finally:
        second.stop()

    # DCP reads the step straight from the bucket, no daemon.
    torch.manual_seed(2)
    other = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    state = other.state_dict()
    dcp.load(state, storage_reader=CkptdStorageReader(f"{bucket}/remote/step-00000003"))
    for k, v in state.items():
        assert equal_bits(v, saved[k]), k
    # A step that is not there is named, with the store's answer (DCP wraps the error in its
    # CheckpointException, a BaseException).
    with pytest.raises(BaseException, match="step-00000099/manifest.json: not a ckptd manifest.*404"):
        dcp.load(other.state_dict(), storage_reader=CkptdStorageReader(f"{bucket}/remote/step-00000099"))

    # And a manager of another job loads it by its URL (load(from_path=)), in its own process:
    # model, optimizer, train state; a step that is not there is named.
    torch.manual_seed(3)
    again = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    again_optimizer = torch.optim.AdamW(again.parameters(), lr=1e-2)
    with CheckpointManager("from-bucket", again, again_optimizer, socket=os.path.join(workdir, "none.sock")) as manager:
        restored = manager.load(from_path=f"{bucket}/remote/step-00000003")
        assert restored == 3 and restored.source == "path"
        with pytest.raises(CheckpointError, match=r"step-00000099'\): no manifest.json there: no committed ckptd step"):
            manager.load(from_path=f"{bucket}/remote/step-00000099")
    for k, v in again.state_dict().items():
        assert equal_bits(v, saved[k]), k
    assert all(again_optimizer.state[p]["exp_avg"].abs().sum() > 0 for p in again.parameters())


def _bucket_lists(bucket, job, log, done, what):
    """Waits (60 s at most) until `done` holds of the steps `ckptctl list` shows of `job` in
    the bucket (a list of step numbers); fails naming `what` and the daemon's log."""
    deadline = time.monotonic() + 60
    while True:
        listed = subprocess.run([CKPTCTL, "--job", job, "list", "--root", bucket], capture_output=True, text=True)
        steps = [int(row.split()[1]) for row in listed.stdout.splitlines() if row.split()[:1] == [job]]
        if listed.returncode == 0 and done(steps):
            return steps
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: the bucket lists {steps} ({listed.stderr}):\n{open(log).read()}")
        time.sleep(0.2)


def test_a_frozen_base_goes_to_the_bucket_once_and_dcp_reads_increments_through_it(bucket, workdir):
    """--increments on with the remote tier, written by ckptd itself from a PyTorch trainer: a
    frozen base (requires_grad=False) and a small trained head. After the first step each
    step uploads only what changed; --remote-keep-last 1 retires the base's step in the bucket
    (a record, its files kept); DCP reads the newest step from the bucket through the
    references, and a node that lost its disk resumes from it, bit for bit."""
    import boto3
    import torch.distributed.checkpoint as dcp
    from ckptd.dcp import CkptdStorageReader
    from conftest import Daemon

    def make(seed):
        torch.manual_seed(seed)
        m = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512),
                                torch.nn.Linear(512, 4))
        for layer in (m[0], m[2]):
            layer.requires_grad_(False)  # the frozen base: 2 MiB of the 2.01 MiB of parameters
        return m

    model = make(0)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    os.makedirs(os.path.join(workdir, "a"))
    flags = ["--remote", bucket, "--increments", "on", "--increment-chunk-bytes", "64K"]
    first = Daemon(os.path.join(workdir, "a"), flags + ["--keep-last", "1", "--remote-keep-last", "1"]).start()
    try:
        with CheckpointManager("frozen-s3", model, optimizer, socket=first.socket) as manager:
            for step in (10, 20, 30):
                model(torch.randn(5, 512)).sum().backward()
                optimizer.step()
                optimizer.zero_grad()
                manager.save(step, blocking=True)
                _bucket_lists(bucket, "frozen-s3", first.log, lambda steps: step in steps, f"step {step}")
            saved = {k: v.clone() for k, v in model.state_dict().items()}
        _bucket_lists(bucket, "frozen-s3", first.log, lambda steps: steps == [30], "--remote-keep-last 1")
    finally:
        first.stop()
    shutil.rmtree(first.root)  # the node is lost, and its disk with it

    name, prefix = bucket[len("s3://"):].split("/", 1)
    s3 = boto3.client("s3")

    def objects(step):
        listed = s3.list_objects_v2(Bucket=name, Prefix=f"{prefix}/frozen-s3/step-{step:08d}/")
        return {o["Key"].rsplit("/", 1)[1]: o["Size"] for o in listed.get("Contents", [])}

    thirty, ten = objects(30), objects(10)
    own = sum(size for key, size in thirty.items() if key.startswith("rank-"))
    base = sum(size for key, size in ten.items() if key.startswith("rank-"))
    # Step 10 is retired (a record instead of its manifest), its file kept: 30 references it.
    assert "manifest.json" not in ten and any(k.startswith("held-") for k in ten), ten
    assert base > 2 << 20 and own * 10 < base, (own, base)
    m = json.loads(s3.get_object(Bucket=name, Key=f"{prefix}/frozen-s3/step-00000030/manifest.json")["Body"].read())
    assert m["format_version"] == 5
    assert [o["step"] for o in m["increment"]["origin_steps"]] == [10]

    # DCP reads step 30 straight from the bucket, through step 10's retired files.
    other = make(2)
    state = other.state_dict()
    dcp.load(state, storage_reader=CkptdStorageReader(f"{bucket}/frozen-s3/step-00000030"))
    for k, v in state.items():
        assert equal_bits(v, saved[k]), k

    # A new node with an empty disk resumes from the bucket.
    os.makedirs(os.path.join(workdir, "b"))
    second = Daemon(os.path.join(workdir, "b"), flags).start()
    try:
        fresh = make(1)
        with CheckpointManager("frozen-s3", fresh, torch.optim.AdamW(
                [p for p in fresh.parameters() if p.requires_grad], lr=1e-2), socket=second.socket) as manager:
            assert manager.load() == 30
            assert manager.restored["source"] == "remote"
        for k, v in fresh.state_dict().items():
            assert equal_bits(v, saved[k]), k
    finally:
        second.stop()


def test_an_incremental_step_in_the_bucket_reads_through_its_references(bucket, workdir):
    """A version 5 chain of 2 ranks (written by hand: increment_chain.py) uploaded as ckptd's
    remote tier holds it: step 20's references are read from step 10's files under the same
    prefix, with ranged GETs, by ckptd.dcp and load(from_path=); a missing origin is named
    with both keys looked at."""
    import boto3
    import torch.distributed.checkpoint as dcp
    from ckptd.dcp import CkptdStorageReader
    import increment_chain as chain

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    tensors = {k: v.detach().clone() for k, v in model.state_dict().items()}
    layout = {"0.weight": [(0, (0, 0), (4, 4)), (1, (4, 0), (4, 4))], "0.bias": [(0, (0,), (8,))],
              "2.weight": [(0, (0, 0), (2, 8))], "2.bias": [(1, (0,), (2,))]}
    run = 0x18F3A9C2D4E5B6A7
    job = os.path.join(workdir, "chains", "inc-s3")
    os.makedirs(job)
    ten = chain.write_step(job, 10, run, lambda r: run + r, 2, tensors, layout, {})
    new = {k: v.clone() for k, v in tensors.items()}
    new["0.weight"][1] += 1.0
    new["0.bias"][5] += 1.0
    twenty = chain.write_step(job, 20, run, lambda r: run + 0x10 + r, 2, new, layout, {}, base=ten)
    assert any("extents" in p for t in twenty["manifest"]["tensors"].values() for p in t["shards"])
    name, prefix = bucket[len("s3://"):].split("/", 1)
    s3 = boto3.client("s3")
    for folder, _, files in os.walk(job):
        for f in files:
            s3.upload_file(os.path.join(folder, f), name, f"{prefix}/inc-s3/{os.path.relpath(os.path.join(folder, f), job)}")

    url = f"{bucket}/inc-s3/step-00000020"
    state = {k: torch.full_like(v, 7.0) for k, v in new.items()}
    dcp.load(state, storage_reader=CkptdStorageReader(url))
    for k, v in new.items():
        assert equal_bits(state[k], v), k
    torch.manual_seed(1)
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    with CheckpointManager("from-bucket-inc", fresh, socket=os.path.join(workdir, "none.sock")) as manager:
        assert manager.load(from_path=url) == 20
    for k, v in fresh.state_dict().items():
        assert equal_bits(v, new[k]), k

    s3.delete_object(Bucket=name, Key=f"{prefix}/inc-s3/step-00000010/rank-00000.{run:016x}.safetensors")
    with pytest.raises(ValueError, match=rf"step 10's file of rank 0, which this step references, is missing: "
                                         rf"neither {bucket}/inc-s3/step-00000010/rank-00000\.{run:016x}\.safetensors "
                                         rf"nor {bucket}/inc-s3/step-00000010\.held-{run:016x}/rank-00000"):
        CkptdStorageReader(url).read_metadata()

"""Files stored with a checkpoint step: save(files=), ckptctl list/verify/export, load()."""
import json
import os
import pathlib
import subprocess

import pytest
import torch

import ckptd
from ckptd.torch import CheckpointError, CheckpointManager

from conftest import CKPTCTL, ranks_in_threads, shard_path

CONFIG = "model:\n  layers: 2\nlr: 0.001\n"
VOCAB = bytes(range(256)) * 40  # binary, 10 KiB


def ctl(daemon, *args):
    return subprocess.run([CKPTCTL, "--socket", daemon.socket, *args], capture_output=True, text=True, timeout=120)


def step_dir(daemon, job, step):
    return os.path.join(daemon.root, job, f"step-{step:08d}")


def flip_byte(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))


def test_files_saved_with_a_step_are_listed_verified_restored_and_exported(daemon, workdir):
    notes = pathlib.Path(workdir, "notes.md")
    notes.write_text("# run notes\n")
    model = torch.nn.Linear(4, 3)
    with CheckpointManager("files", model, socket=daemon.socket) as manager:
        manager.save(1, blocking=True, files={"config.yaml": CONFIG, "vocab.bin": VOCAB, "notes.md": notes})
        manager.save(2, blocking=True)  # a step without files has none
    manifest = json.load(open(os.path.join(step_dir(daemon, "files", 1), "manifest.json")))
    state = manifest["shards"][0]["train_state"]
    assert {"file/config.yaml", "file/vocab.bin", "file/notes.md"} <= set(state)
    assert state["file/vocab.bin"]["checksum"].startswith("xxh3:")
    assert state["file/vocab.bin"]["data_offsets"][1] - state["file/vocab.bin"]["data_offsets"][0] == len(VOCAB)

    # Listed by name, in the table and in JSON (and by the Python listing).
    listed = ctl(daemon, "--job", "files", "list")
    assert listed.returncode == 0, listed.stderr
    row = next(line.split() for line in listed.stdout.splitlines() if line.split()[:2] == ["files", "1"])
    assert "config.yaml,notes.md,vocab.bin" in row and row[-2] == "local" and row[-1] == "full", listed.stdout
    assert next(line.split() for line in listed.stdout.splitlines() if line.split()[:2] == ["files", "2"])[-3] == "-"
    as_json = json.loads(ctl(daemon, "--job", "files", "--json", "list").stdout)
    assert [c.get("files", []) for c in as_json["checkpoints"]] == [["config.yaml", "notes.md", "vocab.bin"], []]
    assert [c["files"] for c in ckptd.list_checkpoints(daemon.socket, "files")[0]] == [
        ["config.yaml", "notes.md", "vocab.bin"], []]
    shown = ctl(daemon, "--job", "files", "show", "1")
    assert shown.returncode == 0 and '"file/config.yaml"' in shown.stdout, shown.stdout

    # Verified with the step: a damaged byte of a file is named; a file put into the step
    # directory by hand is not one of the step's and fails the verify.
    assert ctl(daemon, "--job", "files", "verify", "1").returncode == 0
    shard = shard_path(step_dir(daemon, "files", 1), 0)
    with open(shard, "rb") as f:
        data_start = 8 + int.from_bytes(f.read(8), "little")
    flip_byte(shard, data_start + state["file/config.yaml"]["data_offsets"][0] + 3)
    damaged = ctl(daemon, "--job", "files", "verify", "1")
    assert damaged.returncode == 3 and "file/config.yaml" in damaged.stdout, damaged.stdout
    flip_byte(shard, data_start + state["file/config.yaml"]["data_offsets"][0] + 3)
    assert ctl(daemon, "--job", "files", "verify", "1").returncode == 0
    dropped = os.path.join(step_dir(daemon, "files", 1), "config.yaml")
    with open(dropped, "w") as f:
        f.write("lr: 1.0\n")
    extra = ctl(daemon, "--job", "files", "verify", "1")
    assert extra.returncode == 3 and "config.yaml" in extra.stdout, extra.stdout
    os.unlink(dropped)

    # Given back by load(), from disk.
    daemon.restart()
    with CheckpointManager("files", torch.nn.Linear(4, 3), socket=daemon.socket) as manager:
        assert manager.load(step=1) == 1
        assert manager.restored_files == {"config.yaml": CONFIG.encode(), "vocab.bin": VOCAB,
                                          "notes.md": b"# run notes\n"}
        assert manager.read_file("vocab.bin") == VOCAB
        with pytest.raises(CheckpointError, match=r"no file 'tokenizer.json'.*'config.yaml', 'notes.md', 'vocab.bin'"):
            manager.read_file("tokenizer.json")
        assert manager.load(step=2) == 2 and manager.restored_files == {}

    # Exported beside the weights (hf) or the full state; --with replaces one by name.
    out = os.path.join(workdir, "hf")
    exported = subprocess.run([CKPTCTL, "export", "--root", daemon.root, "--job", "files", "1", out],
                              capture_output=True, text=True, timeout=120)
    assert exported.returncode == 0, exported.stderr
    assert open(os.path.join(out, "config.yaml"), "rb").read() == CONFIG.encode()
    assert open(os.path.join(out, "vocab.bin"), "rb").read() == VOCAB
    assert os.path.exists(os.path.join(out, "model.safetensors.index.json"))
    other = os.path.join(workdir, "config.yaml")
    with open(other, "w") as f:
        f.write("lr: 0.5\n")
    full = os.path.join(workdir, "full")
    exported = subprocess.run([CKPTCTL, "export", "--root", daemon.root, "--job", "files", "1", full,
                               "--format", "full", "--with", other], capture_output=True, text=True, timeout=120)
    assert exported.returncode == 0, exported.stderr
    assert "replaced the file config.yaml stored with the step" in exported.stdout
    assert open(os.path.join(full, "config.yaml")).read() == "lr: 0.5\n"
    assert open(os.path.join(full, "notes.md")).read() == "# run notes\n"


def test_each_rank_gets_its_own_files_back_and_the_export_says_when_they_differ(daemon, workdir):
    def save(r):
        with CheckpointManager("ranks", torch.nn.Linear(2, 2), socket=daemon.socket, rank=r,
                               world_size=2) as manager:
            manager.save(5, blocking=True, files={"shared.txt": "same", "mine.txt": f"rank {r}"})

    assert ranks_in_threads(save, 2) == []
    restored = {}

    def load(r):
        with CheckpointManager("ranks", torch.nn.Linear(2, 2), socket=daemon.socket, rank=r,
                               world_size=3) as manager:
            assert manager.load() == 5
            restored[r] = manager.restored_files

    assert ranks_in_threads(load, 3) == []
    # Each rank its own; rank 2, which the step was not saved with, rank 0's.
    assert restored == {0: {"shared.txt": b"same", "mine.txt": b"rank 0"},
                        1: {"shared.txt": b"same", "mine.txt": b"rank 1"},
                        2: {"shared.txt": b"same", "mine.txt": b"rank 0"}}
    out = os.path.join(workdir, "out")
    exported = subprocess.run([CKPTCTL, "export", "--root", daemon.root, "--job", "ranks", "5", out],
                              capture_output=True, text=True, timeout=120)
    assert exported.returncode == 0, exported.stderr
    assert open(os.path.join(out, "mine.txt")).read() == "rank 0"
    assert "ranks 0,1 store different files named mine.txt: rank 0's is written" in exported.stdout
    assert "shared.txt" not in exported.stdout.split("\n", 1)[1]


def test_files_are_refused_with_a_clear_error_when_misnamed_or_too_large(daemon):
    model = torch.nn.Linear(2, 2)
    with CheckpointManager("limits", model, socket=daemon.socket) as manager:
        with pytest.raises(ValueError, match=r"name '\.\./etc/passwd' is not allowed"):
            manager.save(1, files={"../etc/passwd": b"x"})
        with pytest.raises(ValueError, match=r"more than 16 MiB in all \(at 'b.bin'\)"):
            manager.save(1, files={"a.bin": bytes(10 << 20), "b.bin": bytes(7 << 20)})
        with pytest.raises(TypeError, match=r"files\['n.txt'\] is a int"):
            manager.save(1, files={"n.txt": 3})
        with pytest.raises(TypeError, match="files is a dict"):
            manager.save(1, files=[("a", b"")])
        assert manager.save(1, blocking=True, files={"ok.txt": b"fine"})
    # ckptd refuses the same from any client (a C++ trainer, this one bypassing the manager),
    # naming what is wrong; nothing is committed.
    client = ckptd.connect(daemon.socket, "raw", rank=0, world_size=1)
    client.allocate("w", "F32", [2])
    client.register()
    for train_state, why in (({"file/.hidden": b"x"}, 'file name ".hidden" is not allowed'),
                             ({"file/big.bin": bytes(17 << 20)}, "a rank may store 16 MiB at most")):
        try:
            status = client.wait_committed(client.snapshot(7, {}, train_state), timeout=60)
        except ckptd.Error as e:  # refused at the call
            status = {"state": "rejected", "error": str(e)}
        assert status["state"] in ("rejected", "failed") and why in status["error"], status
    client.unregister()
    assert daemon.steps("raw") == []

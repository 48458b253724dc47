"""Frozen parameters (issue 48, item 2): a parameter with requires_grad=False is registered
frozen, copied by ckptd once and then taken from ckptd's own copy (the metric counts the bytes
not copied); unfreezing it makes the very next save copy it; what is restored is the trainer's
state exactly. Real ckptd, real PyTorch."""
import json
import os
import re
import urllib.request

import torch

from ckptd.torch import CheckpointManager
from conftest import same, start_with_metrics as start


def frozen_skipped(daemon):
    """ckptd_frozen_skipped_bytes_total, from the exposition (Debian's Python has no
    prometheus_client: test_metrics.py parses it with the stock parser)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{daemon.metrics_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return float(re.search(r"^ckptd_frozen_skipped_bytes_total (\S+)$", text, re.M).group(1))


def lora_like():
    """A frozen base layer and a trained head."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 4))
    model[0].requires_grad_(False)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.01)
    return model, optimizer


def train(model, optimizer):
    loss = model(torch.randn(8, 256)).square().mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def test_parameters_that_do_not_train_are_copied_once(workdir):
    daemon = start(workdir, "--increments", "on", "--increment-chunk-bytes", "64K", "--frozen-check-every", "0")
    base_bytes = (256 * 256 + 256) * 4
    try:
        model, optimizer = lora_like()
        with CheckpointManager("lora", model, optimizer, socket=daemon.socket) as manager:
            for step in (1, 2, 3, 4):
                train(model, optimizer)
                assert manager.save(step, blocking=True)
            assert frozen_skipped(daemon) == 3 * base_bytes  # all but the first save
            # Unfrozen, and changed: this very save copies it (a fill would save old bytes).
            model[0].requires_grad_(True)
            with torch.no_grad():
                model[0].weight.add_(1.0)
            assert manager.save(5, blocking=True)
            assert frozen_skipped(daemon) == 3 * base_bytes
            # Frozen again: copied once more, then taken from ckptd's copy.
            model[0].requires_grad_(False)
            for step in (6, 7):
                assert manager.save(step, blocking=True)
            assert frozen_skipped(daemon) == 4 * base_bytes
            saved = {k: v.clone() for k, v in model.state_dict().items()}
        fresh, fresh_optimizer = lora_like()
        with CheckpointManager("lora", fresh, fresh_optimizer, socket=daemon.socket) as manager:
            assert manager.load() == 7
        assert same(fresh.state_dict(), saved)
        daemon.restart()
        fresh, fresh_optimizer = lora_like()
        with CheckpointManager("lora", fresh, fresh_optimizer, socket=daemon.socket) as manager:
            assert manager.load(5) == 5
        assert torch.equal(fresh[0].weight, saved["0.weight"])  # the change saved at step 5
    finally:
        daemon.stop()


def test_a_full_save_references_nothing(workdir):
    daemon = start(workdir, "--increments", "on", "--increment-chunk-bytes", "64K")
    try:
        model, optimizer = lora_like()
        with CheckpointManager("lora", model, optimizer, socket=daemon.socket) as manager:
            for step in (1, 2):
                train(model, optimizer)
                assert manager.save(step, blocking=True)
            train(model, optimizer)
            assert manager.save(3, blocking=True, full=True)
            train(model, optimizer)
            assert manager.save(4, blocking=True)
        increments = {}
        for step in (2, 3, 4):
            with open(os.path.join(daemon.root, "lora", f"step-{step:08d}", "manifest.json")) as f:
                increments[step] = json.load(f)["increment"]
        assert increments[2]["referenced_bytes"] > 0
        assert increments[3]["referenced_bytes"] == 0 and increments[3]["origin_steps"] == []
        assert [s["step"] for s in increments[4]["origin_steps"]] == [3]  # what the full save wrote
    finally:
        daemon.stop()


def test_a_sparse_embedding_saves_the_rows_that_changed(workdir):
    """nn.Embedding(sparse=True) with SparseAdam, 1% of its 2048 rows (16 KiB each) touched
    per step: with --increments on the table and its moments are compared in small chunks
    (registered sparse), so a step writes a few percent of them instead of all."""
    daemon = start(workdir, "--increments", "on")  # the default 4 MiB chunks: 256 rows each
    try:
        torch.manual_seed(0)
        table = torch.nn.Embedding(2048, 4096, sparse=True)
        optimizer = torch.optim.SparseAdam(table.parameters(), lr=0.01)

        def step():
            table(torch.randint(0, 2048, (20,))).sum().backward()
            optimizer.step()
            optimizer.zero_grad()

        with CheckpointManager("emb", table, optimizer, socket=daemon.socket) as manager:
            for i in (1, 2, 3, 4):
                step()
                assert manager.save(i, blocking=True)
            saved = {k: v.clone() for k, v in table.state_dict().items()}
            saved_optimizer = optimizer.state_dict()
        state_bytes = 3 * 2048 * 4096 * 4  # the weight and SparseAdam's two moments
        for i in (3, 4):  # the first two saves: no base, then most of the moments appear
            with open(os.path.join(daemon.root, "emb", f"step-{i:08d}", "manifest.json")) as f:
                own = json.load(f)["increment"]["own_bytes"]
            assert own < state_bytes * 6 // 100, (i, own)
        fresh = torch.nn.Embedding(2048, 4096, sparse=True)
        fresh_optimizer = torch.optim.SparseAdam(fresh.parameters(), lr=0.01)
        with CheckpointManager("emb", fresh, fresh_optimizer, socket=daemon.socket) as manager:
            assert manager.load() == 4
        assert same(fresh.state_dict(), saved)
        assert same(fresh_optimizer.state_dict()["state"], saved_optimizer["state"])
    finally:
        daemon.stop()


def test_a_frozen_parameter_written_between_saves_is_saved_as_written(workdir):
    """What a frozen parameter holds at a save is what the step holds, however it changed
    since the last save: thawed, trained and frozen again; written in place (an EMA update,
    load_state_dict); loaded from another source into the registered memory."""
    daemon = start(workdir, "--increments", "on", "--increment-chunk-bytes", "64K", "--frozen-check-every", "0")
    try:
        model, optimizer = lora_like()
        train(model, optimizer)  # the optimizer's state exists, as a load wants it
        with CheckpointManager("lora", model, optimizer, socket=daemon.socket) as manager:
            assert manager.save(1, blocking=True)
            assert manager.save(2, blocking=True)  # the base taken from ckptd's copy
            # Thawed, changed and frozen again with no save between: the set of frozen
            # parameters is the same at the next save, the bytes are not.
            model[0].requires_grad_(True)
            with torch.no_grad():
                model[0].weight.add_(1.0)
            model[0].requires_grad_(False)
            assert manager.save(3, blocking=True)
            at3 = model[0].weight.clone()
            # Written in place while frozen (an EMA teacher's update).
            with torch.no_grad():
                model[0].weight.mul_(0.5)
            assert manager.save(4, blocking=True)
            at4 = model[0].weight.clone()
            # Loaded from a step's files straight into the registered memory.
            manager.load(from_path=os.path.join(daemon.root, "lora", f"step-{3:08d}"))
            assert torch.equal(model[0].weight, at3)
            assert manager.save(5, blocking=True)
        for step, expected in ((3, at3), (4, at4), (5, at3)):
            fresh, fresh_optimizer = lora_like()
            with CheckpointManager("lora", fresh, fresh_optimizer, socket=daemon.socket) as manager:
                assert manager.load(step) == step
            assert torch.equal(fresh[0].weight, expected), step
    finally:
        daemon.stop()


def test_frozen_false_copies_every_tensor_at_every_save(workdir):
    daemon = start(workdir)
    try:
        model, optimizer = lora_like()
        with CheckpointManager("lora", model, optimizer, socket=daemon.socket, frozen=False) as manager:
            for step in (1, 2, 3):
                assert manager.save(step, blocking=True)
        assert frozen_skipped(daemon) == 0
    finally:
        daemon.stop()

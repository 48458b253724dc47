"""ckptd.lightning.CkptdCheckpointIO: Lightning's own loop checkpointing through a real ckptd.

The end-to-end tests run tests/lightning_worker.py (Trainer.fit with ModelCheckpoint) in
subprocesses: a run killed with SIGKILL resumes with `ckpt_path="last"` (or a named file)
and gives the uninterrupted run's losses and final weights bit for bit. The others call the
plugin directly with the dicts Lightning hands it.
"""
import collections
import json
import os
import subprocess
import sys
import time

import pytest
import torch

pytest.importorskip("lightning")

from ckptd.lightning import CheckpointError, CkptdCheckpointIO  # noqa: E402

from conftest import PYTHONPATH, kill_after_commit, last_line, losses  # noqa: E402

WORKER = "client/python/tests/lightning_worker.py"


def start(daemon, job, *args):
    return subprocess.Popen(
        [sys.executable, WORKER, "--socket", daemon.socket, "--job", job,
         "--dir", os.path.join(daemon.workdir, job), *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=dict(os.environ, PYTHONPATH=PYTHONPATH))


def finish(process, stderr=None):
    out, err = process.communicate(timeout=120)
    assert process.returncode == 0, err[-3000:]
    if stderr is not None:
        stderr.append(err)
    return out


def test_sigkill_and_fit_from_last_gives_the_uninterrupted_run(daemon):
    """Trainer.fit(ckpt_path="last") after kill -9: the loss of every step and the final
    weights and optimizer state are the uninterrupted run's, mid-epoch resume included (the
    loop state, the resumable loader's position, the LR scheduler and the RNG all come back)."""
    common = ["--steps", "20", "--every", "5"]
    reference = finish(start(daemon, "reference", *common))
    expected = losses(reference)
    assert sorted(expected) == list(range(1, 21))

    before = losses(kill_after_commit(daemon, "resumed", start(daemon, "resumed", *common, "--delay", "0.15"), 13))
    out = finish(start(daemon, "resumed", *common, "--ckpt-path", "last"))
    restored = int(last_line(out, "resumed").split()[2])
    assert restored in (5, 10)  # the newest committed step (10 may still be in flight at the kill)
    after = losses(out)
    assert sorted(after) == list(range(restored + 1, 21))
    for step, loss in {**before, **after}.items():
        assert loss == expected[step], f"step {step}: {loss} != {expected[step]}"
    assert last_line(out, "weights") == last_line(reference, "weights")
    assert daemon.steps("resumed")[-1] == 20
    # ModelCheckpoint's files name ckptd steps; the data is ckptd's, not Lightning's.
    folder = os.path.join(daemon.workdir, "resumed")
    assert sorted(os.listdir(folder)) == ["epoch=0-step=5.ckpt", "epoch=1-step=10.ckpt",
                                          "epoch=2-step=15.ckpt", "epoch=3-step=20.ckpt", "last.ckpt"]
    with open(os.path.join(folder, "last.ckpt")) as f:
        assert json.load(f) == {"kind": "ckptd-lightning", "version": 1, "job": "resumed", "step": 20}


def test_fit_from_a_named_checkpoint_file(daemon):
    """ckpt_path naming one of ModelCheckpoint's files resumes that step, bit-exact: here step
    5, in the middle of the first epoch, from disk after a daemon restart."""
    common = ["--steps", "12", "--every", "5"]
    reference = finish(start(daemon, "first", *common))
    daemon.restart()  # ckptd's memory is gone: the restore reads the step's files
    path = os.path.join(daemon.workdir, "first", "epoch=0-step=5.ckpt")
    err = []
    out = finish(start(daemon, "first", *common, "--ckpt-path", path), err)
    assert last_line(out, "resumed") == "from step 5 (disk)"
    # The job holds steps 10 and 12 already: ckptd keeps one checkpoint per step, and the
    # plugin says why it does not save them again (their files still name the first run's).
    assert "already holds step 10, from an earlier run" in err[0], err[0][-3000:]
    assert daemon.steps("first") == [5, 10]
    expected = losses(reference)
    after = losses(out)
    assert sorted(after) == list(range(6, 13))
    assert all(after[s] == expected[s] for s in after)
    assert last_line(out, "weights") == last_line(reference, "weights")


# --- the plugin on its own, with the dicts Lightning hands it -----------------------------

Pair = collections.namedtuple("Pair", "left right")


def lightning_like(step, scale=1.0):
    model = collections.OrderedDict(
        [("layer.weight", torch.arange(6, dtype=torch.float32).view(2, 3) * scale),
         ("layer.bias", torch.ones(2, dtype=torch.bfloat16)),
         ("bn.num_batches_tracked", torch.tensor(7))])
    model._metadata = collections.OrderedDict([("layer", {"version": 1})])
    return {
        "epoch": 1, "global_step": step, "pytorch-lightning_version": "2.6.6",
        "state_dict": model,
        "optimizer_states": [{"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.full((2, 3), scale)}},
                              "param_groups": [{"lr": 0.01, "params": [0, 1]}]}],
        "lr_schedulers": [{"last_epoch": 3, "_last_lr": [0.01]}],
        "loops": {"fit_loop": {"epoch_progress": {"total": {"completed": 1}}}},
        "callbacks": {"ModelCheckpoint{'monitor': None, \"x\": 1}": {"best_model_score": torch.tensor(0.5),
                                                                     "dirpath": "/tmp/x"}},
        "hyper_parameters": {"hidden": 32, "name": "tiny"},
        "extra": (torch.zeros(3, dtype=torch.int32), (torch.ones(1), "text")),
        "complex": torch.ones(2, dtype=torch.complex64),  # a dtype ckptd does not store: pickled
        "empty": torch.zeros(0),
    }


def assert_same(a, b):
    assert type(a) is type(b), (type(a), type(b))
    if torch.is_tensor(a):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b


def test_load_returns_the_saved_dict(daemon, tmp_path):
    plugin = CkptdCheckpointIO("dict", socket=daemon.socket)
    saved = lightning_like(4)
    plugin.save_checkpoint(saved, tmp_path / "a.ckpt")
    plugin.teardown()  # waits until committed and leaves ckptd
    assert daemon.steps("dict") == [4]

    loaded = CkptdCheckpointIO("dict", socket=daemon.socket).load_checkpoint(tmp_path / "a.ckpt")
    assert_same(loaded, saved)
    assert loaded["state_dict"]._metadata == saved["state_dict"]._metadata
    # The tensors are the caller's own (not shared memory a later save overwrites).
    assert not any(t.data_ptr() == u.data_ptr() for t in loaded["state_dict"].values()
                   for u in saved["state_dict"].values())


def test_weights_only_is_torch_loads_as_for_lightnings_files(daemon, tmp_path):
    """The dict's non-tensor part is read with torch.load(weights_only=...) as Lightning reads
    its own files: a class of the user's (here a namedtuple) needs weights_only=False."""
    plugin = CkptdCheckpointIO("classes", socket=daemon.socket)
    saved = dict(lightning_like(2), extra=Pair(torch.zeros(3, dtype=torch.int32), (torch.ones(1), "text")))
    plugin.save_checkpoint(saved, tmp_path / "a.ckpt")
    plugin.teardown()
    reader = CkptdCheckpointIO("classes", socket=daemon.socket)
    with pytest.raises(Exception, match="Weights only load failed"):
        reader.load_checkpoint(tmp_path / "a.ckpt")
    assert_same(reader.load_checkpoint(tmp_path / "a.ckpt", weights_only=False), saved)


def test_tensor_names_in_ckptd(daemon, tmp_path):
    """Model weights under their state-dict keys (ckptctl export writes them out), the
    optimizer state under optim.*, the rest under lightning.*; names ckptd refuses are made
    valid."""
    plugin = CkptdCheckpointIO("names", socket=daemon.socket)
    plugin.save_checkpoint(lightning_like(1), tmp_path / "a.ckpt")
    plugin.teardown()
    with open(os.path.join(daemon.root, "names", "step-00000001", "manifest.json")) as f:
        names = set(json.load(f)["tensors"])
    assert {"layer.weight", "layer.bias", "bn.num_batches_tracked", "optim.0.state.0.step",
            "optim.0.state.0.exp_avg", "lightning.extra.0", "lightning.extra.1.0",
            "lightning.format"} <= names
    assert "lightning.callbacks.ModelCheckpoint{'monitor': None, _x_: 1}.best_model_score" in names


def test_a_second_file_of_the_same_step_names_it_and_other_values_are_refused(daemon, tmp_path):
    """ModelCheckpoint saves last.ckpt right after the top-k file, at the same global step."""
    plugin = CkptdCheckpointIO("same", socket=daemon.socket)
    plugin.save_checkpoint(lightning_like(5), tmp_path / "epoch=0-step=5.ckpt")
    plugin.save_checkpoint(lightning_like(5), tmp_path / "last.ckpt")
    with pytest.warns(RuntimeWarning, match="step 5 is not after step 5"):
        plugin.save_checkpoint(lightning_like(5, scale=2.0), tmp_path / "other.ckpt")
    plugin.save_checkpoint(lightning_like(6), tmp_path / "last.ckpt")
    plugin.teardown()
    assert daemon.steps("same") == [5, 6]
    assert not (tmp_path / "other.ckpt").exists()
    reader = CkptdCheckpointIO("same", socket=daemon.socket)
    assert reader.load_checkpoint(tmp_path / "epoch=0-step=5.ckpt")["global_step"] == 5
    assert reader.load_checkpoint(tmp_path / "last.ckpt")["global_step"] == 6
    reader.teardown()


def test_a_step_ckptd_fails_takes_its_file_with_it(daemon, tmp_path):
    """A snapshot ckptd refuses after save_checkpoint returned (here: a step the job already
    holds, which the plugin did not know of): its file goes, with a warning, at the next save
    or at the end of fit."""
    first = CkptdCheckpointIO("fails", socket=daemon.socket)
    first.save_checkpoint(lightning_like(3), tmp_path / "a.ckpt")
    first.teardown()
    second = CkptdCheckpointIO("fails", socket=daemon.socket)
    with pytest.warns(UserWarning, match="already holds committed steps 3"):
        second.save_checkpoint(lightning_like(1), tmp_path / "b.ckpt")
    second._held = set()  # as if step 3 were older than the 16 steps ckptd lists
    second.save_checkpoint(lightning_like(3, scale=3.0), tmp_path / "c.ckpt")
    assert (tmp_path / "c.ckpt").exists()
    with pytest.warns(RuntimeWarning, match="step 3 failed: .*already committed.*c.ckpt"):
        second.teardown()
    assert not (tmp_path / "c.ckpt").exists()
    assert (tmp_path / "a.ckpt").exists() and (tmp_path / "b.ckpt").exists()


def test_remove_checkpoint_deletes_the_file_and_ckptd_keeps_the_step(daemon, tmp_path):
    plugin = CkptdCheckpointIO("remove", socket=daemon.socket)
    plugin.save_checkpoint(lightning_like(3), tmp_path / "a.ckpt")
    plugin.remove_checkpoint(tmp_path / "a.ckpt")
    plugin.teardown()
    assert not (tmp_path / "a.ckpt").exists()
    assert daemon.steps("remove") == [3]


def test_keep_last_is_ckptds_retention(daemon, tmp_path):
    plugin = CkptdCheckpointIO("keep", socket=daemon.socket, keep_last=2)
    for step in (1, 2, 3):
        plugin.save_checkpoint(lightning_like(step), tmp_path / f"s{step}.ckpt")
    plugin.teardown()
    deadline = time.monotonic() + 10
    while daemon.steps("keep") != [2, 3] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert daemon.steps("keep") == [2, 3]
    with pytest.raises(CheckpointError, match="has no step 1.*retention"):
        CkptdCheckpointIO("keep", socket=daemon.socket).load_checkpoint(tmp_path / "s1.ckpt")


def test_a_step_that_never_committed_loads_the_newest_before_it(daemon, tmp_path):
    """The trainer was killed between writing last.ckpt and ckptd's copy of that step."""
    plugin = CkptdCheckpointIO("lost", socket=daemon.socket)
    plugin.save_checkpoint(lightning_like(10), tmp_path / "last.ckpt")
    plugin.teardown()
    (tmp_path / "last.ckpt").write_text(json.dumps({"kind": "ckptd-lightning", "version": 1,
                                                    "job": "lost", "step": 20}))
    reader = CkptdCheckpointIO("lost", socket=daemon.socket)
    with pytest.warns(UserWarning, match="names step 20 .* never committed.*loading step 10"):
        assert reader.load_checkpoint(tmp_path / "last.ckpt")["global_step"] == 10
    assert reader.restored["step"] == 10


def test_a_file_of_another_job_is_refused(daemon, tmp_path):
    plugin = CkptdCheckpointIO("one", socket=daemon.socket)
    plugin.save_checkpoint(lightning_like(1), tmp_path / "a.ckpt")
    plugin.teardown()
    with pytest.raises(CheckpointError, match="job 'one'.*pass job='one'"):
        CkptdCheckpointIO("two", socket=daemon.socket).load_checkpoint(tmp_path / "a.ckpt")


def test_lightnings_own_files_still_load(daemon, tmp_path):
    """A run switches to ckptd by resuming once from its last torch.save file."""
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
    saved = lightning_like(7)
    TorchCheckpointIO().save_checkpoint(saved, tmp_path / "old.ckpt")
    loaded = CkptdCheckpointIO("switch", socket=daemon.socket).load_checkpoint(tmp_path / "old.ckpt")
    assert_same(loaded, saved)


def test_without_ckptd_a_save_warns_and_training_goes_on(workdir, tmp_path):
    plugin = CkptdCheckpointIO("absent", socket=os.path.join(workdir, "nobody.sock"), daemon_timeout=0.2)
    with pytest.warns(RuntimeWarning, match="ckptd unavailable"):
        plugin.save_checkpoint(lightning_like(1), tmp_path / "a.ckpt")
    assert not (tmp_path / "a.ckpt").exists()
    (tmp_path / "b.ckpt").write_text(json.dumps({"kind": "ckptd-lightning", "version": 1,
                                                 "job": "absent", "step": 1}))
    with pytest.raises(CheckpointError, match="not reachable"):
        plugin.load_checkpoint(tmp_path / "b.ckpt")

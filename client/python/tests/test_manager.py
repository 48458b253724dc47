"""ckptd.torch.CheckpointManager against a real ckptd, with Debian's PyTorch (CPU)."""
import copy
import glob
import json
import math
import re
import os
import signal
import socket
import subprocess
import threading
import time
import warnings

import pytest
import torch

import ckptd
from ckptd.torch import CheckpointError, CheckpointManager

from conftest import Daemon, free_port, losses, run_example, shard_path


def make_training(seed=0, hidden=16):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, hidden), torch.nn.BatchNorm1d(hidden),
                                torch.nn.ReLU(), torch.nn.Linear(hidden, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    return model, optimizer, scheduler


def train_step(model, optimizer, scheduler):
    x = torch.randn(16, 8)
    loss = model(x).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    scheduler.step()
    return loss.item()


def clone_state(model, optimizer, scheduler):
    return copy.deepcopy((model.state_dict(), optimizer.state_dict(), scheduler.state_dict()))


def assert_same(a, b):
    if torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b


def load_file(path):
    """A safetensors file's tensors (the format is a JSON header and raw bytes)."""
    dtypes = {"F32": torch.float32, "BF16": torch.bfloat16, "I64": torch.int64, "U8": torch.uint8}
    with open(path, "rb") as f:
        data = f.read()
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + size])
    body = bytearray(data[8 + size:])
    out = {}
    for name, info in header.items():
        if name == "__metadata__" or info["dtype"] not in dtypes:
            continue
        lo, hi = info["data_offsets"]
        out[name] = torch.frombuffer(body[lo:hi], dtype=dtypes[info["dtype"]]).view(info["shape"])
    return out


def is_shared_memory(address):
    """Whether `address` lies in one of ckptd's shared-memory arenas in this process."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            span, *_, path = line.split(maxsplit=5) + [""]
            lo, hi = (int(x, 16) for x in span.split("-"))
            if lo <= address < hi:
                return "/memfd:ckpt-arena." in line  # a sealed memfd (shm/arena.h)
    return False


# --- the scenarios ---------------------------------------------------------------

def run_to_end(*args):
    """Runs the example trainer to its end; returns its stdout."""
    trainer = run_example(*args)
    out, err = trainer.communicate(timeout=300)
    assert trainer.returncode == 0, err
    return out


def signal_at(trainer, step, sig):
    """Sends `sig` once the trainer prints `step`; returns the lines it printed."""
    seen = []
    for line in trainer.stdout:
        seen.append(line)
        if line.startswith(f"step {step} "):
            trainer.send_signal(sig)
            break
    seen.extend(trainer.stdout)  # what it printed before the signal took effect
    trainer.wait(timeout=60)
    assert trainer.returncode == -sig
    return "".join(seen)


def test_sigkill_and_resume_gives_the_uninterrupted_loss_trajectory(daemon):
    common = ["--socket", daemon.socket, "--steps", "40", "--save-every", "10"]
    expected = losses(run_to_end(*common, "--job", "reference"))
    assert sorted(expected) == list(range(1, 41))

    before = losses(signal_at(run_example(*common, "--job", "resumed"), 25, signal.SIGKILL))

    out = run_to_end(*common, "--job", "resumed", "--resume")
    first = out.splitlines()[0]
    assert first.startswith("resumed from step "), out
    restored = int(first.split()[-1])
    assert restored in (10, 20)  # step 20 may still be in flight when the trainer dies
    after = losses(out)
    assert sorted(after) == list(range(restored + 1, 41))
    for step, loss in {**before, **after}.items():
        assert loss == expected[step], f"step {step}: {loss} != {expected[step]}"
    assert daemon.steps("resumed")[-1] == 40


def test_sigterm_saves_the_current_step_and_resume_continues_the_trajectory(daemon):
    """Preemption: no periodic checkpoint at all, only the one SIGTERM takes."""
    common = ["--socket", daemon.socket, "--steps", "60", "--save-every", "1000"]
    expected = losses(run_to_end(*common, "--job", "reference"))

    seen = signal_at(run_example(*common, "--job", "preempted", "--save-on-sigterm"), 20,
                     signal.SIGTERM)  # the default action still ends it
    last = max(losses(seen))
    deadline = time.monotonic() + 30  # ckptd commits after the trainer is gone
    while daemon.steps("preempted") != [last] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert daemon.steps("preempted") == [last]

    out = run_to_end(*common, "--job", "preempted", "--resume")
    assert out.splitlines()[0] == f"resumed from step {last}"
    after = losses(out)
    assert sorted(after) == list(range(last + 1, 61))
    for step, loss in after.items():
        assert loss == expected[step], f"step {step}: {loss} != {expected[step]}"


def test_the_environment_turns_on_the_sigterm_save_as_the_kubernetes_manifests_do(daemon):
    """CKPTD_SAVE_ON_SIGTERM=1 (deploy/kubernetes sets it on every trainer) takes the SIGTERM
    save without the trainer's code asking for it; a value that is no yes or no is an error."""
    common = ["--socket", daemon.socket, "--steps", "60", "--save-every", "1000"]
    seen = signal_at(run_example(*common, "--job", "by-env", env={"CKPTD_SAVE_ON_SIGTERM": "1"}), 10,
                     signal.SIGTERM)
    last = max(losses(seen))
    deadline = time.monotonic() + 30
    while daemon.steps("by-env") != [last] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert daemon.steps("by-env") == [last]
    # Without it (or with 0) a SIGTERM takes no checkpoint: this run never saves otherwise.
    signal_at(run_example(*common, "--job", "no-env", env={"CKPTD_SAVE_ON_SIGTERM": "0"}), 10, signal.SIGTERM)
    time.sleep(1)
    assert daemon.steps("no-env") == []
    bad = run_example(*common, "--job", "bad-env", env={"CKPTD_SAVE_ON_SIGTERM": "maybe"})
    _, err = bad.communicate(timeout=120)
    assert bad.returncode != 0 and "$CKPTD_SAVE_ON_SIGTERM is 'maybe'" in err


@pytest.mark.parametrize("source", ["memory", "disk"])
def test_load_into_a_freshly_built_model_and_optimizer(daemon, source):
    model, optimizer, scheduler = make_training(seed=1)
    sampler = torch.Generator().manual_seed(7)
    with CheckpointManager("fresh", model, optimizer, scheduler, extra_state={"sampler": _Sampler(sampler)},
                           socket=daemon.socket) as manager:
        for step in range(1, 6):
            train_step(model, optimizer, scheduler)
        assert manager.save(5, blocking=True)
        saved = clone_state(model, optimizer, scheduler)
        rng = torch.get_rng_state()
        sampler_state = sampler.get_state()
        step6 = train_step(model, optimizer, scheduler)  # moves on after the checkpoint
    if source == "disk":
        daemon.restart()

    model2, optimizer2, scheduler2 = make_training(seed=2)  # different initial values
    sampler2 = torch.Generator().manual_seed(99)
    torch.manual_seed(1234)
    with CheckpointManager("fresh", model2, optimizer2, scheduler2, extra_state={"sampler": _Sampler(sampler2)},
                           socket=daemon.socket) as manager:
        assert manager.load() == 5
        assert_same(clone_state(model2, optimizer2, scheduler2), saved)
        assert torch.equal(torch.get_rng_state(), rng)
        assert torch.equal(sampler2.get_state(), sampler_state)
        # Training goes on from there exactly as the original did.
        assert train_step(model2, optimizer2, scheduler2) == step6


class _Sampler:
    """Anything with state_dict()/load_state_dict() can ride along as extra state."""

    def __init__(self, generator):
        self.generator = generator

    def state_dict(self):
        return {"rng": self.generator.get_state()}

    def load_state_dict(self, state):
        self.generator.set_state(state["rng"])


def test_a_key_mismatch_names_the_keys(daemon):
    model, optimizer, _ = make_training()
    with CheckpointManager("keys", model, optimizer, socket=daemon.socket) as manager:
        train_step(model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0))
        manager.save(1, blocking=True)
    other = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                                torch.nn.Linear(16, 2), torch.nn.Linear(2, 2))
    with CheckpointManager("keys", other, torch.optim.Adam(other.parameters()), socket=daemon.socket) as manager:
        with pytest.raises(CheckpointError) as error:
            manager.load()
    message = str(error.value)
    assert "registered but not in the checkpoint" in message
    assert "4.weight" in message


def test_a_shape_mismatch_names_the_tensor_and_both_shapes(daemon):
    model, optimizer, scheduler = make_training(hidden=16)
    with CheckpointManager("shapes", model, optimizer, scheduler, socket=daemon.socket) as manager:
        train_step(model, optimizer, scheduler)
        manager.save(1, blocking=True)
    model2, optimizer2, scheduler2 = make_training(hidden=32)
    before = clone_state(model2, optimizer2, scheduler2)[0]
    with CheckpointManager("shapes", model2, optimizer2, scheduler2, socket=daemon.socket) as manager:
        with pytest.raises(CheckpointError, match=r"0\.weight: global shape \[16, 8\] saved, "
                                                  r"\[32, 8\] wanted"):
            manager.load()
    assert_same(model2.state_dict(), before)  # nothing half-restored
    assert not optimizer2.state  # the state created for the attempt is gone again


def test_two_ranks_on_one_node(daemon):
    common = ["--socket", daemon.socket, "--steps", "10", "--save-every", "5", "--job", "pair"]
    ranks = [run_example(*common, "--seed", str(r), env={"RANK": str(r), "WORLD_SIZE": "2"})
             for r in range(2)]
    outs = [p.communicate(timeout=300) for p in ranks]
    for p, (out, err) in zip(ranks, outs):
        assert p.returncode == 0, err
    assert daemon.steps("pair") == [5, 10]
    step_dir = os.path.join(daemon.root, "pair", "step-00000010")
    shards = sorted(os.listdir(step_dir))
    assert shards == sorted(["manifest.json"] + [os.path.basename(shard_path(step_dir, r)) for r in range(2)])
    assert shards[1].startswith("rank-00000.") and shards[2].startswith("rank-00001."), shards
    # Each rank gets its own state back.
    more = ["--socket", daemon.socket, "--steps", "12", "--save-every", "5", "--job", "pair", "--resume"]
    again = [run_example(*more, "--seed", str(r), env={"RANK": str(r), "WORLD_SIZE": "2"}) for r in range(2)]
    for r, p in enumerate(again):
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
        assert out.splitlines()[0] == "resumed from step 10"
        reference = losses(outs[r][0])
        assert losses(out).keys() == {11, 12}
        assert reference[10] != losses(outs[1 - r][0])[10]  # the ranks really differ


def test_training_continues_without_a_daemon(workdir):
    model, optimizer, scheduler = make_training()
    torch.manual_seed(5)
    plain = [train_step(model, optimizer, scheduler) for _ in range(6)]

    model, optimizer, scheduler = make_training()
    torch.manual_seed(5)
    with pytest.warns(RuntimeWarning, match="ckptd unavailable.*training continues") as warned:
        with CheckpointManager("absent", model, optimizer, scheduler,
                               socket=os.path.join(workdir, "nobody.sock"), interval_steps=2) as manager:
            # Never "nothing to restore" while ckptd is away: a checkpoint may exist. Nor a
            # wait: no ckptd is there or starting (test_daemon_wait.py).
            started = time.monotonic()
            with pytest.raises(CheckpointError, match=r"ckptd is not reachable at .*nobody.sock: there is no socket"):
                manager.load()
            assert time.monotonic() - started < 5
            observed = []
            for step in range(1, 7):
                observed.append(train_step(model, optimizer, scheduler))
                assert manager.maybe_save(step) is False
            assert manager.wait() is None
            with pytest.raises(CheckpointError, match="not reachable"):
                manager.save(7, blocking=True)
    assert observed == plain
    # The warning points at the user's line (here, this test), not inside the manager.
    assert {os.path.basename(w.filename) for w in warned} == {"test_manager.py"}


class _Evil:
    """A pickle that runs a command when loaded."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("key", ["rng.python", "lr_scheduler"])
def test_a_crafted_train_state_never_runs_code(daemon, workdir, key):
    import pickle
    from ckptd._train_state import _to_bytes
    marker = os.path.join(workdir, "pwned")
    model, optimizer, scheduler = make_training()

    class Crafting(CheckpointManager):
        def _train_state(self, step):
            state = super()._train_state(step)
            state[key] = (pickle.dumps(_Evil(marker)) if key == "rng.python"
                          else _to_bytes(_Evil(marker)))
            return state

    with Crafting("crafted", model, optimizer, scheduler, socket=daemon.socket) as manager:
        train_step(model, optimizer, scheduler)
        manager.save(1, blocking=True)
    model2, optimizer2, scheduler2 = make_training(seed=4)
    with CheckpointManager("crafted", model2, optimizer2, scheduler2, socket=daemon.socket) as manager:
        with pytest.raises(CheckpointError, match="train state is not usable"):
            manager.load()
    assert not os.path.exists(marker)


def test_an_ephemeral_checkpoint_lasts_until_the_next_one_commits(daemon):
    model, optimizer, scheduler = make_training()
    with CheckpointManager("eph", model, optimizer, scheduler, socket=daemon.socket) as manager:
        for step, ephemeral in [(10, False), (11, True), (12, True)]:
            train_step(model, optimizer, scheduler)
            manager.save(step, blocking=True, ephemeral=ephemeral)
        # 12 is the latest: it stays, the restart point, until the next commits
        deadline = time.monotonic() + 10  # retention runs after the commit, off the save path
        while daemon.steps("eph") != [10, 12] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert daemon.steps("eph") == [10, 12]  # the daemon keeps everything (--keep-last 0)
        train_step(model, optimizer, scheduler)
        manager.save(20, blocking=True)
        while daemon.steps("eph") != [10, 20] and time.monotonic() < deadline + 10:
            time.sleep(0.05)
        assert daemon.steps("eph") == [10, 20]
    assert "deleted by retention (ephemeral, a newer step committed)" in open(daemon.log).read()


def test_a_weights_only_save_in_another_dtype(daemon):
    model, optimizer, scheduler = make_training()
    with CheckpointManager("full", model, optimizer, scheduler, socket=daemon.socket) as manager:
        train_step(model, optimizer, scheduler)
        manager.save(1, blocking=True)
        assert manager.save_weights(1, dtype=torch.bfloat16) == "full-weights"
    assert daemon.steps("full-weights") == [1]
    assert daemon.steps("full") == [1]  # the training job's own steps are left alone
    step_dir = os.path.join(daemon.root, "full-weights", "step-00000001")
    with open(os.path.join(step_dir, "manifest.json")) as f:
        tensors = json.load(f)["tensors"]
    assert set(tensors) == set(model.state_dict())  # no optimizer state
    assert tensors["0.weight"]["dtype"] == "BF16"
    assert tensors["1.num_batches_tracked"]["dtype"] == "I64"  # integers keep theirs
    stored = load_file(shard_path(step_dir, 0))["0.weight"]  # a first step: its file holds it all
    assert torch.equal(stored, model[0].weight.detach().to(torch.bfloat16))


def test_saves_never_wait_for_a_daemon_that_does_not_answer(workdir, monkeypatch):
    """A socket that accepts connections but never speaks (a hung ckptd): the first save
    gives the connection attempt a second, later ones return at once."""
    monkeypatch.setattr(ckptd.torch, "_CONNECT_PATIENCE_SECONDS", 1.0)  # the default
    path = os.path.join(workdir, "hung.sock")
    hung = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    hung.bind(path)
    hung.listen(16)  # never accepts: connections wait in the backlog
    try:
        model, optimizer, scheduler = make_training()
        manager = CheckpointManager("hung", model, optimizer, scheduler, socket=path, interval_steps=1)
        started = time.monotonic()
        assert manager.maybe_save(1) is False
        assert time.monotonic() - started < 2.0
        for step in range(2, 12):
            train_step(model, optimizer, scheduler)
            started = time.monotonic()
            assert manager.maybe_save(step) is False
            assert time.monotonic() - started < 0.05
    finally:
        hung.close()


# --- safety and zero copy ----------------------------------------------------------------

def free_huge_pages():
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("HugePages_Free:"):
                return int(line.split()[1])
    return 0


@pytest.mark.parametrize("copy_on_write", [False, True])
def test_the_checkpoint_holds_the_values_before_the_next_optimizer_step(whole_daemon, copy_on_write):
    daemon = whole_daemon  # each step's values read back from its own file
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2048, 4096), torch.nn.Linear(4096, 2048))  # 128 MiB
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    # Copy-on-write: the optimizer step runs while ckptd still copies the 32 MiB weights (in
    # huge pages where the machine has a pool; copied first otherwise).
    huge = free_huge_pages() >= 64
    with CheckpointManager("safety", model, optimizer, socket=daemon.socket,
                           copy_on_write=copy_on_write) as manager:
        for step in range(1, 4):
            model(torch.randn(4, 2048)).sum().backward()
            before = {k: v.clone() for k, v in model.state_dict().items()}
            assert manager.save(step)          # returns before the copy is done
            optimizer.step()                   # waits for "staged", then mutates
            optimizer.zero_grad()
            assert not torch.equal(before["0.weight"], model[0].weight)
            manager.wait(committed=True)
            stored = load_file(os.path.join(daemon.root, "safety", f"step-{step:08d}", "rank-00000.safetensors"))
            for k, v in before.items():
                assert torch.equal(stored[k], v), k
    log = open(daemon.log).read()
    if copy_on_write and huge:
        # Every tensor: the weights' own arenas and the one the biases share are huge pages.
        assert re.search(r"copy-on-write snapshots for ([1-9]\d*) of \1 bytes", log), log
    else:
        assert "copy-on-write snapshots" not in log or "copy-on-write snapshots for 0 of" in log, log


def test_host_tensors_move_into_shared_memory_once_and_keep_their_identity(daemon):
    model, optimizer, scheduler = make_training()
    params = list(model.parameters())
    with CheckpointManager("zero-copy", model, optimizer, scheduler, socket=daemon.socket) as manager:
        train_step(model, optimizer, scheduler)
        manager.save(1, blocking=True)
        assert list(model.parameters()) == params  # same Parameter objects
        assert optimizer.param_groups[0]["params"][0] is params[0]
        tensors = [p.data for p in params] + [model[1].running_mean]
        tensors += [s["exp_avg"] for s in optimizer.state.values()]
        assert all(is_shared_memory(t.data_ptr()) for t in tensors)
        addresses = [t.data_ptr() for t in tensors]
        for step in range(2, 5):
            train_step(model, optimizer, scheduler)
            manager.save(step)
        manager.wait(committed=True)
        assert [p.data_ptr() for p in params] == addresses[:len(params)]  # not moved again


def test_the_package_installs_into_a_virtual_environment(workdir):
    # In the test's runfiles, or built beside the sources.
    wheel = (glob.glob("client/python/ckptd-*.whl") + glob.glob("bazel-bin/client/python/ckptd-*.whl"))[0]
    venv = os.path.join(workdir, "venv")
    subprocess.run(["/usr/bin/python3", "-m", "venv", "--system-site-packages", venv], check=True)
    subprocess.run([os.path.join(venv, "bin", "pip"), "install", "-q", "--no-index", "--no-deps",
                    "--disable-pip-version-check", wheel], check=True)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    probe = subprocess.run([os.path.join(venv, "bin", "python"), "-c",
                            "import ckptd, ckptd.torch; print(ckptd.__file__)"],
                           capture_output=True, text=True, env=env, cwd=workdir, check=True)
    assert probe.stdout.startswith(os.path.join(venv, "lib"))


def test_keep_last_and_intervals(daemon):
    model, optimizer, scheduler = make_training()
    with CheckpointManager("retained", model, optimizer, scheduler, socket=daemon.socket,
                           interval_steps=2, keep_last=2) as manager:
        saved = []
        for step in range(1, 9):
            train_step(model, optimizer, scheduler)
            if manager.maybe_save(step):
                saved.append(step)
                manager.wait(committed=True)
        assert saved == [2, 4, 6, 8]
    # ckptd runs with --keep-last 0: the job asked for 2. Retention runs after the commit.
    deadline = time.monotonic() + 10
    while daemon.steps("retained") != [6, 8] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert daemon.steps("retained") == [6, 8]

    with CheckpointManager("timed", model, optimizer, socket=daemon.socket, interval_seconds=3600) as manager:
        assert manager.maybe_save(1) is False  # an hour has not passed
    with pytest.raises(ValueError, match="interval_seconds must be positive"):
        CheckpointManager("bad", model, interval_seconds=0)
    with pytest.raises(ValueError, match="interval_steps must be at least 1"):
        CheckpointManager("bad", model, interval_steps=0)


def test_ranks_saving_by_time_save_the_same_steps_whatever_their_clocks(daemon):
    # Two ranks reach each step at different moments (rank 1 starts later and its steps take
    # uneven times), so their own clocks would cross the interval at different steps and
    # each step would be saved by one rank only. ckptd's clock picks one set for both.
    saved = {0: [], 1: [], "errors": []}

    def rank(r):
        try:
            model, optimizer, scheduler = make_training(seed=r)
            with CheckpointManager("by-time", model, optimizer, scheduler, socket=daemon.socket,
                                   interval_seconds=0.25, rank=r, world_size=2) as manager:
                time.sleep(0.13 * r)
                for step in range(1, 41):
                    train_step(model, optimizer, scheduler)
                    time.sleep(0.02 + (0.03 * (step % 3) if r else 0.0))
                    if manager.maybe_save(step):
                        saved[r].append(step)
                manager.wait(committed=True)
        except Exception as e:  # reported by the main thread
            saved["errors"].append(repr(e))

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert saved["errors"] == []
    assert saved[0] == saved[1]
    assert len(saved[0]) >= 2
    assert daemon.steps("by-time") == saved[0]  # every one of them completed

    # Ranks configured with different intervals are told so instead of never saving.
    model, optimizer, scheduler = make_training()
    with CheckpointManager("by-time-2", model, optimizer, socket=daemon.socket, interval_seconds=10,
                           rank=0, world_size=2) as first, \
            CheckpointManager("by-time-2", make_training(seed=1)[0], socket=daemon.socket,
                              interval_seconds=20, rank=1, world_size=2) as second:
        train_step(model, optimizer, scheduler)
        assert first.maybe_save(1) is False
        with pytest.raises(CheckpointError, match="interval_seconds"):
            second.maybe_save(1)


class _Position:
    """A data loader's place in its data set."""

    def __init__(self, position):
        self.position = position

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


@pytest.mark.parametrize("source", ["memory", "disk"])
def test_load_leaves_out_what_it_is_told_to(daemon, source):
    model, optimizer, scheduler = make_training()
    sampler = _Position(17)
    with CheckpointManager("partial", model, optimizer, scheduler, extra_state={"sampler": sampler},
                           socket=daemon.socket) as manager:
        for _ in range(2):
            train_step(model, optimizer, scheduler)
        manager.save(2, blocking=True)
    if source == "disk":
        daemon.restart()

    # Fine-tuning from a pre-training checkpoint: its weights, a fresh optimizer, schedule
    # and sampler (torchtitan's exclude_from_loading).
    tuned, tuned_optimizer, tuned_scheduler = make_training(seed=1)
    tuned_sampler = _Position(0)
    with CheckpointManager("partial", tuned, tuned_optimizer, tuned_scheduler,
                           extra_state={"sampler": tuned_sampler}, socket=daemon.socket,
                           exclude_from_loading=["optimizer", "lr_scheduler", "sampler"]) as manager:
        assert manager.load() == 2
    assert_same(tuned.state_dict(), model.state_dict())
    assert tuned_optimizer.state_dict()["state"] == {}  # as fresh as it was
    assert tuned_optimizer.param_groups[0]["lr"] == 1e-2  # not the decayed 5e-3 of the checkpoint
    assert tuned_scheduler.last_epoch == 0
    assert tuned_sampler.position == 0

    # A pattern leaves a layer as it is; everything else, optimizer state included, loads.
    other, other_optimizer, other_scheduler = make_training(seed=2)
    kept = other[0].weight.detach().clone()
    with CheckpointManager("partial", other, other_optimizer, other_scheduler,
                           extra_state={"sampler": _Position(0)}, socket=daemon.socket) as manager:
        assert manager.load(exclude=["0.weight", "optim.0.weight.*"]) == 2
    assert torch.equal(other[0].weight, kept)
    assert torch.equal(other[0].bias, model[0].bias)
    assert torch.equal(other_optimizer.state[other[3].weight]["exp_avg"],
                       optimizer.state[model[3].weight]["exp_avg"])

    # A model with a layer the checkpoint lacks: refused by name, or skipped with a warning.
    grown, grown_optimizer, _ = make_training(seed=3)
    grown.add_module("4", torch.nn.Linear(2, 2))
    grown_optimizer = torch.optim.Adam(grown.parameters(), lr=1e-2)
    with CheckpointManager("partial", grown, grown_optimizer, socket=daemon.socket) as manager:
        with pytest.raises(CheckpointError, match="4.weight"):
            manager.load(exclude=["lr_scheduler"])
        new_layer = grown[4].weight.detach().clone()
        with pytest.warns(UserWarning, match=r"tensors not in the checkpoint were skipped.*4\.bias"):
            assert manager.load(exclude=["lr_scheduler"], strict=False) == 2
    assert torch.equal(grown[0].weight, model[0].weight)
    assert torch.equal(grown[4].weight, new_layer)

    with pytest.raises(ValueError, match="no tensor to load"):
        CheckpointManager("partial", grown, socket=daemon.socket).load(exclude=["model", "optimizer"])


def _flip_a_data_byte(path):
    """Flips one bit in the tensor data of a safetensors file (past its JSON header)."""
    with open(path, "r+b") as f:
        header = int.from_bytes(f.read(8), "little")
        f.seek(8 + header + 5)
        byte = f.read(1)
        f.seek(8 + header + 5)
        f.write(bytes([byte[0] ^ 0x10]))


def test_a_damaged_latest_step_falls_back_on_every_rank_with_a_warning(daemon):
    states = {}
    for r in range(2):
        model, optimizer, scheduler = make_training(seed=r)
        with CheckpointManager("damaged", model, optimizer, scheduler, socket=daemon.socket,
                               rank=r, world_size=2) as manager:
            for step in (2, 4):
                train_step(model, optimizer, scheduler)
                assert manager.save(step)
                manager.wait_staged()
                states[(r, step)] = clone_state(model, optimizer, scheduler)
    deadline = time.monotonic() + 30
    while daemon.steps("damaged") != [2, 4] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert daemon.steps("damaged") == [2, 4]
    daemon.restart()  # from disk: memory holds no damage
    _flip_a_data_byte(shard_path(os.path.join(daemon.root, "damaged", "step-00000004"), 1))

    def load_all():
        out = {"errors": []}

        def rank(r):
            model, optimizer, scheduler = make_training(seed=9)
            try:
                with CheckpointManager("damaged", model, optimizer, scheduler, socket=daemon.socket,
                                       rank=r, world_size=2) as manager:
                    out[r] = manager.load()
                    out[("state", r)] = clone_state(model, optimizer, scheduler)
            except CheckpointError as e:
                out["errors"].append(str(e))

        # One recorder for both threads: catch_warnings swaps process-wide state.
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=300)
        out["warnings"] = [str(w.message) for w in caught]
        return out

    # Rank 0's shard of step 4 is fine, rank 1's is not: both resume from step 2, and both
    # are told why.
    out = load_all()
    assert out["errors"] == []
    assert out[0] == out[1] == 2
    told = [w for w in out["warnings"] if "step 4 is damaged" in w and "rank 1" in w and
            "checksum" in w and "restored step 2 instead" in w]
    assert len(told) == 2, out["warnings"]
    for r in range(2):
        assert_same(out[("state", r)], states[(r, 2)])

    # With every step damaged, load() raises instead of starting over.
    _flip_a_data_byte(shard_path(os.path.join(daemon.root, "damaged", "step-00000002"), 0))
    out = load_all()
    assert len(out["errors"]) == 2
    assert all("every committed step is damaged" in e for e in out["errors"]), out["errors"]


def _embedding_model(rows, seed=0):
    torch.manual_seed(seed)
    model = torch.nn.ModuleDict({"emb": torch.nn.Embedding(rows, 8), "dense": torch.nn.Linear(8, 4)})
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def _embedding_step(model, optimizer):
    rows = model["emb"].weight.shape[0]
    loss = model["dense"](model["emb"](torch.randint(0, rows, (32,)))).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def test_a_growing_embedding_table_registers_only_what_changed(whole_daemon):
    daemon = whole_daemon  # step 2's shapes read back from its own file
    model, optimizer = _embedding_model(100)
    with CheckpointManager("growing", model, optimizer, socket=daemon.socket) as manager:
        _embedding_step(model, optimizer)
        manager.save(1, blocking=True)
        dense = model["dense"].weight.data_ptr()
        # A hash-table embedding takes 50 new keys: its table and its Adam state grow.
        weight = model["emb"].weight
        weight.grad = None
        weight.data = torch.cat([weight.detach(), torch.randn(50, 8)])
        state = optimizer.state[weight]
        for key in ("exp_avg", "exp_avg_sq"):
            state[key] = torch.cat([state[key], torch.zeros(50, 8)])
        _embedding_step(model, optimizer)
        manager.save(2, blocking=True)
        assert manager.updates == 1  # an update of the three grown tensors, not a new session
        assert model["dense"].weight.data_ptr() == dense  # the others did not move again
        assert is_shared_memory(model["emb"].weight.data_ptr())
        saved = copy.deepcopy((model.state_dict(), optimizer.state_dict()))
        _embedding_step(model, optimizer)
        manager.save(3, blocking=True)
        assert manager.updates == 1  # nothing changed since
    shard = load_file(os.path.join(daemon.root, "growing", "step-00000001", "rank-00000.safetensors"))
    assert shard["emb.weight"].shape == (100, 8)
    shard = load_file(os.path.join(daemon.root, "growing", "step-00000002", "rank-00000.safetensors"))
    assert shard["emb.weight"].shape == (150, 8)
    assert shard["optim.emb.weight.exp_avg"].shape == (150, 8)

    # A fresh process sizes its table as the checkpoint says and resumes bit-exactly.
    fresh, fresh_optimizer = _embedding_model(150, seed=5)
    with CheckpointManager("growing", fresh, fresh_optimizer, socket=daemon.socket) as manager:
        assert manager.load(step=2) == 2
    assert_same((fresh.state_dict(), fresh_optimizer.state_dict()), saved)


def test_replaced_tensors_are_registered_again(whole_daemon):
    daemon = whole_daemon  # step 2's values read back from its own file
    model, optimizer, scheduler = make_training()
    with CheckpointManager("replaced", model, optimizer, scheduler, socket=daemon.socket) as manager:
        train_step(model, optimizer, scheduler)
        manager.save(1, blocking=True)
        # load_state_dict puts new tensors (not in shared memory) into the optimizer state.
        optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))
        exp_avg = optimizer.state[model[0].weight]["exp_avg"]
        assert not is_shared_memory(exp_avg.data_ptr())
        train_step(model, optimizer, scheduler)
        manager.save(2, blocking=True)
        exp_avg = optimizer.state[model[0].weight]["exp_avg"]
        assert is_shared_memory(exp_avg.data_ptr())
        stored = load_file(os.path.join(daemon.root, "replaced", "step-00000002", "rank-00000.safetensors"))
        assert torch.equal(stored["optim.0.weight.exp_avg"], exp_avg)


def test_a_data_parallel_job_resumes_on_more_or_fewer_ranks(daemon):
    # Saved by 2 data-parallel ranks (each holds every tensor whole: replicas); resumed by
    # 3 ranks (the new one takes rank 0's train state) and by 1, each equal to the save.
    for r in range(2):
        model, optimizer, scheduler = make_training(seed=0)
        with CheckpointManager("grow", model, optimizer, scheduler, socket=daemon.socket,
                               rank=r, world_size=2) as manager:
            for step in (1, 2, 3):
                train_step(model, optimizer, scheduler)
            assert manager.save(3)
            manager.wait_staged()
            saved = clone_state(model, optimizer, scheduler)
    deadline = time.monotonic() + 30
    while daemon.steps("grow") != [3] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert daemon.steps("grow") == [3]

    for world, restart in ((3, False), (1, True)):
        if restart:
            daemon.restart()  # from disk this time

        def rank(r):
            model, optimizer, scheduler = make_training(seed=7)
            with CheckpointManager("grow", model, optimizer, scheduler, socket=daemon.socket,
                                   rank=r, world_size=world) as manager:
                return manager.load(), clone_state(model, optimizer, scheduler)

        for step, state in _on_ranks(world, rank).values():
            assert step == 3, step
            assert_same(state, saved)


def _flat_layout(model, world, align=4):
    """FSDP-style flat parameter of `model`: (key, shape, start) of every parameter
    flattened one after another, each start aligned to `align` elements (FSDP pads between
    them), and each rank's slice length (the total padded to a multiple of `world`)."""
    members, at = [], 0
    for key, p in model.named_parameters():
        at = (at + align - 1) // align * align
        members.append((key, list(p.shape), at))
        at += p.numel()
    return members, -(-at // world)


def _flat_pieces(members, rank, slice_len):
    """This rank's pieces: (key, global_shape, begin, end, at) for allocate_flat_shard."""
    lo, hi = rank * slice_len, (rank + 1) * slice_len
    pieces = []
    for key, shape, start in members:
        numel = math.prod(shape)
        b, e = max(lo, start), min(hi, start + numel)
        if b < e:
            pieces.append((key, shape, b - start, e - start, b - lo))
    return pieces


def _on_ranks(world, body):
    """body(rank) on one thread per rank, at once (restores meet at a barrier); the results
    by rank, or the first rank's exception, named."""
    out = {}

    def run(r):
        try:
            out[r] = body(r)
        except Exception as e:  # reported below, with the rank
            out[r] = e
    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    for r in range(world):
        assert r in out, f"rank {r} did not finish in 300 s"
        assert not isinstance(out[r], Exception), f"rank {r}: {out[r]!r}"
    return out


def test_fsdp_flat_shards_from_the_python_client_restore_into_any_placement(daemon):
    # 4 ranks save an FSDP-style flat parameter through the Python client (each rank one
    # slice; slices cut tensors and hold pieces of two); a plain model loads it on 1 rank.
    reference = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 3))
    members, slice_len = _flat_layout(reference, 4)
    values = dict(reference.named_parameters())

    def save(r):
        client = ckptd.connect(daemon.socket, "flat", rank=r, world_size=4)
        pieces = _flat_pieces(members, r, slice_len)
        flat = torch.frombuffer(client.allocate_flat_shard("F32", slice_len, pieces), dtype=torch.float32)
        for key, _, b, e, at in pieces:
            flat[at:at + e - b] = values[key].detach().flatten()[b:e]
        client.register()
        state = client.wait_committed(client.snapshot(10))
        client.unregister()
        return state["state"]

    assert set(_on_ranks(4, save).values()) == {"committed"}
    manifest = json.load(open(os.path.join(daemon.root, "flat", "step-00000010", "manifest.json")))
    assert any("flat" in s for s in manifest["tensors"]["0.bias"]["shards"])

    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 3))
    with CheckpointManager("flat", model, socket=daemon.socket) as manager:
        assert manager.load() == 10
        for key, p in model.named_parameters():
            assert torch.equal(p, values[key]), key
        # And back: a save by the plain model restores into 3 ranks' flat shards.
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(-2)
        assert manager.save(20)
        manager.wait(committed=True)
    members, slice_len = _flat_layout(model, 3)
    doubled = {k: p.detach().flatten() for k, p in model.named_parameters()}

    def restore(r):
        client = ckptd.connect(daemon.socket, "flat", rank=r, world_size=3)
        pieces = _flat_pieces(members, r, slice_len)
        flat = torch.frombuffer(client.allocate_flat_shard("F32", slice_len, pieces), dtype=torch.float32)
        client.register()
        info = client.restore(20)
        client.unregister()
        assert info["step"] == 20
        for key, _, b, e, at in pieces:
            assert torch.equal(flat[at:at + e - b], doubled[key][b:e]), (r, key)
        return info["tensors"]

    assert sum(_on_ranks(3, restore).values()) >= 4  # each tensor restored somewhere


# --- a daemon that stalls or restarts (issue 24 item 1) ------------------------------------

def _training_with_commits(daemon, job):
    """A manager saving every step, five steps trained and the last committed: (the
    training's parts, the manager, the step times so far, the next step, its session)."""
    model, optimizer, scheduler = make_training()
    manager = CheckpointManager(job, model, optimizer, scheduler, socket=daemon.socket,
                                interval_steps=1)
    times = []
    step = _train_with(manager, model, optimizer, scheduler, 5, 1, times)
    assert manager.wait(committed=True) == "committed"
    return (model, optimizer, scheduler), manager, times, step, manager._client.session_id


def _train_with(manager, model, optimizer, scheduler, steps, first, step_times):
    for step in range(first, first + steps):
        started = time.monotonic()
        train_step(model, optimizer, scheduler)
        manager.maybe_save(step)  # never raises: whatever ckptd answers, training goes on
        step_times.append(time.monotonic() - started)
        time.sleep(0.01)
    return first + steps


def _train_through_stall(daemon, training, manager, times, step, seconds=5.0):
    """Trains while `daemon` is stopped (SIGSTOP) for `seconds`; returns the next step, the
    times of the steps trained meanwhile (more than ten: training went on) and the warnings."""
    daemon.process.send_signal(signal.SIGSTOP)
    try:
        stalled_from = len(times)
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:
                step = _train_with(manager, *training, 1, step, times)
    finally:
        daemon.process.send_signal(signal.SIGCONT)
    stalled = times[stalled_from:]
    assert len(stalled) > 10
    return step, stalled, warned


def _train_until_committed(training, manager, times, step, seconds, log=None):
    """Trains a step at a time until one's checkpoint commits (snapshots of a stall are
    abandoned or aborted until then); returns the next step."""
    deadline = time.monotonic() + seconds
    while True:
        step = _train_with(manager, *training, 1, step, times)
        try:
            if manager.wait(committed=True) == "committed":
                return step
        except CheckpointError:
            pass
        assert time.monotonic() < deadline, open(log, errors="replace").read()[-4000:] if log else ""


def test_a_stalled_daemon_costs_only_the_checkpoints_it_missed(daemon):
    """ckptd stopped for 5 s (SIGSTOP: a long stall, a swapped node) and resumed: the trainer
    never stops; at most one step waits (for the snapshot ckptd had not copied, until its
    heartbeat is 3 s stale, then the snapshot is abandoned); it keeps its session, so saves
    commit again as soon as ckptd is back, with no new registration."""
    (model, optimizer, scheduler), manager, times, step, session = _training_with_commits(daemon, "stall")
    step, stalled, warned = _train_through_stall(daemon, (model, optimizer, scheduler), manager, times, step)
    assert sum(t > 0.5 for t in stalled) <= 1, stalled
    assert max(stalled) < 4.5, stalled
    unavailable = [w for w in warned if "ckptd unavailable" in str(w.message)]
    assert len(unavailable) == 1, [str(w.message) for w in warned]  # once per outage
    # Back: the same session saves again, and its next checkpoint commits.
    step = _train_until_committed((model, optimizer, scheduler), manager, times, step, 30)
    step = _train_with(manager, model, optimizer, scheduler, 3, step, times)
    assert manager.wait(committed=True) == "committed"
    assert manager._client.session_id == session
    assert daemon.steps("stall")[-1] == step - 1
    manager.close()


def _newest_committed(out):
    steps = [int(m) for m in re.findall(r"committed step=(\d+)", out)]
    return max(steps, default=0)


def test_a_stalled_group_member_costs_its_python_and_cpp_trainers_only_missed_checkpoints(workdir):
    """A member of a two-node group stopped (SIGSTOP) for 5 s, past --group-timeout, with a
    Python trainer (CheckpointManager) and a C++ one (example_trainer) on it: the coordinator
    marks it lost, neither trainer stops, raises or exits, and both jobs commit again once
    the member is back and has joined again."""
    port = free_port()
    token = os.path.join(workdir, "token")
    with open(os.open(token, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
        f.write("a-group-token-of-enough-length-0123456789\n")
    group = ["--num-nodes", "2", "--coordinator", f"127.0.0.1:{port}", "--group-token-file", token,
             "--group-timeout", "2s", "--step-timeout", "60s"]
    nodes = []
    for n in (0, 1):
        os.makedirs(os.path.join(workdir, f"n{n}"))
        extra = ["--node-rank", str(n), *group] + (["--group-addr", f"127.0.0.1:{port}"] if n == 0 else [])
        nodes.append(Daemon(os.path.join(workdir, f"n{n}"), extra))
    cpp = None
    try:
        for d in nodes:
            d.start()
        member = nodes[1]
        cpp = subprocess.Popen(["client/example_trainer", "--socket", member.socket, "--job", "cpp", "--steps",
                                "100000000", "--save-every", "5", "--state-bytes", "400000", "--step-sleep-ms", "10"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        cpp_out = []
        reader = threading.Thread(target=lambda: cpp_out.extend(cpp.stdout), daemon=True)
        reader.start()
        (model, optimizer, scheduler), manager, times, step, session = _training_with_commits(member, "py")
        deadline = time.monotonic() + 60
        while _newest_committed("".join(cpp_out)) == 0:
            assert cpp.poll() is None and time.monotonic() < deadline, "".join(cpp_out)
            time.sleep(0.05)

        step, stalled, _ = _train_through_stall(member, (model, optimizer, scheduler), manager, times, step)
        assert max(stalled) < 4.5, stalled
        assert cpp.poll() is None, "".join(cpp_out)
        with open(nodes[0].log, errors="replace") as log:
            assert re.search(r"node 1 \(.*\) lost: no heartbeat", log.read())
        cpp_before = _newest_committed("".join(cpp_out))

        # Back and joined again: both jobs commit new steps, the trainers never stopped.
        step = _train_until_committed((model, optimizer, scheduler), manager, times, step, 60, member.log)
        deadline = time.monotonic() + 60
        step = _train_with(manager, model, optimizer, scheduler, 3, step, times)
        assert manager.wait(committed=True) == "committed"
        assert member.steps("py")[-1] == step - 1
        while _newest_committed("".join(cpp_out)) <= cpp_before:
            assert cpp.poll() is None and time.monotonic() < deadline, "".join(cpp_out)
            time.sleep(0.05)
        manager.close()
    finally:
        if cpp is not None:
            cpp.kill()
            cpp.wait()
        for d in nodes:
            d.stop(signal.SIGKILL)


def test_a_restarted_daemon_takes_the_trainer_back_by_itself(daemon):
    """ckptd killed: the next step's wait returns within milliseconds (its liveness pipe
    hangs up), not after the 3 s heartbeat; a new ckptd on the same socket gets the rank
    registered again by the client itself, and the job's checkpoints go on."""
    (model, optimizer, scheduler), manager, times, step, session = _training_with_commits(daemon, "restart")
    ticket = manager.save(step)  # queued; then ckptd dies before (or while) it copies
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        daemon.stop(signal.SIGKILL)
        started = time.monotonic()
        manager.wait_staged()  # what the forward hook runs
        assert time.monotonic() - started < 0.5
        step = _train_with(manager, model, optimizer, scheduler, 20, step + 1, times)
        daemon.start()
        deadline = time.monotonic() + 60
        while True:
            step = _train_with(manager, model, optimizer, scheduler, 1, step, times)
            if (manager._client.session_id not in ("", session)
                    and manager.wait(committed=True) == "committed"):
                break
            assert time.monotonic() < deadline
    assert ticket is True
    assert max(times) < 1.0, times
    assert daemon.steps("restart")[-1] == step - 1
    # What the new ckptd committed restores bit for bit into a fresh model.
    expected = clone_state(model, optimizer, scheduler)
    manager.close()
    model2, optimizer2, scheduler2 = make_training(seed=1)
    with CheckpointManager("restart", model2, optimizer2, scheduler2, socket=daemon.socket) as again:
        assert again.load() == step - 1
    assert_same(clone_state(model2, optimizer2, scheduler2), expected)


def test_registering_again_from_the_same_process_takes_over_its_own_session(daemon):
    """A manager that lost its client (as after an outage) and a new one in the same process:
    ckptd ends the process's own earlier session instead of answering 'already registered'."""
    model, optimizer, scheduler = make_training()
    first = CheckpointManager("again", model, optimizer, scheduler, socket=daemon.socket,
                              interval_steps=1)
    first.save(1, blocking=True)
    first._client = None  # dropped without unregistering, as a stalled daemon would see it
    second = CheckpointManager("again", model, optimizer, scheduler, socket=daemon.socket,
                               interval_steps=1)
    assert second.save(2, blocking=True) is True
    assert daemon.steps("again") == [1, 2]
    second.close()


def test_dcp_interoperability_says_it_needs_pytorch_2_where_it_is_not(daemon, workdir):
    """On Debian's PyTorch 1.13, ckptd.dcp and load(from_dcp=) say what they need instead of
    a ModuleNotFoundError from inside torch; on PyTorch 2 they are there."""
    model = torch.nn.Linear(2, 2)
    with CheckpointManager("old-torch", model, socket=daemon.socket) as manager:
        if int(torch.__version__.split(".")[0]) >= 2:
            import ckptd.dcp  # noqa: F401
            with pytest.raises(CheckpointError, match="cannot load DCP checkpoint"):
                manager.load(from_dcp=os.path.join(workdir, "no-such", "step-1"))
            return
        with pytest.raises(ImportError, match="ckptd.dcp needs PyTorch 2"):
            import ckptd.dcp  # noqa: F401
        with pytest.raises(CheckpointError, match="needs PyTorch 2"):
            manager.load(from_dcp=os.path.join(workdir, "step-1"))

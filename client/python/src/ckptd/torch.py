"""Checkpointing PyTorch training state through ckptd.

    manager = CheckpointManager("my-job", model, optimizer, lr_scheduler, interval_steps=100)
    start = (manager.load() or 0) + 1
    for step in range(start, steps + 1):
        loss = train_step(...)                  # forward, backward, optimizer.step()
        manager.maybe_save(step)                # returns at once
    manager.close()

Host tensors are moved once into shared memory that ckptd reads directly, so a snapshot
copies nothing in the trainer; CUDA tensors are shared with ckptd through CUDA IPC. Until
ckptd has copied a snapshot, the manager holds back the next optimizer step and the next
forward pass (which may update buffers such as BatchNorm statistics), so every checkpoint
holds the values of the moment `save()` was called.
"""
import atexit
import functools
import itertools
import json
import logging
import os
import pickle
import random
import re
import time
import warnings
import weakref

import torch

import ckptd
from ckptd import _advice, _fsdp1, _parts, _placement
from ckptd._connection import _Connector, _env_int, _listening, _user_stacklevel
from ckptd._errors import CheckpointError
from ckptd._preemption import PreemptionSaver
from ckptd._restored import Restored
from ckptd._state_dict import (_aliases, _Entry, _dtype_name, _move_to_arena, _named_parameters, _param_names,
                               _persistent_buffers, _set_buffer, _set_data, _set_item)
from ckptd._train_state import _from_bytes, _plain_loads, _to_bytes

__all__ = ["CheckpointManager", "CheckpointError", "Restored"]

log = logging.getLogger("ckptd")

# What the names DCP needs (parameter-group names, tied aliases) may add to a snapshot's
# metadata: metadata goes into every shard header and manifest, so it stays small; the
# train state itself has no such cap (it travels in shared memory past 256 KiB).
_MAX_PARAM_NAMES_BYTES = 64 << 10
_MAX_ALIASES_BYTES = 16 << 10

# How long after a failed connection the manager tries again (at the next save).
_RECONNECT_SECONDS = 30.0
# How long a save waits for a listening ckptd to accept the connection before training goes
# on without that save (the attempt continues in the background; a later save adopts it).
_CONNECT_PATIENCE_SECONDS = 1.0

# Managers not closed yet, closed when the interpreter exits (_close_open_managers). Weak:
# a manager nobody uses any more is collected as before (its client leaves ckptd then).
_open_managers = weakref.WeakSet()


def _close_open_managers():
    """At interpreter exit, before it finalizes (an atexit hook): closes every manager still
    open, whatever state it was left in (after a failed load, mid-save, with ckptd gone), as
    close() does, so that the latest snapshot is staged and the session left while every
    thread may still take the GIL. A stop asked for by SIGTERM is not carried out again: the
    process is ending already. Never raises: the exit goes on whatever one manager does."""
    for manager in list(_open_managers):
        try:
            manager._close(at_exit=True)
        except BaseException as e:  # noqa: BLE001 - see above
            log.warning("ckptd: closing the CheckpointManager of job %r at exit: %s", manager.job, e)


atexit.register(_close_open_managers)
# A forked child (a data loader worker) must never close its parent's sessions.
os.register_at_fork(after_in_child=_open_managers.clear)


def _environment_flag(name):
    """A yes/no setting from the environment: 1/true/yes/on or 0/false/no/off (unset or empty: off)."""
    value = os.environ.get(name, "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"${name} is {os.environ[name]!r}: use 1 or 0 (true/false, yes/no, on/off)")


class CheckpointManager:
    """Checkpoints a model, its optimizer and the rest of the training state through ckptd.

    Model parameters and buffers are keyed by their fully qualified names, optimizer state
    by `optim.<param fqn>.<state key>`; the step, RNG states, LR scheduler, optimizer
    hyper-parameters and every `extra_state` object (anything with `state_dict()`) go in as
    small train-state entries. When ckptd is not there, training goes on: a warning is
    logged and saves are skipped until it answers again.

    With ckptd's remote tier on (`ckptd --remote s3://...`), `upload_every_steps` and
    `upload_interval_seconds` choose which of this job's committed steps ckptd copies to
    the bucket (multiples of N, then the first of each window of T seconds); unset, the
    node's --upload-every-steps and --upload-interval apply. Every rank must pass the same
    (a rank that differs from its job's live ranks is refused).
    """

    def __init__(self, job, model, optimizer=None, lr_scheduler=None, extra_state=None,
                 socket=None, interval_steps=None, interval_seconds=None, keep_last=None,
                 rank=None, world_size=None, arena_bytes=64 << 20, keep_latest_k=None,
                 daemon_timeout=120.0, save_on_sigterm=None, exclude_from_loading=(),
                 copy_on_write=False, upload_every_steps=None, upload_interval_seconds=None):
        if interval_steps is not None and interval_steps < 1:
            raise ValueError(f"interval_steps must be at least 1, not {interval_steps}")
        if interval_seconds is not None and interval_seconds <= 0:
            raise ValueError(f"interval_seconds must be positive, not {interval_seconds}")
        if keep_latest_k is not None:  # torchtitan's name for the same setting
            if keep_last is not None and keep_last != keep_latest_k:
                raise ValueError(f"keep_last={keep_last} and keep_latest_k={keep_latest_k} disagree")
            keep_last = keep_latest_k
        if keep_last is not None and keep_last < 0:
            raise ValueError(f"keep_last must be 0 (keep all) or more, not {keep_last}")
        if upload_every_steps is not None and upload_every_steps < 1:
            raise ValueError(f"upload_every_steps must be at least 1, not {upload_every_steps}")
        if upload_interval_seconds is not None and not upload_interval_seconds >= 0:
            raise ValueError(f"upload_interval_seconds must be 0 (every step) or more, not "
                             f"{upload_interval_seconds}")
        if daemon_timeout < 0:
            raise ValueError(f"daemon_timeout must be 0 or more seconds, not {daemon_timeout}")
        self.job = job
        # Lists or dicts of model parts, optimizers and schedulers (pipeline stages) act as one.
        self.model = _parts.model_of(model)
        self.optimizer = _parts.optimizer_of(optimizer)
        self.lr_scheduler = _parts.scheduler_of(lr_scheduler)
        self.extra_state = dict(extra_state or {})
        for name, obj in self.extra_state.items():
            _check_extra(name, obj)
        self.socket = os.fspath(socket) if socket is not None else ckptd.default_socket()
        self.interval_steps = interval_steps
        self.interval_seconds = interval_seconds
        self.keep_last = keep_last
        self.upload_every_steps = upload_every_steps          # None: ckptd's --upload-every-steps
        self.upload_interval_seconds = upload_interval_seconds  # None: ckptd's --upload-interval
        self.rank = rank if rank is not None else (_env_int("RANK") or 0)
        self.world_size = world_size if world_size is not None else (_env_int("WORLD_SIZE") or 1)
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is not in [0, world_size={self.world_size})")
        self.arena_bytes = arena_bytes
        self.copy_on_write = copy_on_write  # see docs/python.md: off unless measured to help
        self.daemon_timeout = daemon_timeout
        if isinstance(exclude_from_loading, str):
            raise TypeError("exclude_from_loading is a list of keys, e.g. ['optimizer']")
        self.exclude_from_loading = list(exclude_from_loading)

        self._client = None
        self._registered = False
        self._registered_fingerprint = None  # see _fingerprint
        self._uses_cuda = False     # what the registered tensors are: decides how to wait
        self._uses_host = False
        self._retry_after = 0.0     # monotonic time before which no reconnect is tried
        self._outage = False        # ckptd unreachable since the last save that went through
        self._connector = None      # a connection attempt still under way (see _connected)
        self._quiet = False         # load() is waiting for ckptd: a lost daemon raises, not warns
        self._unstaged = None       # a ticket whose tensors must not be mutated yet
        self._last_ticket = None
        self._run = 0               # the step this run resumed from: names its save clock
        self._loaded = False        # load() restored (or found nothing): this run continues the job
        self._checked_run = False   # the first save looked at what the job already holds
        self._registered_where = {}  # see _where
        self._aliases = {}          # tied parameters' other names (_state_dict._aliases)
        self._extra_checked = set()  # extra_state entries seen to read back (_extra_bytes)
        self.updates = 0            # partial re-registrations (_update_changed), for tests
        self._closed = False
        self._install_hooks()
        # SIGTERM (preemption): the next maybe_save() saves and stages, then the stop goes on.
        # Not given: $CKPTD_SAVE_ON_SIGTERM decides (set by deploy/kubernetes' manifests).
        if save_on_sigterm is None:
            save_on_sigterm = _environment_flag("CKPTD_SAVE_ON_SIGTERM")
        self._preemption = PreemptionSaver() if save_on_sigterm else None
        _open_managers.add(self)

    # --- public API ---------------------------------------------------------------------

    def maybe_save(self, step):
        """Saves when `interval_steps` or `interval_seconds` says so; returns at once.

        Returns True when a snapshot was queued.
        """
        if self._preemption is not None and self._preemption.requested:
            self._preemption.stop(lambda: self.save(step) and self._staged())
            return True
        due = self.interval_steps is not None and step % self.interval_steps == 0
        if not due and self.interval_seconds is not None:
            due = self._due_by_time(step)
        return self.save(step) if due else False

    def _due_by_time(self, step):
        """Whether the job saves at `step` by `interval_seconds`. Not this rank's clock:
        ranks reach a step at different moments, and a step saved by some ranks only never
        completes. ckptd decides on one clock (the group coordinator's across nodes) and
        gives every rank the same answer for a step; it costs one call to the local ckptd.
        The first call registers the tensors (the set-up the first save would do)."""
        if not self._connected():
            return False
        try:
            self._register_current_tensors()
            return self._client.should_save(int(step), float(self.interval_seconds), self._run)
        except CheckpointError:
            raise
        except ckptd.Unavailable as e:
            self._unreachable(e)
            return False
        except ckptd.Error as e:
            if e.code == "INVALID_ARGUMENT":  # ranks configured differently: never skip silently
                raise CheckpointError(f"interval_seconds: {e}") from e
            # The group's clock did not answer, or ckptd is busy: no save at this step (no
            # rank can have been told to save it), training goes on.
            log.warning("ckptd: no save decision for step %d: %s", step, e)
            return False

    def save(self, step, blocking=False, ephemeral=False):
        """Queues a checkpoint of the current state as `step`.

        Returns at once (True) unless `blocking`, which waits until the checkpoint is
        committed on every rank and raises CheckpointError if it is not. Returns False when
        ckptd is unreachable (training goes on; a warning says so). An `ephemeral`
        checkpoint is kept only until a newer step of the job commits: frequent restart
        points that retention (keep_last, keep_every) never counts or keeps.
        """
        self._check_open()
        self.wait_staged()
        if not self._connected():
            if blocking:
                raise CheckpointError(f"step {step} not saved: ckptd is not reachable at {self.socket}")
            return False
        try:
            self._register_current_tensors()
            self._check_other_run(step)
            metadata = self._metadata()
            if ephemeral:
                metadata["ckptd.ephemeral"] = "1"  # daemon/persist/retention.h
            train_state = self._train_state(step)
            ticket = self._client.snapshot(int(step), metadata, train_state)
        except CheckpointError:
            raise  # this process's own mistake (a tensor that cannot be checkpointed)
        except ckptd.Error as e:
            # Nothing ckptd answers stops training: unreachable (stalled, restarting: the
            # client registers again by itself once a ckptd is back) or refused (the next
            # save registers anew). Only this save is missed.
            if isinstance(e, ckptd.Unavailable):
                self._unreachable(e)
            else:
                self._lost(e)
            if blocking:
                raise CheckpointError(f"step {step} not saved: {e}") from e
            return False
        if self._outage:
            self._outage = False
            log.warning("ckptd: reachable again; saving from step %d on", step)
        self._unstaged = ticket
        self._last_ticket = ticket
        if blocking:
            self.wait(committed=True)
        return True

    def _check_other_run(self, step):
        """At the first save: a job that already holds steps which this run neither loaded
        nor asked about gets this run's steps among them, and retention deletes the oldest
        of all. Said once, naming them and the ways out."""
        if self._checked_run:
            return
        self._checked_run = True
        if self._loaded or self.rank != 0 or not self._client.committed_count:
            return
        warnings.warn(_advice.other_run(self.job, self._client.committed_steps, self._client.committed_count,
                                        step, "call manager.load() before training"),
                      stacklevel=_user_stacklevel())

    def wait(self, committed=False):
        """Waits for the latest save to be staged (or, with `committed`, durable on every
        rank). Returns its state ("staged" or "committed"), or None when nothing was saved;
        raises CheckpointError if the checkpoint failed or was rejected."""
        if self._last_ticket is None or self._client is None:
            return None
        ticket = self._last_ticket
        wait = self._client.wait_committed if committed else self._client.wait_staged
        try:
            status = wait(ticket)
        except ckptd.Error as e:
            raise CheckpointError(f"checkpoint not {'committed' if committed else 'staged'}: {e}") from e
        if ticket == self._unstaged:
            self._unstaged = None
        if status["state"] not in ("staged", "committed"):
            raise CheckpointError(f"checkpoint {status['state']}: {status['error']}")
        return status["state"]

    def _staged(self):
        """Waits on the CPU until ckptd has copied the latest snapshot, CUDA tensors included
        (wait_staged only enqueues that wait on the stream): before the process may end."""
        ticket = self._last_ticket
        self.wait_staged()
        if ticket is not None and self._client is not None and self._uses_cuda:
            try:
                self._client.wait_staged(ticket)
            except ckptd.Unavailable as e:
                self._unreachable(e)
            except ckptd.Error as e:
                self._lost(e)
        return True

    def wait_staged(self):
        """Returns once ckptd has copied the latest snapshot, so the registered tensors may
        change again. The manager calls it before every optimizer step and forward pass;
        call it yourself before mutating registered tensors any other way. With CUDA
        tensors the wait is enqueued on the current stream and the CPU goes on at once."""
        ticket = self._unstaged
        if ticket is None:
            return
        self._unstaged = None
        try:
            if self._uses_cuda:
                self._client.stream_wait_staged(ticket, torch.cuda.current_stream().cuda_stream)
                if self._uses_host:
                    self._client.wait_staged(ticket)
            else:
                status = self._client.wait_staged(ticket)
                if status["state"] in ("failed", "rejected"):
                    log.warning("ckptd: checkpoint %s: %s", status["state"], status["error"])
        except ckptd.Unavailable as e:
            # ckptd exited (seen within milliseconds) or stalled past its heartbeat (3 s):
            # the snapshot is abandoned, so ckptd never commits what the next step changes.
            self._unreachable(e)
        except ckptd.Error as e:
            self._lost(e)

    def load(self, step=None, daemon_timeout=None, from_dcp=None, exclude=None, strict=True,
             from_hf=None, rename=None, cast=False):
        """Restores the latest checkpoint (or `step`) in place; returns its step, or None when
        the job has none. Never starts over silently: when ckptd cannot be reached, waits
        for it up to `daemon_timeout` seconds (the manager's, 120 by default) and then
        raises CheckpointError; so does a checkpoint that does not match the model (names
        and shapes are listed) or cannot be read.

        `from_dcp=PATH` loads a torch.distributed.checkpoint directory instead (switching a
        job to ckptd: its next save goes to ckptd); returns `step`, or the step in the
        directory's name (`step-1200`, as torchtitan names them).

        `exclude` (default: the manager's `exclude_from_loading`) leaves parts as they are:
        "model", "optimizer" (its tensors and hyper-parameters), "lr_scheduler", "rng", the
        name of an `extra_state` entry, or a shell pattern on tensor names ("layers.0.*",
        "optim.*.exp_avg_sq"). `strict=False` skips tensors that the model has and the
        checkpoint lacks, or the reverse, with a warning naming them. `cast=True` loads
        floating-point tensors saved in another dtype into the model's (a `save_weights(dtype=
        torch.bfloat16)` step into an FP32 model), rounding as `Tensor.to` does; without it a
        dtype that differs is an error naming the tensors.

        Returns a `Restored`: the step, an int (so `(manager.load() or 0) + 1` is the next
        step), that also says where it came from: `.source` ("memory", "disk", "remote":
        ckptd's --remote tier, or "peer": rebuilt from its peers' memory), `.bytes`, and `.resharded_from` (the world size it was saved
        with, when that differs from this job's; None otherwise). The same is logged at INFO
        and kept as `manager.restored`.

        A load that raises leaves nothing registered with ckptd (the next save or load, or
        another CheckpointManager of the same job, registers afresh)."""
        self._check_open()
        if from_dcp is not None:
            return self._load_from_dcp(os.fspath(from_dcp), step)
        if from_hf is not None:
            return self._load_from_hf(os.fspath(from_hf), rename, strict)
        exclude = self.exclude_from_loading if exclude is None else list(exclude)
        include, patterns, skip_state = self._selection(exclude)
        self._wait_for_daemon(self.daemon_timeout if daemon_timeout is None else daemon_timeout)
        try:
            restored = self._load(step, exclude, include, patterns, skip_state, strict, cast)
        except BaseException:
            # A notebook re-runs the cell with a new manager: no session of this one may stand
            # in its way. (What was restored before the failure stays in the tensors: a failed
            # load leaves the model in no defined state; load again or rebuild it.)
            self._release()
            raise
        self._loaded = True
        return restored

    def _load(self, step, exclude, include, patterns, skip_state, strict, cast=False):
        created = [] if "optimizer" in exclude else self._create_optimizer_state()
        try:
            self._register_current_tensors()
            info = self._client.restore(step, include=include, exclude=patterns,
                                        allow_missing=not strict, cast=bool(cast))
        except ckptd.Error as e:
            self._drop_optimizer_state(created)
            if isinstance(e, ckptd.Unavailable):
                self._lost(e)
            advice = _advice.restore_advice(str(e))
            raise CheckpointError(f"cannot load job {self.job!r} rank {self.rank}: {e}"
                                  + (f"\n  what to do: {advice}" if advice else "")) from e
        if not info["found"]:
            self._drop_optimizer_state(created)
            if info["other_jobs"] and step is None:
                near = _advice.closest(self.job, info["other_jobs"])
                warnings.warn(f"ckptd: job {self.job!r} has no checkpoint on this node; starting "
                              f"from scratch. Jobs that do: {', '.join(map(repr, near))}"
                              f"{' ...' if len(info['other_jobs']) > len(near) else ''} "
                              "(a misspelt job name?)", stacklevel=_user_stacklevel())
            return None
        for warning in info["warnings"]:  # a newer step was damaged: never a silent fallback
            warnings.warn(f"ckptd: {warning}", stacklevel=_user_stacklevel())
        for side, names in (("not in the checkpoint", info["not_in_checkpoint"]),
                            ("in the checkpoint but not in the model", info["not_registered"])):
            if names:
                warnings.warn(f"ckptd: step {info['step']}: {len(names)} tensors {side} were "
                              f"skipped (strict=False): {', '.join(names[:8])}"
                              f"{', ...' if len(names) > 8 else ''}", stacklevel=_user_stacklevel())
        saved_world = info["saved_world_size"]
        resharded = None
        if saved_world and saved_world != self.world_size:
            resharded = {"saved_world_size": saved_world, "world_size": self.world_size, "rank": self.rank,
                         "from_rank": self.rank if self.rank < saved_world else 0}
            self._warn_resharded_state(info["step"], saved_world, skip_state)
        try:
            self._apply_train_state(info["train_state"], skip_state, resharded)
        except (pickle.UnpicklingError, RuntimeError, ValueError, EOFError) as e:
            raise CheckpointError(f"cannot load job {self.job!r} rank {self.rank}: step "
                                  f"{info['step']}'s train state is not usable: {e}") from e
        restored = Restored(info["step"], info["source"], info["bytes"],
                            saved_world if saved_world and saved_world != self.world_size else None)
        log.info("ckptd: job %r rank %d: %s", self.job, self.rank, restored.describe())
        self.restored = {"step": restored.step, "source": restored.source, "bytes": restored.bytes,
                         "resharded_from": restored.resharded_from}
        self._run = info["step"]
        return restored

    def _warn_resharded_state(self, step, saved_world, skip_state):
        """On another world size, ranks the save did not have get rank 0's train state: a
        dataloader or sampler would then read rank 0's share of the data. Said once (rank 0),
        naming the objects and the ranks, unless each object decides for itself."""
        blind = [name for name, obj in self.extra_state.items()
                 if not torch.is_tensor(obj) and not hasattr(obj, "reshard_state_dict")
                 and f"extra.{name}" not in skip_state]
        if self.rank != 0 or not blind:
            return
        if self.world_size > saved_world:
            who = (f"ranks {saved_world}-{self.world_size - 1} get rank 0's" if self.world_size - saved_world > 1
                   else f"rank {saved_world} gets rank 0's")
        else:
            who = f"the state of ranks {self.world_size}-{saved_world - 1} is not loaded by any rank"
        warnings.warn(
            f"ckptd: step {step} was saved by {saved_world} ranks and is loaded by {self.world_size}: "
            f"{who} extra_state {', '.join(map(repr, blind))}. Give such an object a "
            "reshard_state_dict(state, saved_world_size, world_size, rank, from_rank) method that "
            "returns the state to load, or leave it out with exclude_from_loading.",
            stacklevel=_user_stacklevel())

    def _selection(self, exclude):
        """Maps `load(exclude=...)` keys onto ckptd's tensor selection: (include patterns,
        exclude patterns, train-state prefixes to leave alone)."""
        include, patterns, skip_state = [], [], []
        for key in exclude:
            if key == "model":
                include.append("optim.*")  # model tensors are every name outside optim.
            elif key == "optimizer":
                patterns.append("optim.*")
                skip_state.append("optim")
            elif key == "lr_scheduler":
                skip_state.append("lr_scheduler")
            elif key in ("rng", "train_state"):
                skip_state.append("rng")
            elif key in self.extra_state:
                skip_state.append(f"extra.{key}")
                if torch.is_tensor(self.extra_state[key]):
                    patterns.append(f"extra.{key}")
            elif isinstance(key, str) and key:
                patterns.append(key)
            else:
                raise ValueError(f"exclude: {key!r} is neither a key (model, optimizer, "
                                 f"lr_scheduler, rng, an extra_state name) nor a tensor pattern")
        if "model" in exclude and "optimizer" in exclude:
            raise ValueError("exclude: with both model and optimizer excluded there is no tensor to load")
        return include, patterns, skip_state

    def _load_from_dcp(self, path, step):
        if step is None:
            match = re.search(r"step[-_]?(\d+)$", os.path.basename(os.path.normpath(path)))
            if match is None:
                raise CheckpointError(f"{path}: no step in the directory's name; pass step=")
            step = int(match.group(1))
        if isinstance(self.model, _parts.ModelParts):
            raise CheckpointError("load(from_dcp=) takes one model: with several model parts, "
                                  "load the DCP checkpoint with a manager per part")
        try:
            import ckptd.dcp  # noqa: F401 - first: says when this PyTorch cannot read DCP
            from torch.distributed.checkpoint.api import CheckpointException
            from ckptd._from_dcp import load_into
        except ImportError as e:
            raise CheckpointError(f"cannot load DCP checkpoint {path}: {e}") from e
        self.wait_staged()
        try:
            load_into(path, self.model, self.optimizer, self.lr_scheduler, self.extra_state)
        except CheckpointException as e:  # a BaseException: each rank's failure inside
            # Each rank's failure is (exception, its traceback summary).
            why = "; ".join(str(f[0] if isinstance(f, tuple) else f) for f in e.failures.values())
            raise CheckpointError(f"cannot load DCP checkpoint {path}: {why}") from e
        except Exception as e:
            raise CheckpointError(f"cannot load DCP checkpoint {path}: {e}") from e
        log.info("ckptd: loaded step %d from the DCP checkpoint %s", step, path)
        self._run = step
        self._loaded = True
        return step

    def list_checkpoints(self, job=None):
        """This job's committed checkpoints (or `job`'s, e.g. "<job>-weights") that the node's
        ckptd holds, oldest first: dicts with "step", "tiers" (of "memory", "local",
        "remote"), "bytes", "world_size", "tensors", "unix_time", "flags" ("ephemeral",
        "weights-only"; none for a full checkpoint) and "error" (a step whose manifest
        cannot be read says why). A tier that cannot be listed is a warning naming it."""
        try:
            listed, errors = ckptd.list_checkpoints(self.socket, job or self.job)
        except ckptd.Error as e:
            raise CheckpointError(f"cannot list the checkpoints of job {job or self.job!r}: {e}") from e
        for error in errors:
            warnings.warn(f"ckptd: {error}", stacklevel=_user_stacklevel())
        return listed

    def _load_from_hf(self, path, rename, strict):
        """A warm start: the model's weights from a Hugging Face folder (what `ckptctl export`
        writes, or a hub download), each cast to its parameter's dtype; the optimizer and the
        rest of the train state are left as they are (there are none in such a folder)."""
        from ckptd import _from_hf
        rules = dict(rename or {})
        _from_hf.check_rules(rules)
        self.wait_staged()
        tensors = _from_hf.read_folder(path)
        wanted = dict(_named_parameters(self.model))
        for name, module, leaf in _persistent_buffers(self.model):
            wanted.setdefault(name, module._buffers[leaf])
        aliases = _aliases(self.model)  # a tied name fills the one tensor behind both
        loaded, unexpected, nbytes = set(), [], 0
        for name, tensor in sorted(tensors.items()):
            key = _from_hf.rename(name, rules)
            if key is None:
                continue
            key = aliases.get(key, key)
            if key not in wanted:
                unexpected.append(name)
                continue
            target = wanted[key]
            if _placement.is_dtensor(target):
                raise CheckpointError(f"load(from_hf={path!r}): {key} is sharded (DTensor, FSDP): "
                                      "load the weights before sharding the model")
            if tuple(tensor.shape) != tuple(target.shape):
                raise CheckpointError(f"load(from_hf={path!r}): {name} is {list(tensor.shape)} in the "
                                      f"folder, {key} is {list(target.shape)} in the model")
            with torch.no_grad():
                target.copy_(tensor)  # cast to the parameter's dtype
            loaded.add(key)
            nbytes += target.numel() * target.element_size()
        missing = sorted(set(wanted) - loaded)
        if missing or unexpected:
            what = "; ".join(part for part in (
                f"{len(missing)} of the model's tensors are not in it ({', '.join(missing[:5])}"
                f"{', ...' if len(missing) > 5 else ''})" if missing else "",
                f"{len(unexpected)} of its tensors are not in the model ({', '.join(unexpected[:5])}"
                f"{', ...' if len(unexpected) > 5 else ''})" if unexpected else "") if part)
            if strict:
                raise CheckpointError(f"load(from_hf={path!r}): {what}. What to do: rename=... maps "
                                      "the folder's names onto the model's (as ckptctl export "
                                      "--rename), or strict=False loads what matches")
            warnings.warn(f"ckptd: load(from_hf={path!r}) (strict=False): {what}", stacklevel=_user_stacklevel())
        restored = Restored(0, "hf", nbytes)
        log.info("ckptd: job %r rank %d: loaded %d tensors (%d bytes) from the Hugging Face folder %s",
                 self.job, self.rank, len(loaded), nbytes, path)
        self.restored = {"step": 0, "source": "hf", "bytes": nbytes, "resharded_from": None}
        return restored

    def save_weights(self, step, dtype=None, job=None):
        """A weights-only checkpoint: the model's parameters and persistent buffers (no
        optimizer, no train state), every floating-point tensor converted to `dtype` (for
        example torch.bfloat16; None keeps each dtype), as the job `job` (default
        "<job>-weights"), so the training job's own steps, retention and restore are left
        alone. What a final save for inference or fine-tuning wants (torchtitan's
        model_weights_only with export_dtype). Every rank calls it, like save(); returns
        once the checkpoint is committed on every rank, raising CheckpointError otherwise.
        Sharded parameters (DTensor, FSDP2) keep their placement."""
        self._check_open()
        self.wait_staged()
        name = job or f"{self.job}-weights"
        try:
            client = ckptd.connect(self.socket, name, self.rank, self.world_size, self.arena_bytes)
        except ckptd.Error as e:
            raise CheckpointError(f"weights of step {step} not saved: {e}") from e
        try:
            fsdp_params = _placement.fsdp2_params(self.model)
            tensors = [_Entry(n, p, None) for n, p in _named_parameters(self.model)]
            tensors += [_Entry(n, m._buffers[leaf], None) for n, m, leaf in _persistent_buffers(self.model)]
            for e, part in _fsdp1.split(self.model, None, tensors, CheckpointError):
                key = e.name
                part = part or _placement.local_part(key, e.tensor, None, fsdp_params, CheckpointError)
                source = part.tensor
                if source.numel() == 0:
                    continue
                out = dtype if dtype is not None and source.is_floating_point() else source.dtype
                if part.flat:  # a piece of an FSDP1 flat parameter
                    buffer = client.allocate_flat(key, _dtype_name(key, out), part.global_shape, part.flat)
                else:
                    buffer = client.allocate(key, _dtype_name(key, out), list(source.shape), part.global_shape,
                                             part.global_offset)
                target = torch.frombuffer(buffer, dtype=torch.uint8).view(out).view(source.shape)
                with torch.no_grad():
                    target.copy_(source)
            client.register()
            ticket = client.snapshot(int(step), {**self._metadata(), "weights_only": "1"}, {})
            status = client.wait_committed(ticket)
        except ckptd.Error as e:
            raise CheckpointError(f"weights of step {step} not saved: {e}") from e
        finally:
            try:
                client.unregister()
            except ckptd.Error:
                pass  # the session ends with the process anyway
        if status["state"] != "committed":
            raise CheckpointError(f"weights of step {step}: {status['state']}: {status['error']}")
        return name

    def close(self):
        """Waits until the latest snapshot is staged and leaves ckptd (which still commits
        it). The tensors stay usable. A manager still open when the interpreter exits is
        closed then (docs/python.md, "At exit")."""
        self._close(at_exit=False)

    def _close(self, at_exit):
        _open_managers.discard(self)
        if self._closed:
            return
        self._staged()
        if self._preemption is not None:
            if at_exit:
                self._preemption.uninstall()
            else:
                self._preemption.close()
        if self._client is not None:
            try:
                self._client.unregister()
            except ckptd.Error as e:
                log.warning("ckptd: unregister: %s", e)
        self._client = None
        self._closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    # --- connection ---------------------------------------------------------------------

    def _check_open(self):
        if self._closed:
            raise CheckpointError("this CheckpointManager is closed")

    def _connected(self):
        """Whether there is a client, connecting if ckptd is there. Never holds up training
        for an absent daemon: a socket nobody listens on fails at once, and an attempt that
        takes longer than _CONNECT_PATIENCE_SECONDS goes on in the background, adopted at a
        later save."""
        if self._client is not None:
            return True
        if self._connector is not None:
            if not self._connector.done(timeout=0):
                return False
            return self._adopt()
        if time.monotonic() < self._retry_after:
            return False
        if not _listening(self.socket):
            self._lost(ckptd.Unavailable(f"nothing listens at {self.socket}"))
            return False
        self._connector = _Connector(self._connect)
        if not self._connector.done(timeout=_CONNECT_PATIENCE_SECONDS):
            return False
        return self._adopt()

    def _adopt(self):
        connector, self._connector = self._connector, None
        if connector.error is not None:
            self._lost(connector.error)
            return False
        self._client = connector.client
        self._registered = False
        return True

    def _wait_for_daemon(self, timeout):
        deadline = time.monotonic() + timeout
        while True:
            self._retry_after = 0.0  # load() asks now, whatever the save path last saw
            # load() raises instead of warning. Not warnings.catch_warnings: it swaps
            # process-wide state, and with trainer threads (one per rank) interleaving their
            # enter and exit it can leave warnings switched off for the whole process.
            self._quiet = True
            try:
                if self._connected():
                    return
                if self._connector is not None:  # slow to answer: give it what time is left
                    self._connector.done(timeout=max(0.0, deadline - time.monotonic()))
                    if self._connected():
                        return
            finally:
                self._quiet = False
            if time.monotonic() >= deadline:
                self._retry_after = 0.0  # the next save tries (and warns) again
                raise CheckpointError(
                    f"cannot load job {self.job!r}: ckptd is not reachable at {self.socket} "
                    f"(waited {timeout:g} s). Not starting from scratch while a checkpoint may "
                    "exist: start ckptd, or raise daemon_timeout; to train without ckptd, "
                    "catch this error")
            time.sleep(min(0.25, max(0.0, deadline - time.monotonic())))

    def _connect(self):
        return ckptd.connect(self.socket, self.job, self.rank, self.world_size, self.arena_bytes,
                             keep_last=self.keep_last or 0, copy_on_write=self.copy_on_write,
                             upload_every_steps=self.upload_every_steps,
                             upload_interval_seconds=self.upload_interval_seconds)

    def _unreachable(self, error):
        """ckptd stopped answering a registered client: keep it (a stalled ckptd that resumes
        still holds the session; after a restart the client registers again by itself) and
        miss saves until then, warning once per outage."""
        if not self._registered:
            self._lost(error)
            return
        self._abandon()
        self._unstaged = None
        if not self._outage and not self._quiet:
            warnings.warn(f"ckptd unavailable, training continues without checkpoints until it "
                          f"is back: {error}", RuntimeWarning, stacklevel=_user_stacklevel())
        self._outage = True

    def _abandon(self):
        """The tensors may change from now on without a staged snapshot: ckptd must not
        commit the one it has not copied yet."""
        if self._client is not None and self._unstaged is not None:
            try:
                self._client.abandon_pending()
            except ckptd.Error:
                pass

    def _release(self):
        """Leaves ckptd's session (if any) without waiting: what a failed load() does. The
        tensors stay usable; the next save or load registers afresh."""
        if self._client is not None:
            try:
                self._client.unregister()
            except ckptd.Error:
                pass  # gone already: nothing of it is left to release
        self._client = None
        self._registered = False
        self._unstaged = None
        self._last_ticket = None

    def _lost(self, error):
        self._abandon()
        if not self._quiet:
            warnings.warn(f"ckptd unavailable, training continues without checkpoints: {error}",
                          RuntimeWarning, stacklevel=_user_stacklevel())
        self._client = None
        self._unstaged = None
        self._retry_after = time.monotonic() + _RECONNECT_SECONDS

    # --- what is registered -------------------------------------------------------------

    def _collect(self):
        """Every tensor to checkpoint, in a stable order, with how to replace its storage."""
        entries, seen = [], set()
        for name, p in _named_parameters(self.model):
            seen.add(id(p))
            entries.append(_Entry(name, p, functools.partial(_set_data, p)))
        for name, module, leaf in _persistent_buffers(self.model):
            b = module._buffers[leaf]
            if id(b) not in seen:
                seen.add(id(b))
                entries.append(_Entry(name, b, functools.partial(_set_buffer, module, leaf)))
        for name, t in self._extra_tensors():
            entries.append(_Entry(f"extra.{name}", t, functools.partial(_set_data, t)))
        if self.optimizer is not None:
            for owner, p in self._optimizer_params(_param_names(self.model)):
                state = self.optimizer.state.get(p, {})
                for key in sorted(state):
                    if torch.is_tensor(state[key]):
                        entries.append(_Entry(f"optim.{owner}.{key}", state[key],
                                              functools.partial(_set_item, state, key)))
        return entries

    def _fingerprint(self):
        """Where every tensor to checkpoint lives, in _collect's order, cheaply: a save only
        compares this with the registered one (thousands of tensors in about a millisecond).
        It changes when tensors appear (optimizer state after the first step) or move
        (`optimizer.load_state_dict`, `model.to(...)`, a replaced `.data`)."""
        addresses = [(_placement.storage_address(t), t.shape) for t in self._slots_model()]
        addresses += [(_placement.storage_address(t), t.shape) for _, t in self._extra_tensors()]
        if self.optimizer is not None:
            state = self.optimizer.state
            for p in self._optimizer_param_list:
                for key, value in sorted(state.get(p, {}).items()):
                    if torch.is_tensor(value):
                        addresses.append((_placement.storage_address(value), value.shape))
        return addresses

    def _extra_tensors(self):
        """extra_state values that are tensors: registered like parameters (any size, in
        shared memory), not pickled into the train state."""
        return [(name, obj) for name, obj in self.extra_state.items() if torch.is_tensor(obj)]

    def _slots_model(self):
        for p in self._model_params:
            yield p
        for module, leaf in self._buffer_slots:
            b = module._buffers.get(leaf)
            if b is not None:
                yield b

    def _register_current_tensors(self):
        """Registers the current tensors; registers again when they changed (optimizer state
        appears after the first step, or tensors were replaced). Host tensors move into
        shared memory once."""
        if self._registered and self._fingerprint() == self._registered_fingerprint:
            return
        parts = self._parts(self._collect())
        if self._registered and self._update_changed(parts):
            self._note_registered()
            return
        if self._registered:
            self._client.unregister()
            self._client = self._connect()
        uses_cuda = uses_host = False
        for e, part in parts:
            t = part.tensor
            dtype = _dtype_name(e.name, t.dtype)
            if t.is_cuda:
                if not t.is_contiguous():
                    raise CheckpointError(f"tensor {e.name}: CUDA tensors must be contiguous")
                self._client.add_cuda(e.name, dtype, list(t.shape), t.data_ptr(),
                                      part.global_shape, part.global_offset)
                uses_cuda = True
            elif t.device.type != "cpu":
                raise CheckpointError(f"tensor {e.name}: {t.device} tensors are not supported")
            elif t.numel() > 0:
                _move_to_arena(self._client, e.name, dtype, part)
                uses_host = True
        self._client.register()
        self._uses_cuda, self._uses_host = uses_cuda, uses_host
        if uses_cuda:
            self._client.set_cuda_stream(torch.cuda.current_stream().cuda_stream)
        self._note_registered()

    def _parts(self, entries):
        """Each entry with its local part (what this rank registers of it), in order; an FSDP1
        FlatParameter and its optimizer state become one entry per original parameter."""
        fsdp_params = _placement.fsdp2_params(self.model)
        return [(e, part or _placement.local_part(e.name, e.tensor, e.replace, fsdp_params, CheckpointError))
                for e, part in _fsdp1.split(self.model, self.optimizer, entries, CheckpointError)]

    @staticmethod
    def _where(parts):
        """What registration sends of each part: name -> (storage address, shape, on a GPU),
        as the fingerprint sees them."""
        return {e.name: (_placement.storage_address(p.tensor), p.tensor.shape, p.tensor.is_cuda)
                for e, p in parts if p.tensor.numel() > 0 or p.tensor.is_cuda}

    def _update_changed(self, parts):
        """Registers only what changed since the registration (an embedding table that grew,
        optimizer state that appeared): host tensors that are new or moved go into shared
        memory and one Update() call; the rest stay registered. False when that cannot be
        done (a GPU tensor changed): then everything is registered again."""
        where = self._where(parts)
        before = self._registered_where
        changed = [(e, p) for e, p in parts if e.name in where and where[e.name] != before.get(e.name)]
        removed = [name for name in before if name not in where]
        if any(where[e.name][2] for e, _ in changed) or any(before[n][2] for n in removed):
            return False
        for e, part in changed:
            if part.tensor.device.type != "cpu":
                return False  # the full registration names the device it cannot take
            _move_to_arena(self._client, e.name, _dtype_name(e.name, part.tensor.dtype), part)
        try:
            for name in removed:
                self._client.remove(name)
            self._client.update()
        except ckptd.Unavailable:
            raise
        except ckptd.Error as e:  # refused (busy, a budget): a new session with everything
            log.warning("ckptd: updating the registration failed (%s); registering again", e)
            return False
        self._uses_host = self._uses_host or bool(changed)
        self.updates += 1
        return True

    def _note_registered(self):
        self._model_params = list(self.model.parameters())
        self._buffer_slots = [(module, leaf) for _, module, leaf in _persistent_buffers(self.model)]
        self._param_names = _param_names(self.model)
        self._optimizer_param_list = ([p for g in self.optimizer.param_groups for p in g["params"]]
                                      if self.optimizer is not None else [])
        self._aliases = _aliases(self.model)
        self._registered = True
        self._registered_fingerprint = self._fingerprint()
        self._registered_where = self._where(self._parts(self._collect()))  # after the moves

    # --- train state ----------------------------------------------------------------------

    def _metadata(self):
        metadata = {"framework": "torch", "torch_version": torch.__version__}
        if self._aliases:  # tied parameters: every name a state dict has (docs/format.md)
            aliases = json.dumps(self._aliases, sort_keys=True)
            if len(aliases) <= _MAX_ALIASES_BYTES:  # else DCP sees each tensor under one name
                metadata["ckptd.aliases"] = aliases
        return metadata

    def _train_state(self, step):
        state = {
            "step": pickle.dumps(int(step)),
            "rng.torch": torch.get_rng_state().numpy().tobytes(),
            "rng.python": pickle.dumps(random.getstate()),
        }
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["rng.cuda"] = _to_bytes(torch.cuda.get_rng_state_all())
        if self.optimizer is not None:
            groups = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
            other = {name: {k: v for k, v in self.optimizer.state.get(p, {}).items() if not torch.is_tensor(v)}
                     for name, p in self._optimizer_params()}
            state["optim.param_groups"] = _to_bytes(groups)
            # Which parameters each group holds, by key: what DCP's optimizer state dicts
            # (get_state_dict) call "params", so that ckptd.dcp can offer them.
            # Left out where it would crowd the command (a model of tens of thousands of
            # parameters): DCP then reads the optimizer's tensors but not its groups.
            names = iter(name for name, _ in self._optimizer_params())
            param_names = pickle.dumps(
                [list(itertools.islice(names, len(g["params"]))) for g in self.optimizer.param_groups])
            if len(param_names) <= _MAX_PARAM_NAMES_BYTES:
                state["optim.param_names"] = param_names
            state["optim.other_state"] = _to_bytes({k: v for k, v in other.items() if v})
        if self.lr_scheduler is not None:
            state["lr_scheduler"] = _to_bytes(self.lr_scheduler.state_dict())
        for name, obj in self.extra_state.items():
            if not torch.is_tensor(obj):
                state[f"extra.{name}"] = self._extra_bytes(name, obj)
        return state

    def _extra_bytes(self, name, obj):
        """An extra_state entry as train state. The first save of each checks that it reads
        back (as load() will read it: data only): a value that saves but can never be loaded
        is refused now, naming it, not found out at the restart."""
        value = obj.state_dict() if hasattr(obj, "state_dict") else obj
        if name in self._extra_checked:
            return _to_bytes(value)
        try:
            data = _to_bytes(value)
            _from_bytes(data)
        except Exception as e:  # what torch.save cannot write, or its weights-only reader refuses
            raise CheckpointError(f"extra_state[{name!r}] holds something a checkpoint cannot load "
                                  f"back as plain data ({type(e).__name__}: {str(e).splitlines()[0]}): "
                                  "keep to tensors, numbers, strings, lists and dicts") from e
        self._extra_checked.add(name)
        return data

    def _apply_train_state(self, state, skip=(), resharded=None):
        """Applies the saved train state, except the entries under a prefix in `skip`
        ("optim", "lr_scheduler", "rng", "extra.<name>": what load(exclude=) leaves alone)."""
        state = {k: v for k, v in state.items() if not any(k == p or k.startswith(p + ".") for p in skip)}
        skipped = set(skip)
        if "rng.torch" in state:
            torch.set_rng_state(torch.frombuffer(bytearray(state["rng.torch"]), dtype=torch.uint8))
        if "rng.python" in state:
            random.setstate(_plain_loads(state["rng.python"]))
        if "rng.cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(_from_bytes(state["rng.cuda"]))
        if self.optimizer is not None and "optim.param_groups" in state:
            groups = _from_bytes(state["optim.param_groups"])
            if len(groups) != len(self.optimizer.param_groups):
                raise CheckpointError(f"the checkpoint has {len(groups)} optimizer parameter groups, "
                                      f"the optimizer {len(self.optimizer.param_groups)}")
            for group, saved in zip(self.optimizer.param_groups, groups):
                group.update(saved)
            other = _from_bytes(state["optim.other_state"]) if "optim.other_state" in state else {}
            for name, p in self._optimizer_params():
                self.optimizer.state[p].update(other.get(name, {}))
        if self.lr_scheduler is not None and "lr_scheduler" not in skipped:
            if "lr_scheduler" not in state:
                raise CheckpointError("the checkpoint has no LR scheduler state")
            self.lr_scheduler.load_state_dict(_from_bytes(state["lr_scheduler"]))
        for name, obj in self.extra_state.items():
            key = f"extra.{name}"
            if key in skipped or torch.is_tensor(obj):  # a tensor came back with the tensors
                continue
            if key not in state:
                raise CheckpointError(f"the checkpoint has no extra_state[{name!r}]")
            value = _from_bytes(state[key])
            if resharded is not None and hasattr(obj, "reshard_state_dict"):
                value = obj.reshard_state_dict(value, **resharded)
            _load_extra(name, obj, value)

    def _optimizer_params(self, names=None):
        """(name, parameter) for every optimizer parameter: its name in the model, else
        group<g>.param<i>. `names` defaults to the names cached at registration."""
        if names is None:
            names = self._param_names if self._registered else _param_names(self.model)
        for g, group in enumerate(self.optimizer.param_groups):
            for i, p in enumerate(group["params"]):
                yield names.get(id(p), f"group{g}.param{i}"), p

    # --- optimizer state for a fresh optimizer ------------------------------------------

    def _create_optimizer_state(self):
        """Optimizers create their state at the first step; a checkpoint can only be restored
        into state that exists. Runs one step with zero gradients and a learning rate of 0
        (parameters are overwritten by the restore anyway). Returns the parameters whose
        state was created, to drop again if there is nothing to restore."""
        if self.optimizer is None:
            return []
        # Frozen parameters get no state from a real step: none is created for them either.
        params = [p for _, p in self._optimizer_params()
                  if p.requires_grad and not self.optimizer.state.get(p)]
        if not params:
            return []
        saved_grads = {id(p): p.grad for p in params}
        saved_lrs = [g.get("lr") for g in self.optimizer.param_groups]
        with torch.no_grad():
            for p in params:
                p.grad = torch.zeros_like(p)
            for g in self.optimizer.param_groups:
                if "lr" in g:
                    g["lr"] = 0.0
            try:
                self._original_step()
            finally:
                for g, lr in zip(self.optimizer.param_groups, saved_lrs):
                    if lr is not None:
                        g["lr"] = lr
                for p in params:
                    p.grad = saved_grads[id(p)]
        return params

    def _drop_optimizer_state(self, params):
        for p in params:
            self.optimizer.state.pop(p, None)

    # --- hooks --------------------------------------------------------------------------

    def _install_hooks(self):
        """Nothing may change a registered tensor before ckptd has copied it."""
        for module in _parts.modules(self.model):
            module.register_forward_pre_hook(lambda module, inputs: self.wait_staged())
        steps = [self._hook_step(o) for o in _parts.optimizers(self.optimizer)]
        # The optimizers' steps without the wait (_create_optimizer_state runs them).
        self._original_step = (lambda: [step() for step in steps]) if steps else None

    def _hook_step(self, optimizer):
        """Makes `optimizer.step` wait for the latest snapshot's copy; returns its own step."""
        step = optimizer.step
        if hasattr(optimizer, "register_step_pre_hook"):  # PyTorch >= 2.0
            optimizer.register_step_pre_hook(lambda optimizer, args, kwargs: self.wait_staged())
            return step

        @functools.wraps(step)  # keeps the LR scheduler's step counter attributes
        def step_after_staged(*args, **kwargs):
            self.wait_staged()
            return step(*args, **kwargs)

        optimizer.step = step_after_staged
        return step


def _check_extra(name, obj):
    """What extra_state may hold: an object with state_dict()/load_state_dict(), a tensor
    (registered like a parameter), or a dict or list (its contents restored in place)."""
    if torch.is_tensor(obj) or isinstance(obj, (dict, list)):
        return
    if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
        raise TypeError(f"extra_state[{name!r}] is a {type(obj).__name__}: pass an object with "
                        "state_dict()/load_state_dict(), a tensor, or a dict or list (restored in "
                        "place); a number or string cannot be restored in place: wrap it in a dict")


def _load_extra(name, obj, value):
    if isinstance(obj, dict):
        if not isinstance(value, dict):
            raise CheckpointError(f"extra_state[{name!r}]: the checkpoint holds a {type(value).__name__}, not a dict")
        obj.clear()
        obj.update(value)
    elif isinstance(obj, list):
        if not isinstance(value, list):
            raise CheckpointError(f"extra_state[{name!r}]: the checkpoint holds a {type(value).__name__}, not a list")
        obj[:] = value
    else:
        obj.load_state_dict(value)

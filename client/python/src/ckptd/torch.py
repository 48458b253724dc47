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
from ckptd import _advice, _files, _fsdp1, _model_only, _parts, _placement, _shapes
from ckptd._connection import _Connector, _DaemonWait, _env_int, _listening, _user_stacklevel
from ckptd._errors import CheckpointError
from ckptd._preemption import PreemptionSaver
from ckptd._restored import Restored
from ckptd._state_dict import (_aliases, _Entry, _dtype_name, _move_to_arena, _named_parameters, _param_names,
                               _persistent_buffers, _set_buffer, _set_data, _set_item)
from ckptd._train_state import _bytesio_in, _bytesio_out, _from_bytes, _plain_loads, _to_bytes

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
                 copy_on_write=False, upload_every_steps=None, upload_interval_seconds=None, frozen=True):
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
        self._lost_error = None     # why the latest connection was lost (_lost)
        self._unstaged = None       # a ticket whose tensors must not be mutated yet
        self._last_ticket = None
        self._run = 0               # the step this run resumed from: names its save clock
        self.restored = None        # what the latest load() restored (a Restored), None if nothing
        # Another source loads when ckptd holds nothing of the job (the torchtitan integration,
        # which then says what _warn_near_jobs says itself if that finds nothing either).
        self._fallback = False
        self._near_jobs = []        # this user's jobs of a close name, when a load found nothing
        self._warned_near = False
        self._loaded = False        # load() restored (or found nothing): this run continues the job
        self._checked_run = False   # the first save looked at what the job already holds
        self._registered_where = {}  # see _where
        self._aliases = {}          # tied parameters' other names (_state_dict._aliases)
        self._extra_checked = set()  # extra_state entries seen to read back (_extra_bytes)
        self._shapes_record = None  # the model tensors' global shapes, as a save records them
        self.restored_files = {}    # the files the last load() gave back (read_file)
        self.updates = 0            # partial re-registrations (_update_changed), for tests
        # Parameters with requires_grad=False are registered frozen (docs/python.md, "Frozen
        # parameters"); frozen=False copies every tensor at every save.
        self.frozen = frozen
        self._frozen = frozenset()  # registered tensors ckptd holds frozen (_sync_frozen)
        self._frozen_versions = {}  # their torch version counters when last frozen
        self._named_model_params = []
        self._closed = False
        self._install_hooks()
        # SIGTERM (preemption): the next maybe_save() saves and stages, then the stop goes on.
        # Not given: $CKPTD_SAVE_ON_SIGTERM decides (set by deploy/kubernetes' manifests).
        if save_on_sigterm is None:
            save_on_sigterm = _environment_flag("CKPTD_SAVE_ON_SIGTERM")
        self._preemption = PreemptionSaver() if save_on_sigterm else None
        _open_managers.add(self)

    # --- public API ---------------------------------------------------------------------

    def maybe_save(self, step, files=None):
        """Saves when `interval_steps` or `interval_seconds` says so; returns at once.

        Returns True when a snapshot was queued. `files` go with it as with save().
        """
        if self._preemption is not None and self._preemption.requested:
            self._preemption.stop(lambda: self.save(step, files=files) and self._staged())
            return True
        due = self.interval_steps is not None and step % self.interval_steps == 0
        if not due and self.interval_seconds is not None:
            due = self._due_by_time(step)
        return self.save(step, files=files) if due else False

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

    def save(self, step, blocking=False, ephemeral=False, files=None, full=False):
        """Queues a checkpoint of the current state as `step`.

        Returns at once (True) unless `blocking`, which waits until the checkpoint is
        committed on every rank and raises CheckpointError if it is not. Returns False when
        ckptd is unreachable (training goes on; a warning says so). An `ephemeral`
        checkpoint is kept only until a newer step of the job commits: frequent restart
        points that retention (keep_last, keep_every) never counts or keeps.

        `files` ({"config.yaml": bytes, str or a pathlib.Path}) are stored with this rank's
        part of the step, checksummed like its tensors; `ckptctl list` names them,
        `ckptctl export` writes them out, and load() gives them back (read_file). At most
        16 MiB per rank and step (docs/python.md, "Files with a checkpoint").

        With `ckptd --increments on`, a `full` save writes every byte of the step (nothing
        referenced in earlier steps) and starts a new --full-every cycle: a step to keep
        on its own, before a release or a move.
        """
        self._check_open()
        stored_files = _files.encode(files)
        self.wait_staged()
        if not self._connected():
            if blocking:
                raise CheckpointError(f"step {step} not saved: ckptd is not reachable at {self.socket}")
            return False
        try:
            self._register_current_tensors()
            self._sync_frozen()
            self._check_other_run(step)
            metadata = self._metadata()
            if ephemeral:
                metadata["ckptd.ephemeral"] = "1"  # daemon/persist/retention.h
            if full:
                metadata["ckptd.full"] = "1"  # daemon/persist/increment_writer.h
            train_state = self._train_state(step)
            train_state.update(stored_files)
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

    def load(self, step=None, daemon_timeout=None, from_dcp=None, exclude=None, strict=None,
             from_hf=None, rename=None, cast=False, on_shapes=None, resize=False, from_path=None, from_job=None,
             from_dcp_keys=None, require=False):
        """Restores the latest checkpoint (or `step`) in place; returns its step, or None when
        the job has none. Never starts over silently: when ckptd cannot be reached, waits
        for it up to `daemon_timeout` seconds (the manager's, 120 by default) and then
        raises CheckpointError; so does a checkpoint that does not match the model (names
        and shapes are listed) or cannot be read.

        `from_dcp=PATH` loads a torch.distributed.checkpoint directory instead (switching a
        job to ckptd: its next save goes to ckptd); returns `step`, or the step in the
        directory's name (`step-1200`, as torchtitan names them), or in its train_state.
        The model, optimizer, LR scheduler, RNG states and extra_state objects are found in
        the common layouts (DCP's tutorial, torchtitan, get_state_dict's); `from_dcp_keys=
        {"lr_scheduler": "app.sched", "dataloader": "app.loader", "app.ema": None}` maps the
        rest (None: leave that checkpoint key unread). What is not imported is named in one
        warning (`strict=True`: a CheckpointError, before anything is loaded).

        `from_path=DIR` loads a committed step directory (`<root>/<job>/step-NNNNNNNN`, a
        copy of one anywhere, or `s3://bucket/prefix/<job>/step-NNNNNNNN`) from its files,
        in this process; `from_job=NAME` loads the latest step (or `step`) of another job of
        this user through ckptd (a model bank, a warm start). Either way the next save goes to
        this manager's own job.

        `exclude` (default: the manager's `exclude_from_loading`) leaves parts as they are:
        "model", "optimizer" (its tensors and hyper-parameters), "lr_scheduler", "rng", the
        name of an `extra_state` entry, or a shell pattern on tensor names ("layers.0.*",
        "optim.*.exp_avg_sq"). `strict=False` skips tensors that the model has and the
        checkpoint lacks, or the reverse, with a warning naming them (default: strict). A step
        that holds the model only (a seed checkpoint) loads into a manager with an optimizer:
        the optimizer, and any LR scheduler or extra_state the step has nothing for, start
        fresh, with a warning naming them. `cast=True` loads
        floating-point tensors saved in another dtype into the model's (a `save_weights(dtype=
        torch.bfloat16)` step into an FP32 model), rounding as `Tensor.to` does; without it a
        dtype that differs is an error naming the tensors.

        `on_shapes(shapes)` is called before any tensor is restored with {name: torch.Size}, the
        saved global shape of every model tensor (parameter, persistent buffer, extra_state
        tensor), and may resize the model's tensors in place (`param.data = torch.empty(...)`)
        to fit them; the optimizer state of a resized parameter follows, then the step is
        restored into the new shapes. `resize=True` does that for the first dimension
        (embedding tables that grew or shrank: rows). Both need a step saved by this version.

        Returns a `Restored`: the step, an int (so `(manager.load() or 0) + 1` is the next
        step), that also says where it came from: `.source` ("memory", "disk", "remote":
        ckptd's --remote tier, or "peer": rebuilt from its peers' memory), `.bytes`, and `.resharded_from` (the world size it was saved
        with, when that differs from this job's; None otherwise). The same is logged at INFO
        and kept as `manager.restored` (None until a load restored something, and after one
        that found nothing).

        A job without a checkpoint returns None, warning (rank 0, once) only when this user
        has a job of a close name on the node (a misspelt job name?). `require=True` raises
        CheckpointError instead, naming the job, those jobs and where ckptd looked: for a run
        that must resume, never start over.

        A load that raises leaves nothing registered with ckptd (the next save or load, or
        another CheckpointManager of the same job, registers afresh)."""
        self._check_open()
        # Whatever this load writes (ckptd's restore, or another source straight into the
        # registered memory), the frozen parameters' bytes change: the next save freezes them
        # anew, so ckptd copies them once more.
        self._frozen, self._frozen_versions = frozenset(), {}
        if on_shapes is not None and resize:
            raise ValueError("pass on_shapes= or resize=True, not both (resize=True is an on_shapes of its own)")
        if resize:
            on_shapes = lambda shapes: _shapes.resize_first_dimension(self.model, self._extra_tensors(), shapes)
        if on_shapes is not None and not callable(on_shapes):
            raise TypeError(f"on_shapes is called with the saved shapes: a {type(on_shapes).__name__} is not callable")
        if on_shapes is not None and any(x is not None for x in (from_dcp, from_hf, from_path, from_job)):
            raise ValueError("on_shapes= and resize=True apply to this job's own steps, not to from_dcp=, "
                             "from_hf=, from_path= or from_job=")
        if sum(x is not None for x in (from_dcp, from_hf, from_path, from_job)) > 1:
            raise ValueError("load(): from_dcp, from_hf, from_path and from_job name one source; pass one")
        if from_dcp_keys is not None and from_dcp is None:
            raise ValueError("load(): from_dcp_keys maps the keys of a from_dcp= checkpoint; pass from_dcp=")
        if from_dcp is not None:
            exclude = self.exclude_from_loading if exclude is None else list(exclude)
            return self._load_from_dcp(os.fspath(from_dcp), step, from_dcp_keys, exclude, strict)
        strict = True if strict is None else strict
        if from_hf is not None:
            return self._load_from_hf(os.fspath(from_hf), rename, strict)
        exclude = self.exclude_from_loading if exclude is None else list(exclude)
        include, patterns, skip_state = self._selection(exclude)
        if from_path is not None:
            return self._load_from_path(os.fspath(from_path), step, exclude, include, patterns, skip_state,
                                        strict, cast)
        if from_job is not None:
            return self._load_from_job(from_job, step, daemon_timeout, exclude, include, patterns,
                                       skip_state, strict, cast)
        self._wait_for_daemon(self.daemon_timeout if daemon_timeout is None else daemon_timeout)
        try:
            restored = self._load(step, exclude, include, patterns, skip_state, strict, cast, on_shapes, require)
        except BaseException:
            # A notebook re-runs the cell with a new manager: no session of this one may stand
            # in its way. (What was restored before the failure stays in the tensors: a failed
            # load leaves the model in no defined state; load again or rebuild it.)
            self._release()
            raise
        self._loaded = True
        return restored

    def _nothing_found(self, step, other_jobs, require):
        """What load() does when the job has no checkpoint (at `step`): None, with a warning
        (rank 0, once) when this user has jobs of a close name (a misspelt job?) unless another
        source loads next (the torchtitan integration says so then); with `require`, raises."""
        self.restored = None
        self._near_jobs = _advice.close_jobs(self.job, other_jobs)
        near = (f"; this user's jobs with a similar name that do: {', '.join(map(repr, self._near_jobs))} "
                "(a misspelt job name?)" if self._near_jobs else "")
        if require:
            what = f"step {step}" if step is not None else "checkpoint"
            raise CheckpointError(
                f"cannot load job {self.job!r}: it has no {what} in the ckptd at {self.socket} (its memory, "
                f"its disk and its remote tier, if it has one; `ckptctl list` shows every job there){near}. "
                "load(require=True) is for a run that must resume; a new job's first run has "
                "nothing to load")
        if step is None and not self._fallback:
            self._warn_near_jobs()
        return None

    def _warn_near_jobs(self):
        """The misspelt-job warning of the latest load() that found nothing: said once, by rank
        0, and only when this user has a job of a close name."""
        if self._near_jobs and self.rank == 0 and not self._warned_near:
            self._warned_near = True
            warnings.warn(f"ckptd: job {self.job!r} has no checkpoint on this node; this user has "
                          f"checkpoints of {', '.join(map(repr, self._near_jobs))} (a misspelt job "
                          "name?). load() returned None; load(require=True) raises instead, for a "
                          "run that must resume", stacklevel=_user_stacklevel())

    def _load(self, step, exclude, include, patterns, skip_state, strict, cast=False, on_shapes=None,
              require=False):
        created = [] if "optimizer" in exclude else self._create_optimizer_state()
        early_warnings = []
        try:
            self._register_current_tensors()
            if on_shapes is not None:
                step, early_warnings = self._resize_to_saved(step, on_shapes)
            info = self._restore(step, include, patterns, strict, cast, with_optimizer="optimizer" not in exclude)
        except ckptd.Error as e:
            self._drop_optimizer_state(created)
            if isinstance(e, ckptd.Unavailable):
                self._lost(e)
            advice = _advice.restore_advice(str(e))
            raise CheckpointError(f"cannot load job {self.job!r} rank {self.rank}: {e}"
                                  + (f"\n  what to do: {advice}" if advice else "")) from e
        if not info["found"]:
            self._drop_optimizer_state(created)
            return self._nothing_found(step, info["other_jobs"], require)
        for warning in early_warnings + list(info["warnings"]):  # a newer step was damaged: never silent
            warnings.warn(f"ckptd: {warning}", stacklevel=_user_stacklevel())
        skip_state = self._model_only(info, created, skip_state, "optimizer" not in exclude)
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
            plain = self._apply_train_state(info["train_state"], skip_state, resharded)
        except (pickle.UnpicklingError, RuntimeError, ValueError, EOFError) as e:
            raise CheckpointError(f"cannot load job {self.job!r} rank {self.rank}: step "
                                  f"{info['step']}'s train state is not usable: {e}") from e
        restored = Restored(info["step"], info["source"], info["bytes"],
                            saved_world if saved_world and saved_world != self.world_size else None)
        restored.extra = plain  # extra_state's plain values, as saved
        log.info("ckptd: job %r rank %d: %s", self.job, self.rank, restored.describe())
        self.restored = restored
        self.restored_files = _files.decode(info["train_state"])
        self._run = info["step"]
        return restored

    def _resize_to_saved(self, step, on_shapes):
        """load(on_shapes=): restores the train state alone (the selection excludes "*") to
        read the saved shapes, lets `on_shapes` resize the model, makes the optimizer state
        follow and registers the new tensors. Returns the step to restore (the one found,
        so that every tensor comes from it) and the warnings of that first restore."""
        try:
            first = self._client.restore(step, include=[], exclude=["*"], allow_missing=False, cast=False)
        except ckptd.Error as e:
            if "selects none" not in str(e):
                raise
            raise CheckpointError(f"cannot load job {self.job!r} with on_shapes= or resize=True: the ckptd at "
                                  f"{self.socket} is older than this client and cannot restore a step's train "
                                  f"state alone ({e}); upgrade ckptd") from e
        if not first["found"]:
            return step, []  # the restore that follows says so
        shapes = _shapes.saved(first["train_state"], first["step"])
        follows = _shapes.OptimizerFollows(self.model, self.optimizer)
        on_shapes(shapes)
        follows.apply()
        self._register_current_tensors()
        return first["step"], list(first["warnings"])

    def _warn_resharded_state(self, step, saved_world, skip_state):
        """On another world size, ranks the save did not have get rank 0's train state: a
        dataloader or sampler would then read rank 0's share of the data. Said once (rank 0),
        naming the objects and the ranks, unless each object decides for itself."""
        blind = [name for name, obj in self.extra_state.items()
                 if not torch.is_tensor(obj) and not hasattr(obj, "reshard_state_dict")
                 and f"extra.{name}" not in skip_state]
        if self.rank != 0 or not blind:
            return
        objects = f"extra_state {', '.join(map(repr, blind))}"
        if self.world_size > saved_world:
            who = (f"ranks {saved_world}-{self.world_size - 1} get rank 0's {objects}"
                   if self.world_size - saved_world > 1 else f"rank {saved_world} gets rank 0's {objects}")
        else:
            ranks = (f"ranks {self.world_size}-{saved_world - 1}" if saved_world - self.world_size > 1
                     else f"rank {self.world_size}")
            who = f"no rank loads the {objects} that {ranks} saved"
        warnings.warn(
            f"ckptd: step {step} was saved by {saved_world} ranks and is loaded by {self.world_size}: "
            f"{who}. Give such an object a "
            "reshard_state_dict(state, saved_world_size, world_size, rank, from_rank) method that "
            "returns the state to load, or leave it out with exclude_from_loading.",
            stacklevel=_user_stacklevel())

    def _selection(self, exclude):
        """Maps `load(exclude=...)` keys onto ckptd's tensor selection: (include patterns,
        exclude patterns, train-state prefixes to leave alone)."""
        include, patterns, skip_state = [], [], []
        for key in exclude:
            if key == "*":  # to ckptd, a restore of the train state alone (load(on_shapes=) asks so)
                raise ValueError("exclude: '*' leaves out every tensor: there is nothing to load")
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

    def _load_from_dcp(self, path, step, keys_map, exclude, strict):
        named = None
        match = re.search(r"step[-_]?(\d+)$", os.path.basename(os.path.normpath(path)))
        if step is None and match is not None:
            named = int(match.group(1))
        if isinstance(self.model, _parts.ModelParts):
            raise CheckpointError("load(from_dcp=) takes one model: with several model parts, "
                                  "load the DCP checkpoint with a manager per part")
        try:
            import ckptd.dcp  # noqa: F401 - first: says when this PyTorch cannot read DCP
            from torch.distributed.checkpoint.api import CheckpointException
            from ckptd._from_dcp import Plan
        except ImportError as e:
            raise CheckpointError(f"cannot load DCP checkpoint {path}: {e}") from e
        self.wait_staged()
        try:
            plan = Plan(path, self.model, self.optimizer, self.lr_scheduler, self.extra_state, keys_map, exclude)
            if step is None and named is None and plan.needs_step():
                raise CheckpointError("no step in the directory's name, nor a train_state step in it; pass step=")
            problems = plan.problems()
            if problems and strict:
                raise CheckpointError(f"strict=True: {problems}")
            saved_step = plan.load_all(self.rank)
        except CheckpointError as e:
            raise CheckpointError(f"cannot load DCP checkpoint {path}: {e}") from e
        except CheckpointException as e:  # a BaseException: each rank's failure inside
            # Each rank's failure is (exception, its traceback summary).
            why = "; ".join(str(f[0] if isinstance(f, tuple) else f) for f in e.failures.values())
            raise CheckpointError(f"cannot load DCP checkpoint {path}: {why}") from e
        except Exception as e:
            raise CheckpointError(f"cannot load DCP checkpoint {path}: {e}") from e
        step = step if step is not None else named if named is not None else saved_step
        if problems and self.rank == 0:
            warnings.warn(f"ckptd: load(from_dcp={path!r}): {problems}", stacklevel=_user_stacklevel())
        log.info("ckptd: loaded step %d from the DCP checkpoint %s (%s)", step, path,
                 ", ".join(f"{part} from {key or 'the top'!r}" for part, key in sorted(plan.load.items())))
        self._run = step
        self._loaded = True
        return step

    def read_file(self, name):
        """The bytes of the file `name` that the step load() restored holds for this rank (as
        save(files=) stored it; rank 0's for a rank the step was not saved with). All of them
        are in `restored_files`. CheckpointError when there is no such file, naming those there are."""
        if name not in self.restored_files:
            held = ", ".join(map(repr, sorted(self.restored_files))) or "none"
            raise CheckpointError(f"no file {name!r} was restored for rank {self.rank} (files: {held}); "
                                  "files come back from the step load() restored, as save(files=) stored them")
        return self.restored_files[name]

    # --- loading from elsewhere (_sources.py) and model-only steps (_model_only.py) -------

    def _restore(self, step, include, patterns, strict, cast, with_optimizer):
        """ckptd's restore; a step refused for not matching the registered tensors is asked
        for again without the optimizer's, and taken when it holds no optimizer state at all
        (a model-only step: _model_only decides what starts fresh). Otherwise the refusal
        stands."""
        try:
            return self._client.restore(step, include=include, exclude=patterns, allow_missing=not strict,
                                        cast=bool(cast))
        except ckptd.Error as e:
            if e.code != "FAILED_PRECONDITION" or not with_optimizer or self.optimizer is None:
                raise
            refused = e
        try:
            info = self._client.restore(step, include=include, exclude=patterns + [_model_only.OPTIMIZER_TENSORS],
                                        allow_missing=not strict, cast=bool(cast))
        except ckptd.Error:
            raise refused from None
        if not info["found"] or not _model_only.holds_no_optimizer(info["train_state"], info["skipped"]):
            raise refused  # the optimizer's state is there and does not fit: the first answer stands
        info["model_only"] = True
        return info

    def _model_only(self, info, created, skip_state, with_optimizer):
        """After a restore: when the step holds no optimizer state (a seed checkpoint), the
        optimizer state load() created is dropped (the optimizer starts fresh), and what the
        step has nothing for is left alone and named in one warning. Returns the train-state
        prefixes to leave alone."""
        state = info["train_state"]
        not_in = [n for n in info.get("not_in_checkpoint", []) if n.startswith("optim.")]
        if not with_optimizer or self.optimizer is None or not (
                info.get("model_only") or (not_in and _model_only.holds_no_optimizer(state, 0))):
            return skip_state
        self._drop_optimizer_state(created)
        info["not_in_checkpoint"] = [n for n in info.get("not_in_checkpoint", []) if not n.startswith("optim.")]
        absent = _model_only.absent_parts(self, state, skip_state)
        where = f" of job {self.job!r}" if info.get("source") != "path" else ""
        if absent and self.rank == 0:
            warnings.warn(_model_only.warning(info["step"], where, absent), stacklevel=_user_stacklevel())
        return list(skip_state) + [prefix for prefix, _ in absent]

    def _load_from_path(self, path, step, exclude, include, patterns, skip_state, strict, cast):
        """A committed step directory read from its files in this process (_sources.py)."""
        from ckptd import _sources
        self.wait_staged()
        source = _sources.StepDirectory(path)
        try:
            if step is not None and int(step) != source.step:
                raise CheckpointError(f"load(from_path={path!r}, step={step}): the directory holds step "
                                      f"{source.step}, not {step}")
            from_rank = self.rank if self.rank < source.world_size else 0
            state = source.train_state(from_rank)
            with_optimizer = "optimizer" not in exclude and self.optimizer is not None
            model_only = with_optimizer and _model_only.holds_no_optimizer(
                state, sum(n.startswith("optim.") for n in source.tensors))
            created = [] if not with_optimizer or model_only else self._create_optimizer_state()
            try:
                nbytes, missing, unexpected = _sources.copy_parts(
                    source, self._parts(self._collect()), include,
                    patterns + ([_model_only.OPTIMIZER_TENSORS] if model_only else []), strict, cast)
            except BaseException:
                self._drop_optimizer_state(created)
                raise
        except (KeyError, TypeError, ValueError, IndexError) as e:  # a manifest is data from a file
            raise CheckpointError(f"load(from_path={path!r}): its manifest is not well formed "
                                  f"({type(e).__name__}: {e})") from e
        finally:
            source.close()
        info = {"step": source.step, "train_state": state, "model_only": model_only, "source": "path",
                "not_in_checkpoint": missing}
        skip_state = self._model_only(info, [], skip_state, with_optimizer)
        for side, names in (("not in the step", info["not_in_checkpoint"]),
                            ("in the step but not in the model", unexpected)):
            if names:
                warnings.warn(f"ckptd: load(from_path={path!r}): {len(names)} tensors {side} were skipped "
                              f"(strict=False): {', '.join(names[:8])}{', ...' if len(names) > 8 else ''}",
                              stacklevel=_user_stacklevel())
        resharded = None
        if source.world_size != self.world_size:
            resharded = {"saved_world_size": source.world_size, "world_size": self.world_size, "rank": self.rank,
                         "from_rank": from_rank}
            self._warn_resharded_state(source.step, source.world_size, skip_state)
        try:
            plain = self._apply_train_state(state, skip_state, resharded)
        except (pickle.UnpicklingError, RuntimeError, ValueError, EOFError) as e:
            raise CheckpointError(f"load(from_path={path!r}): step {source.step}'s train state is not usable: "
                                  f"{e}") from e
        restored = Restored(source.step, "path", nbytes, source.world_size if resharded else None)
        restored.extra = plain  # extra_state's plain values, as saved
        self.restored_files = _files.decode(state)
        log.info("ckptd: job %r rank %d: %s (%s, saved by job %r)", self.job, self.rank, restored.describe(),
                 path, source.job)
        self.restored = restored
        self._run = source.step
        self._loaded = True
        return restored

    def _load_from_job(self, job, step, daemon_timeout, exclude, include, patterns, skip_state, strict, cast):
        """Another job's step through ckptd: a session of that job for the restore only,
        registered with none of this manager's retention or upload settings (they are this
        job's, not the source's), then left; the next save registers under this job."""
        from ckptd import _sources
        if not isinstance(job, str) or not job:
            raise ValueError(f"load(from_job={job!r}): a job name")
        _sources.source_steps(self.socket, job, step, ckptd.list_checkpoints)
        own = (self.job, self.keep_last, self.upload_every_steps, self.upload_interval_seconds)
        self._release()
        self.job, self.keep_last, self.upload_every_steps, self.upload_interval_seconds = job, None, None, None
        try:
            self._wait_for_daemon(self.daemon_timeout if daemon_timeout is None else daemon_timeout)
            restored = self._load(step, exclude, include, patterns, skip_state, strict, cast)
        finally:
            self._release()
            self.job, self.keep_last, self.upload_every_steps, self.upload_interval_seconds = own
        if restored is None:
            raise CheckpointError(f"load(from_job={job!r}): ckptd found no step of job {job!r} that rank "
                                  f"{self.rank} can restore")
        self._loaded = True
        return restored

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
        writes, or a hub download), each cast to its parameter's dtype, into a whole or an
        already sharded model (each rank reading its shards alone: _from_hf.load_into); the
        optimizer and the rest of the train state are left as they are (there are none in
        such a folder)."""
        from ckptd import _from_hf
        rules = dict(rename or {})
        _from_hf.check_rules(rules)
        self.wait_staged()
        # A sharded model (FSDP2, tensor parallelism): each rank reads its own shards only.
        loaded, nbytes = _from_hf.load_into(path, self.model, rules, strict,
                                            lambda what: warnings.warn(what, stacklevel=_user_stacklevel()))
        restored = Restored(0, "hf", nbytes)
        log.info("ckptd: job %r rank %d: loaded %d tensors (%d bytes) from the Hugging Face folder %s",
                 self.job, self.rank, loaded, nbytes, path)
        self.restored = restored
        return restored

    def save_weights(self, step, dtype=None, job=None, files=None):
        """A weights-only checkpoint: the model's parameters and persistent buffers (no
        optimizer, no train state), every floating-point tensor converted to `dtype` (for
        example torch.bfloat16; None keeps each dtype), as the job `job` (default
        "<job>-weights"), so the training job's own steps, retention and restore are left
        alone. What a final save for inference or fine-tuning wants (torchtitan's
        model_weights_only with export_dtype). Every rank calls it, like save(); returns
        once the checkpoint is committed on every rank, raising CheckpointError otherwise.
        Sharded parameters (DTensor, FSDP2) keep their placement. `files` go with it as with
        save() (a model's config.json, which `ckptctl export --format hf` then writes beside
        the weights)."""
        self._check_open()
        stored_files = _files.encode(files)
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
            ticket = client.snapshot(int(step), {**self._metadata(), "weights_only": "1"}, stored_files)
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
        """Connects for load(): waits up to `timeout` for a ckptd that is starting or slow to
        answer, saying so at once and every 10 s; raises at once when none is there or
        starting (see _connection._DaemonWait)."""
        local_rank = _env_int("LOCAL_RANK")
        wait = _DaemonWait(self.socket, f"job {self.job!r}", timeout,
                           speaks=(local_rank if local_rank is not None else self.rank) == 0)
        while True:
            self._retry_after = 0.0  # load() asks now, whatever the save path last saw
            # load() raises instead of warning. Not warnings.catch_warnings: it swaps
            # process-wide state, and with trainer threads (one per rank) interleaving their
            # enter and exit it can leave warnings switched off for the whole process.
            self._quiet = True
            self._lost_error = None
            try:
                if self._connected():
                    wait.answered()
                    return
                if self._connector is not None:  # slow to answer: give it up to a second more
                    self._connector.done(timeout=max(0.0, min(1.0, wait.started + timeout - time.monotonic())))
                    if self._connected():
                        wait.answered()
                        return
            finally:
                self._quiet = False
            try:
                pause = wait.failed(self._lost_error)
            except CheckpointError:
                self._retry_after = 0.0  # the next save tries (and warns) again
                raise
            time.sleep(pause)

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
        self._lost_error = error  # what a waiting load() says it waits for
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
        self._frozen = frozenset()  # a new session: nothing frozen yet
        sparse = self._sparse_names(parts)
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
                # Its old storage goes now, not after the loop: moving a whole state at once
                # would hold both copies (the first load of a model with Adam, whose state
                # the load has just created, grew by the optimizer state for a moment).
                e.tensor = part.tensor = part.relocate = None
            t = None
        self._client.mark_sparse(sorted(sparse))
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

    def _sparse_names(self, parts):
        """Entries updated a few rows at a time: sparse embeddings' weights and their optimizer
        state (SparseAdam's moments change at the rows a step touched). With ckptd
        --increments on they are compared in small chunks."""
        ids = _sparse_gradient_params(self.model, _parts.optimizers(self.optimizer))
        params = {e.name for e, _ in parts if e.tensor is not None and id(e.tensor) in ids}
        return {e.name for e, _ in parts
                if e.name in params or any(e.name.startswith(f"optim.{n}.") for n in params)}

    def _frozen_now(self):
        """Registered parameters that do not train (requires_grad=False: a frozen base model,
        layers frozen for a phase), with their version counters: ckptd copies them once and
        then takes their bytes from its own copy, checking them every --frozen-check-every
        snapshots (docs/python.md)."""
        if not self.frozen:
            return {}
        return {name: p._version for name, p in self._named_model_params
                if not p.requires_grad and name in self._registered_where}

    def _sync_frozen(self):
        """Tells ckptd which tensors are frozen when that changed since the last save (one
        Update call, before the snapshot): a thaw takes effect at this very snapshot, and a
        frozen parameter written in place since (its version counter moved: a load_state_dict,
        an EMA update, a thaw, a step and a freeze between two saves) is frozen anew, which
        makes ckptd copy it once more."""
        versions = self._frozen_now()
        now = frozenset(versions)
        changed = sorted(n for n in now & self._frozen if versions[n] != self._frozen_versions.get(n))
        if now == self._frozen and not changed:
            return
        anew = sorted(now - self._frozen) + changed
        self._client.set_frozen(anew, False)  # thaw then freeze: always sent as a freeze
        self._client.set_frozen(anew, True)
        self._client.set_frozen(sorted(self._frozen - now), False)
        self._client.update()
        self._frozen, self._frozen_versions = now, versions

    def _note_registered(self):
        self._named_model_params = list(_named_parameters(self.model))
        self._model_params = list(self.model.parameters())
        self._buffer_slots = [(module, leaf) for _, module, leaf in _persistent_buffers(self.model)]
        self._param_names = _param_names(self.model)
        self._optimizer_param_list = ([p for g in self.optimizer.param_groups for p in g["params"]]
                                      if self.optimizer is not None else [])
        self._aliases = _aliases(self.model)
        self._registered = True
        self._registered_fingerprint = self._fingerprint()
        parts = self._parts(self._collect())
        self._registered_where = self._where(parts)  # after the moves
        self._shapes_record = _shapes.record(parts)

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
        if self._shapes_record is not None:  # for load(on_shapes=, resize=True)
            state[_shapes.KEY] = self._shapes_record
        for name, obj in self.extra_state.items():
            if not torch.is_tensor(obj):
                state[f"extra.{name}"], paths = self._extra_bytes(name, obj)
                if paths:  # where its io.BytesIO were (_train_state._bytesio_out)
                    state[_BYTESIO_KEY + name] = _to_bytes(paths)
                if _is_stateful_loader(obj) and obj.generator is not None:  # see _resume_loader
                    state[f"extra.{name}.generator"] = obj.generator.get_state().numpy().tobytes()
        return state

    def _extra_bytes(self, name, obj):
        """An extra_state entry as train state. The first save of each checks that it reads
        back (as load() will read it: data only): a value that saves but can never be loaded
        is refused now, naming it, not found out at the restart."""
        value, paths = _bytesio_out(obj.state_dict() if hasattr(obj, "state_dict") else obj)
        if name in self._extra_checked:
            return _to_bytes(value), paths
        try:
            data = _to_bytes(value)
            _from_bytes(data)
        except Exception as e:  # what torch.save cannot write, or its weights-only reader refuses
            raise CheckpointError(f"extra_state[{name!r}] holds something a checkpoint cannot load "
                                  f"back as plain data ({type(e).__name__}: {str(e).splitlines()[0]}): "
                                  "keep to tensors, numbers, strings, bytes, io.BytesIO, lists and dicts") from e
        self._extra_checked.add(name)
        return data, paths

    def _apply_train_state(self, state, skip=(), resharded=None):
        """Applies the saved train state, except the entries under a prefix in `skip`
        ("optim", "lr_scheduler", "rng", "extra.<name>": what load(exclude=) leaves alone).
        Returns the plain values of extra_state (numbers, strings...), which cannot be
        restored in place: {name: value}."""
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
        plain = {}
        for name, obj in list(self.extra_state.items()):
            key = f"extra.{name}"
            if key in skipped or torch.is_tensor(obj):  # a tensor came back with the tensors
                continue
            if key not in state:
                raise CheckpointError(f"the checkpoint has no extra_state[{name!r}]")
            value = _from_bytes(state[key])
            if _BYTESIO_KEY + name in state:
                value = _bytesio_in(value, _from_bytes(state[_BYTESIO_KEY + name]))
            if resharded is not None and hasattr(obj, "reshard_state_dict"):
                value = obj.reshard_state_dict(value, **resharded)
            if isinstance(obj, _PLAIN):  # given back (Restored.extra), and saved from now on
                plain[name] = self.extra_state[name] = value
            else:
                _load_extra(name, obj, value)
                if _is_stateful_loader(obj):
                    _resume_loader(obj, state.get(f"{key}.generator"))
        return plain

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
        (parameters are overwritten by the restore anyway): sparse ones (a row of zeros)
        where the parameter gets sparse gradients (an nn.Embedding(sparse=True), every
        parameter of a SparseAdam, which refuses dense ones). Returns the parameters whose state was
        created, to drop again if there is nothing to restore."""
        if self.optimizer is None:
            return []
        # Frozen parameters get no state from a real step: none is created for them either.
        params = [p for _, p in self._optimizer_params()
                  if p.requires_grad and not self.optimizer.state.get(p)]
        if not params:
            return []
        saved_grads = {id(p): p.grad for p in params}
        saved_lrs = [g.get("lr") for g in self.optimizer.param_groups]
        sparse = _sparse_gradient_params(self.model, _parts.optimizers(self.optimizer))
        with torch.no_grad():
            for p in params:
                p.grad = _empty_sparse_like(p) if id(p) in sparse else torch.zeros_like(p)
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
        # PyTorch >= 2.0; an Optimizer subclass that skipped Optimizer.__init__ (a wrapper
        # _parts.unwrapped does not know) has the method but no hooks: its step is wrapped.
        if hasattr(optimizer, "register_step_pre_hook") and hasattr(optimizer, "_optimizer_step_pre_hooks"):
            optimizer.register_step_pre_hook(lambda optimizer, args, kwargs: self.wait_staged())
            return step

        @functools.wraps(step)  # keeps the LR scheduler's step counter attributes
        def step_after_staged(*args, **kwargs):
            self.wait_staged()
            return step(*args, **kwargs)

        optimizer.step = step_after_staged
        return step


def _sparse_gradient_params(model, optimizers):
    """id() of every parameter that backward() gives sparse gradients: the weights of sparse
    embeddings, and whatever a SparseAdam holds (it takes nothing else)."""
    sparse = {id(m.weight) for m in model.modules()
              if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse}
    for o in optimizers:
        if isinstance(o, torch.optim.SparseAdam):
            sparse.update(id(p) for g in o.param_groups for p in g["params"])
    return sparse


def _empty_sparse_like(p):
    """A sparse COO gradient for `p` that is zero: one row (0) of zeros (PyTorch 1.13's
    SparseAdam cannot take a gradient with no entries at all)."""
    rows = min(1, p.shape[0]) if p.dim() > 0 else 0
    indices = torch.zeros((1, rows), dtype=torch.int64, device=p.device)
    values = torch.zeros((rows, *p.shape[1:]), dtype=p.dtype, device=p.device)
    # Checked (it is tiny), which also keeps PyTorch 2 from warning that checks are off.
    checked = {"check_invariants": True} if int(torch.__version__.split(".")[0]) >= 2 else {}
    return torch.sparse_coo_tensor(indices, values, p.shape, **checked)


# Plain values in extra_state: saved as they are; load() cannot restore them in place, so it
# gives them back (Restored.extra) and the manager saves the restored value until it is set
# anew (manager.extra_state[name] = value).
_PLAIN = (bool, int, float, complex, str, bytes, type(None))

# Train-state entries of the manager's own: where an extra_state entry's io.BytesIO were.
_BYTESIO_KEY = "ckptd.bytesio."


def _check_extra(name, obj):
    """What extra_state may hold: an object with state_dict()/load_state_dict(), a tensor
    (registered like a parameter), a dict or list (its contents restored in place), or a
    plain value (a number, a string: given back by load())."""
    if torch.is_tensor(obj) or isinstance(obj, (dict, list) + _PLAIN):
        return
    if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
        raise TypeError(f"extra_state[{name!r}] is a {type(obj).__name__}: pass an object with "
                        "state_dict()/load_state_dict(), a tensor, a dict or list (restored in "
                        "place), or a number, string or bytes (given back as load().extra)")


def _is_stateful_loader(obj):
    """torchdata's StatefulDataLoader (or one like it): a DataLoader whose load_state_dict
    keeps the state for the iterator its next iter() makes."""
    loader = getattr(getattr(torch.utils, "data", None), "DataLoader", None)
    return loader is not None and isinstance(obj, loader) and hasattr(obj, "next_iter_state")


def _resume_loader(loader, generator_state):
    """Makes the iterator that continues the saved epoch now, so that the run draws from its
    RNGs what the run it continues drew. A DataLoader's iterator draws its base seed when it
    is made (from `generator`, else torch's global RNG): made by the user's iter() after
    load(), it would draw once more than the saved run did, from the global RNG that load()
    restored (dropout differs from then on) or from the generator, whose state the sampler
    then sets back to the epoch's start (the next epoch is shuffled differently). Made here,
    before load() restores the global RNG, with the generator set to its state at the save
    afterwards, nothing is drawn twice; iter() then returns it (torchdata keeps the iterator
    that state_dict() made for the next iter())."""
    if loader.next_iter_state is None:
        return  # saved before its first iter(): nothing to continue
    rng = torch.get_rng_state()
    try:
        loader.state_dict()
    finally:
        torch.set_rng_state(rng)
    if generator_state is not None and loader.generator is not None:
        loader.generator.set_state(torch.frombuffer(bytearray(generator_state), dtype=torch.uint8))


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

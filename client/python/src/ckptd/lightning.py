"""PyTorch Lightning's checkpoints through ckptd: a `CheckpointIO` plugin.

    from ckptd.lightning import CkptdCheckpointIO

    trainer = Trainer(plugins=[CkptdCheckpointIO(job="my-job")],
                      callbacks=[ModelCheckpoint(every_n_train_steps=100, save_last=True)])
    trainer.fit(model, ckpt_path="last")        # resumes from ckptd when there is a last.ckpt

Lightning hands the plugin the checkpoint as a dict (`state_dict`, `optimizer_states`,
`lr_schedulers`, `loops`, `callbacks`, hyper-parameters, whatever `on_save_checkpoint`
added). Every tensor in it is copied into shared memory that ckptd reads (one copy in the
trainer, done before `save_checkpoint` returns, so training changes nothing that ckptd is
still copying), and the rest of the dict goes in as the step's train state. ckptd writes
and commits it in the background. At the path Lightning names, the plugin writes a small
file that names the job and the step: ModelCheckpoint's files, `last.ckpt`, `ckpt_path=
"last"`, `save_top_k` and its removals all work on those files as they do on Lightning's
own. `load_checkpoint(path)` returns the same dict. See docs/python.md ("Frameworks").
"""
import copy
import importlib
import io
import json
import logging
import os
import random
import time
import warnings

import torch

import ckptd
from ckptd import _advice
from ckptd._connection import _DaemonWait, _listening, _user_stacklevel
from ckptd._errors import CheckpointError
from ckptd._state_dict import _DTYPES, _TORCH_DTYPES
from ckptd._train_state import _from_bytes, _to_bytes

try:  # the `lightning` package, and the standalone `pytorch-lightning` (lightning_fabric)
    from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO as _LightningIO
except ImportError:
    _LightningIO = None
try:
    from lightning_fabric.plugins.io.checkpoint_io import CheckpointIO as _FabricIO
except ImportError:
    _FabricIO = None
if _LightningIO is None and _FabricIO is None:
    raise ImportError("ckptd.lightning needs PyTorch Lightning: pip install lightning "
                      "(or pytorch-lightning)")

__all__ = ["CkptdCheckpointIO", "CheckpointError"]

log = logging.getLogger("ckptd")

# What the file at a checkpoint path holds: JSON naming the job and step in ckptd.
_POINTER_KIND = "ckptd-lightning"
_POINTER_VERSION = 1
# Every step this plugin saves has this one-byte tensor (its format version): a fresh
# session registers it alone to read a step's train state, which lists the other tensors.
_MARKER = "lightning.format"
# The train-state entry that holds the dict without its tensors, and where they go back.
_SKELETON = "lightning.checkpoint"
# The generators' states at the save (Lightning's dict has none; see _rng_states).
_RNG = "lightning.rng"


def _bases():
    """Lightning's CheckpointIO base, from `lightning` and `lightning_fabric` where both are
    installed: `Trainer(plugins=...)` of either package then accepts the plugin."""
    return tuple(b for b in (_LightningIO, _FabricIO) if b is not None)


class CkptdCheckpointIO(*_bases()):
    """Saves Lightning checkpoints as ckptd steps (the step is the trainer's global_step)
    and loads them back; the file at each checkpoint path names the job and the step.

    `job` is ckptd's job name (one per training run: a run resumed from its own checkpoints
    keeps it). `keep_last` makes ckptd keep only the newest K steps of the job (0 keeps
    all; None: the daemon's --keep-last). `daemon_timeout` bounds how long a load waits
    for an unreachable ckptd. `upload_every_steps` and `upload_interval_seconds` choose
    the steps ckptd copies to its remote tier, as with ckptd.torch.CheckpointManager.
    """

    def __init__(self, job, socket=None, keep_last=None, arena_bytes=64 << 20,
                 daemon_timeout=120.0, upload_every_steps=None, upload_interval_seconds=None):
        super().__init__()
        if keep_last is not None and keep_last < 0:
            raise ValueError(f"keep_last must be 0 (keep all) or more, not {keep_last}")
        if daemon_timeout < 0:
            raise ValueError(f"daemon_timeout must be 0 or more seconds, not {daemon_timeout}")
        self.job = job
        self.socket = os.fspath(socket) if socket is not None else ckptd.default_socket()
        self.keep_last = keep_last
        self.arena_bytes = arena_bytes
        self.daemon_timeout = daemon_timeout
        self.upload_every_steps = upload_every_steps
        self.upload_interval_seconds = upload_interval_seconds
        self._client = None
        self._buffers = {}        # name -> tensor viewing its shared-memory buffer
        self._layout = None       # [(name, dtype, shape)] registered, in order
        self._unstaged = None     # a snapshot ckptd may still be copying from the buffers
        self._inflight = []       # [ticket, step, [paths]] of snapshots not known committed
        self._last_step = None    # the newest step this session snapshotted (or loaded)
        self._held = set()        # steps the job held when this session registered
        self._loaded = False      # a load went through: this run continues the job
        self._checked_run = False
        self.restored = None      # {"step", "source", "bytes", "path"} of the last load

    # --- CheckpointIO ---------------------------------------------------------------------

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        """Queues `checkpoint` as ckptd step `checkpoint["global_step"]` and writes the file
        at `path` naming it. Returns once the tensors are copied into shared memory; ckptd
        writes and commits in the background. An unreachable or refusing ckptd warns and
        skips this save (training goes on, and no file is written)."""
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options "
                            f"(got {storage_options!r})")
        _single_process("save")
        if "global_step" not in checkpoint:
            raise CheckpointError(f"{path}: the checkpoint has no 'global_step' (the ckptd step)")
        step = int(checkpoint["global_step"])
        skeleton, entries = _split(checkpoint)
        layout = [(_MARKER, "U8", (1,))] + [(e.name, _DTYPES[e.tensor.dtype], tuple(e.tensor.shape))
                                            for e in entries]
        state = {_SKELETON: _to_bytes({"checkpoint": skeleton,
                                       "tensors": [(e.path, e.name, dtype, list(shape))
                                                   for e, (_, dtype, shape) in zip(entries, layout[1:])]}),
                 _RNG: _to_bytes(_rng_states())}
        try:
            if not self._connect(wait=0):
                return
            self._wait_staged()
            self._check_inflight(wait=False)
            if self._last_step is not None and step <= self._last_step:
                if step == self._last_step and self._same_as_buffers(layout, entries):
                    self._point(path, step)  # the same state under another name (last.ckpt)
                else:
                    warnings.warn(f"ckptd: {path} not saved: step {step} is not after step "
                                  f"{self._last_step}, which this run saved already with other "
                                  "values (ckptd holds one checkpoint per step)", RuntimeWarning,
                                  stacklevel=_user_stacklevel())
                return
            self._register(layout)
            if step in self._held:
                warnings.warn(
                    f"ckptd: {path} not saved: job {self.job!r} already holds step {step}, from an "
                    "earlier run (this run resumed from an older step). ckptd holds one checkpoint "
                    "per step, so this run saves again once it passes the job's newest step. To "
                    f"branch from an older step, use another job name, or delete the newer steps "
                    f"first (ckptctl --job {self.job} delete STEP)", RuntimeWarning,
                    stacklevel=_user_stacklevel())
                return
            self._check_other_run(step)
            with torch.no_grad():
                for e in entries:
                    self._buffers[e.name].copy_(e.tensor)
            metadata = {"framework": "lightning", "torch_version": torch.__version__,
                        "lightning_version": str(checkpoint.get("pytorch-lightning_version", ""))}
            ticket = self._client.snapshot(step, metadata, state)
        except ckptd.Error as e:
            self._lost(e, f"{path} (step {step}) not saved")
            return
        self._unstaged = ticket
        self._inflight.append([ticket, step, []])
        self._last_step = step
        self._point(path, step)

    def load_checkpoint(self, path, map_location=None, weights_only=None):
        """The checkpoint dict saved at `path`: its step restored from ckptd (memory, disk or
        the remote tier), tensors on the CPU (or `map_location`, a device). A step that ckptd
        never committed (the trainer died within milliseconds of saving it) loads the newest
        older step of the job, with a warning. A file that is not one of this plugin's (a
        Lightning checkpoint written with torch.save) is loaded as Lightning would, so a run
        switches to ckptd by resuming from its last file once. `weights_only` is passed to
        torch.load for the dict's non-tensor part, as Lightning does for its files."""
        pointer = _read_pointer(path)
        if pointer is None:
            torch_io = _fabric("plugins.io.torch_io").TorchCheckpointIO()
            if map_location is None:
                return torch_io.load_checkpoint(path, weights_only=weights_only)
            return torch_io.load_checkpoint(path, map_location=map_location, weights_only=weights_only)
        _single_process("load")
        if pointer["job"] != self.job:
            raise CheckpointError(f"{path} is a checkpoint of ckptd job {pointer['job']!r}, and "
                                  f"this plugin's job is {self.job!r}: pass job={pointer['job']!r} "
                                  "to CkptdCheckpointIO to resume that run")
        self._connect(wait=self.daemon_timeout)
        step = pointer["step"]
        try:
            self._wait_staged()
            info, step = self._train_state_of(step, path)
            saved = _loads(info["train_state"][_SKELETON], weights_only)
            self._register([(_MARKER, "U8", (1,))] + [(name, dtype, tuple(shape))
                                                      for _, name, dtype, shape in saved["tensors"]])
            info = self._client.restore(step)
        except ckptd.Error as e:
            self._release()
            if isinstance(e, CheckpointError):
                raise
            raise CheckpointError(f"cannot load {path} (job {self.job!r} step {step}): {e}") from e
        except BaseException:
            self._release()  # nothing half-registered stays behind (a refused unpickling)
            raise
        device = _device(map_location)
        tensors = {name: self._buffers[name].clone() if device is None
                   else self._buffers[name].to(device, copy=True)
                   for _, name, _, _ in saved["tensors"]}
        checkpoint = _join(saved["checkpoint"], [(p, tensors[name]) for p, name, _, _ in saved["tensors"]])
        if _RNG in info["train_state"]:
            _set_rng_states(_from_bytes(info["train_state"][_RNG]))
        self._loaded = True
        self._last_step = max(self._last_step or 0, step)
        self.restored = {"step": step, "source": info["source"], "bytes": info["bytes"],
                         "path": os.fspath(path)}
        log.info("ckptd: job %r: restored step %d from %s for %s", self.job, step, info["source"], path)
        return checkpoint

    def remove_checkpoint(self, path):
        """Deletes the file at `path` (as Lightning's own plugin does). The step stays in
        ckptd, whose retention decides how long (keep_last, or the daemon's --keep-last):
        another file (last.ckpt) may name the same step."""
        fs = _fs(path)
        if fs.exists(path):
            fs.rm(path, recursive=True)

    def teardown(self):
        """At the end of fit/validate/test: waits until the latest save is committed (so a
        finished fit() leaves its checkpoints durable, as torch.save's would be) and leaves
        ckptd. A later save or load connects again."""
        if self._client is None:
            return
        try:
            self._check_inflight(wait=True)
        except ckptd.Error as e:
            warnings.warn(f"ckptd: steps {[s for _, s, _ in self._inflight]} not known to be "
                          f"committed: {e}", RuntimeWarning, stacklevel=_user_stacklevel())
        self._release()

    # --- ckptd session ----------------------------------------------------------------------

    def _connect(self, wait):
        """Whether there is a session, connecting if ckptd listens. `wait` 0: a save, which
        warns and returns False at once when nothing listens; otherwise (a load) waits up to
        that long for a ckptd that is starting or slow to answer, saying so, then raises
        CheckpointError; at once when no ckptd is there or starting (never a silent fresh
        start, never a silent wait)."""
        if self._client is not None:
            return True
        waiting = _DaemonWait(self.socket, f"job {self.job!r}", wait) if wait else None
        while True:
            error = None
            if _listening(self.socket):
                try:
                    self._client = ckptd.connect(
                        self.socket, self.job, 0, 1, self.arena_bytes, keep_last=self.keep_last or 0,
                        upload_every_steps=self.upload_every_steps,
                        upload_interval_seconds=self.upload_interval_seconds)
                    self._buffers, self._layout = {}, None
                    if waiting is not None:
                        waiting.answered()
                    return True
                except ckptd.Unavailable as e:
                    error = e
                except ckptd.Error as e:
                    if not wait:
                        self._lost(e, "checkpoint not saved")
                        return False
                    raise CheckpointError(f"cannot load job {self.job!r}: {e}") from e
            if waiting is None:
                warnings.warn(f"ckptd unavailable at {self.socket}: checkpoint not saved, "
                              "training continues", RuntimeWarning, stacklevel=_user_stacklevel())
                return False
            # Raises at once when no ckptd is there or starting, else when `wait` is up.
            time.sleep(waiting.failed(error))

    def _register(self, layout):
        """Makes the registered tensors `layout` [(name, dtype, shape)]: a new session
        registers them all; a registered one adds what is new or changed and removes what
        is gone in one update (the optimizer's state appears after the first step)."""
        if layout == self._layout:
            return
        before = {name: (dtype, shape) for name, dtype, shape in (self._layout or [])}
        want = {name: (dtype, shape) for name, dtype, shape in layout}
        changed = [(n, d, s) for n, d, s in layout if before.get(n) != (d, s)]
        for name, dtype, shape in changed:
            self._allocate(name, dtype, shape)
        if self._layout is None:
            self._client.register()
            self._held = set(self._client.committed_steps)  # the newest 16 (see save)
        else:
            for name in before:
                if name not in want:
                    self._client.remove(name)
                    del self._buffers[name]
            self._client.update()
        self._layout = list(layout)

    def _allocate(self, name, dtype, shape):
        torch_dtype = _TORCH_DTYPES[dtype]
        buffer = self._client.allocate(name, dtype, list(shape))
        self._buffers[name] = torch.frombuffer(buffer, dtype=torch.uint8).view(torch_dtype).view(shape)
        if name == _MARKER:
            self._buffers[name].fill_(_POINTER_VERSION)

    def _train_state_of(self, step, path):
        """Restores the train state of `step` (the marker tensor alone: the dict's layout
        comes with it); returns (restore info, the step). A step newer than all the job
        holds was never committed: the newest older one is taken, with a warning."""
        if self._layout is None:
            self._register([(_MARKER, "U8", (1,))])
        try:
            return self._client.restore(step, include=[_MARKER], allow_missing=True), step
        except ckptd.Unavailable:
            raise
        except ckptd.Error as e:
            held = sorted(self._client.committed_steps)
            older = [s for s in held if s < step]
            if not older or step < held[-1]:
                raise CheckpointError(
                    f"cannot load {path}: ckptd job {self.job!r} has no step {step} ({e}); it holds "
                    f"{_advice.describe_steps(held, self._client.committed_count) or 'none'}. "
                    "Steps go when ckptd's retention deletes them (keep_last, --keep-last): keep "
                    "more, or load a newer checkpoint") from e
        warnings.warn(f"ckptd: {path} names step {step} of job {self.job!r}, which ckptd never "
                      f"committed (the trainer stopped before ckptd had copied it); loading step "
                      f"{older[-1]}, the newest before it", stacklevel=_user_stacklevel())
        return self._client.restore(older[-1], include=[_MARKER], allow_missing=True), older[-1]

    def _wait_staged(self):
        """Returns once ckptd has copied the latest snapshot out of the buffers."""
        ticket, self._unstaged = self._unstaged, None
        if ticket is not None and self._client is not None:
            self._client.wait_staged(ticket)  # a failure is _check_inflight's to report

    def _point(self, path, step):
        """Writes the file at `path` naming `step`, remembered until the step is committed:
        a step that fails takes its files with it."""
        _write_pointer(path, self.job, step)
        for entry in self._inflight:
            if entry[1] == step:
                entry[2].append(os.fspath(path))

    def _check_inflight(self, wait):
        """Forgets the snapshots ckptd committed; for one that failed (or was refused or
        abandoned), deletes the files that name its step and warns. `wait`: until each is
        committed or failed (the end of fit), else only what is known now."""
        still = []
        for ticket, step, paths in self._inflight:
            status = self._client.wait_committed(ticket) if wait else self._client.poll(ticket)
            if status["state"] == "committed":
                continue
            if status["state"] in ("pending", "staged"):
                still.append([ticket, step, paths])
                continue
            if status["state"] == "unknown":  # the client no longer tracks it: nothing to say
                continue
            for path in paths:
                if _read_pointer_quietly(path) == {"job": self.job, "step": step}:
                    _fs(path).rm(path)
            warnings.warn(f"ckptd: step {step} {status['state']}: {status['error'] or 'abandoned'}; "
                          f"its files are removed: {', '.join(paths) or 'none'}", RuntimeWarning,
                          stacklevel=_user_stacklevel())
        self._inflight = still

    def _same_as_buffers(self, layout, entries):
        """Whether `entries` hold exactly what the buffers hold (the state of the last
        snapshot): a second file for the same step (ModelCheckpoint's last.ckpt)."""
        if layout != self._layout:
            return False
        return all(torch.equal(self._buffers[e.name], e.tensor.detach().to("cpu")) for e in entries)

    def _check_other_run(self, step):
        """Said once, at the first save of a run that did not load: the job already holds
        steps, which restores and retention then mix with this run's."""
        if self._checked_run:
            return
        self._checked_run = True
        if self._loaded or not self._client.committed_count:
            return
        warnings.warn(_advice.other_run(self.job, self._client.committed_steps, self._client.committed_count,
                                        step, "pass trainer.fit(..., ckpt_path='last' or a checkpoint path)"),
                      stacklevel=_user_stacklevel())

    def _lost(self, error, what):
        warnings.warn(f"ckptd: {what}, training continues: {error}", RuntimeWarning,
                      stacklevel=_user_stacklevel())
        self._release()

    def _release(self):
        if self._client is not None:
            try:
                self._client.unregister()
            except ckptd.Error:
                pass  # gone already
        self._client = None
        self._buffers, self._layout = {}, None
        self._unstaged = None
        self._inflight = []
        self._last_step = None
        self._held = set()


# --- the checkpoint dict: tensors and the rest -----------------------------------------------



class _Entry:
    __slots__ = ("path", "name", "tensor")

    def __init__(self, path, name, tensor):
        self.path, self.name, self.tensor = path, name, tensor


def _registrable(value):
    """A tensor that ckptd holds as a tensor: dense, of a dtype it stores, not empty. Others
    (sparse, complex, meta, empty) stay in the train state, serialised with the rest."""
    return (type(value) in (torch.Tensor, torch.nn.Parameter) and value.layout == torch.strided
            and value.dtype in _DTYPES and value.device.type != "meta" and value.numel() > 0)


def _split(checkpoint):
    """(the dict with None where each registrable tensor was, [_Entry]). Containers are
    copied only where a tensor was taken out of them; their types are kept (OrderedDict with
    its _metadata, namedtuples)."""
    entries, names = [], set()

    def strip(value, path):
        if _registrable(value):
            entries.append(_Entry(path, _unique_name(_tensor_name(path), names, len(entries)), value))
            return None, True
        if isinstance(value, dict):
            out, changed = None, False
            for key, item in value.items():
                new, item_changed = strip(item, path + (key,))
                if item_changed:
                    if out is None:
                        out = copy.copy(value)
                    out[key] = new
                    changed = True
            return (out if changed else value), changed
        if isinstance(value, (list, tuple)):
            items = [strip(item, path + (i,)) for i, item in enumerate(value)]
            if not any(changed for _, changed in items):
                return value, False
            return _rebuilt(value, [new for new, _ in items]), True
        return value, False

    skeleton, _ = strip(checkpoint, ())
    return skeleton, entries


def _rebuilt(sequence, items):
    if isinstance(sequence, tuple):
        return type(sequence)(*items) if hasattr(sequence, "_fields") else type(sequence)(items)
    out = copy.copy(sequence)
    out[:] = items
    return out


def _join(skeleton, tensors):
    """The dict `_split` took apart, with `tensors` [(path, tensor)] back in their places."""
    def put(value, path, tensor):
        if not path:
            return tensor
        key, rest = path[0], path[1:]
        if isinstance(value, tuple):
            items = list(value)
            items[key] = put(items[key], rest, tensor)
            return _rebuilt(value, items)
        value[key] = put(value[key], rest, tensor)
        return value

    for path, tensor in tensors:
        skeleton = put(skeleton, tuple(path), tensor)
    return skeleton


def _tensor_name(path):
    """ckptd's name of the tensor at `path` in Lightning's dict: the model's own state-dict
    key for `state_dict` (what `ckptctl export` writes out), `optim.<path>` for the optimizer
    state (which exports leave out), `lightning.<path>` for the rest."""
    if len(path) == 2 and path[0] == "state_dict":
        return str(path[1])
    if path and path[0] == "optimizer_states":
        return "optim." + ".".join(str(p) for p in path[1:])
    return "lightning." + ".".join(str(p) for p in path)


def _unique_name(name, taken, index):
    """`name` made valid for ckptd (printable ASCII without quotes or backslashes, at most
    512 bytes, no leading "__") and unique; otherwise a numbered name."""
    clean = "".join(c if " " <= c <= "~" and c not in "\"\\" else "_" for c in name)
    if not clean or len(clean) > 512 or clean.startswith("__") or clean in taken or clean == _MARKER:
        clean = f"lightning.tensor{index}"
        while clean in taken:
            clean += "_"
    taken.add(clean)
    return clean


def _rng_states():
    """The generators a training step draws from: PyTorch's (CPU, and CUDA once initialised),
    Python's and NumPy's. Lightning's checkpoints hold none of them, so a resumed run would
    draw other dropout masks and augmentations than the run it continues; ckptd.torch saves
    them too. NumPy's as plain numbers, so it reads back as data only."""
    states = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy
    except ImportError:
        return states
    kind, keys, position, has_gauss, cached = numpy.random.get_state()
    states["numpy"] = (kind, keys.tolist(), int(position), int(has_gauss), float(cached))
    return states


def _set_rng_states(states):
    torch.set_rng_state(states["torch"])
    random.setstate(_python_rng(states["python"]))
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
    if "numpy" in states:
        import numpy
        kind, keys, position, has_gauss, cached = states["numpy"]
        numpy.random.set_state((kind, numpy.array(keys, dtype=numpy.uint32), position, has_gauss, cached))


def _python_rng(state):
    """random.setstate wants (version, tuple of ints, gauss): torch.load gives lists back."""
    version, internal, gauss = state
    return version, tuple(internal), gauss


def _loads(data, weights_only):
    """The saved skeleton, read as Lightning reads its files (torch.load; `weights_only`
    None is PyTorch's default, True since 2.6: data only, never code)."""
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=weights_only)


def _device(map_location):
    if map_location is None or callable(map_location) or isinstance(map_location, dict):
        return None  # Lightning moves what it restores to the module's device itself
    return torch.device(map_location)


# --- the file at a checkpoint path -------------------------------------------------------------

def _write_pointer(path, job, step):
    """Writes the small JSON file that names the step at `path`, atomically (a temporary
    file renamed into place), through fsspec as Lightning writes its own files."""
    data = json.dumps({"kind": _POINTER_KIND, "version": _POINTER_VERSION, "job": job,
                       "step": step}).encode() + b"\n"
    path = os.fspath(path)
    if "://" in path:
        fs = _fs(path)
        fs.makedirs(os.path.dirname(path), exist_ok=True)
        fs.pipe(path, data)
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _read_pointer(path):
    """{"job", "step"} from the file at `path`, or None when it is not one of ours."""
    with _fs(path).open(os.fspath(path), "rb") as f:
        head = f.read(4096)
    if not head.startswith(b"{"):
        return None
    try:
        pointer = json.loads(head)
    except ValueError:
        return None
    if not isinstance(pointer, dict) or pointer.get("kind") != _POINTER_KIND:
        return None
    if pointer.get("version") != _POINTER_VERSION:
        raise CheckpointError(f"{path}: a ckptd checkpoint file of version {pointer.get('version')}; "
                              f"this ckptd reads version {_POINTER_VERSION}")
    return {"job": str(pointer["job"]), "step": int(pointer["step"])}


def _read_pointer_quietly(path):
    try:
        return _read_pointer(path)
    except (OSError, CheckpointError):
        return None


def _fs(path):
    return _fabric("utilities.cloud_io").get_filesystem(os.fspath(path))


def _fabric(name):
    """lightning.fabric.<name>, or lightning_fabric.<name> where only pytorch-lightning is
    installed."""
    try:
        return importlib.import_module(f"lightning.fabric.{name}")
    except ImportError:
        return importlib.import_module(f"lightning_fabric.{name}")


def _single_process(what):
    """Lightning saves on rank 0 only but loads on every rank: one process per job is what
    this plugin supports (see docs/python.md)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized() \
            and torch.distributed.get_world_size() > 1:
        raise CheckpointError(f"ckptd.lightning cannot {what} with {torch.distributed.get_world_size()} "
                              "processes yet: use it with one process (one device), or "
                              "ckptd.torch.CheckpointManager in the LightningModule")

"""Hugging Face `transformers.Trainer` checkpointing through ckptd: a `TrainerCallback`.

    from ckptd.transformers import CkptdCallback

    callback = CkptdCallback("my-job", save_steps=100)
    trainer = Trainer(model, TrainingArguments(..., save_strategy="no"), train_dataset=...,
                      callbacks=[callback])
    trainer.train(resume_from_checkpoint=callback.resume_from(trainer))  # None: a new job

Every `save_steps` optimizer steps the callback saves through `ckptd.torch.CheckpointManager`
(the model's parameters and buffers and the optimizer's state registered in place, zero
copy; the LR scheduler, the TrainerState and the RNG states as train state): the save
returns at once and ckptd writes in the background. The Trainer's own resume is what makes
a resumed run continue the interrupted one (it fast-forwards the data loader and restores
the RNG at the right batch), and it reads a folder: `resume_from` restores the newest step
from ckptd and lays out the folder the Trainer reads (the model's weights, trainer_state.json,
rng_state.pth); at `on_train_begin` the callback restores the optimizer and LR scheduler in
place from ckptd. See docs/python.md ("Frameworks").
"""
import dataclasses
import io
import json
import logging
import os
import random
import shutil
import tempfile
import warnings

import numpy
import torch

from ckptd._connection import _user_stacklevel
from ckptd._errors import CheckpointError
from ckptd.torch import CheckpointManager

try:
    from transformers import TrainerCallback
    from transformers.trainer_callback import ExportableState
    from transformers.training_args import ParallelMode
except ImportError as e:
    raise ImportError("ckptd.transformers needs Hugging Face transformers: pip install transformers") from e

__all__ = ["CkptdCallback", "CheckpointError"]

log = logging.getLogger("ckptd")

# The Trainer's file names in a checkpoint folder (transformers' trainer.py).
_TRAINER_STATE = "trainer_state.json"
_WEIGHTS = "model.safetensors"
_SCALER = "scaler.pt"
# extra_state names: what the Trainer restores from the folder, not from ckptd in place.
_FROM_FOLDER = ["trainer_state", "hf_rng", "scaler"]


class CkptdCallback(TrainerCallback):
    """Saves the Trainer's state through ckptd every `save_steps` optimizer steps (the ckptd
    step is `state.global_step`), and resumes it with `resume_from(trainer)`.

    `job` is ckptd's job name: one per training run, kept when the run resumes. The other
    arguments are CheckpointManager's: `keep_last` (ckptd keeps the newest K steps of the
    job), `socket`, `interval_seconds` (save by ckptd's clock instead of, or besides,
    `save_steps`), `daemon_timeout` (how long `resume_from` waits for an unreachable ckptd),
    `upload_every_steps`, `upload_interval_seconds`. `resume_dir` is where `resume_from`
    writes the folder the Trainer resumes from (default: a new temporary directory,
    removed at the end of training).
    """

    def __init__(self, job, save_steps=None, interval_seconds=None, keep_last=None, socket=None,
                 daemon_timeout=120.0, upload_every_steps=None, upload_interval_seconds=None,
                 resume_dir=None):
        if save_steps is None and interval_seconds is None:
            raise ValueError("CkptdCallback needs save_steps or interval_seconds (or both)")
        self.job = job
        self.save_steps = save_steps
        self.interval_seconds = interval_seconds
        self.keep_last = keep_last
        self.socket = socket
        self.daemon_timeout = daemon_timeout
        self.upload_every_steps = upload_every_steps
        self.upload_interval_seconds = upload_interval_seconds
        self.resume_dir = resume_dir
        self.manager = None      # the CheckpointManager, from on_train_begin to on_train_end
        self.restored = None     # the step resume_from restored (a ckptd.torch Restored)
        self._trainer = None     # from resume_from: the callbacks' and the scaler's state
        self._folder = None      # the folder resume_from wrote, and whether it made it
        self._made_folder = False
        self._resuming = False   # resume_from restored a step the next train() continues

    # --- resuming -------------------------------------------------------------------------

    def resume_from(self, trainer, step=None):
        """Restores the job's newest step (or `step`) from ckptd for `trainer.train(
        resume_from_checkpoint=...)`: the model's weights in place, and a folder that the
        Trainer resumes from (the weights, trainer_state.json, rng_state.pth, scaler.pt);
        returns the folder, or None when the job has no checkpoint (a new run: the same
        line starts it). The optimizer and LR scheduler, which the Trainer creates inside
        train(), are restored by the callback when training begins. Raises CheckpointError
        when ckptd is not reachable within `daemon_timeout` (never a silent fresh start)."""
        self._trainer = trainer
        blobs = {name: _Blob() for name in _FROM_FOLDER}
        probe = CheckpointManager(self.job, trainer.model, extra_state=blobs, socket=self.socket,
                                  daemon_timeout=self.daemon_timeout, exclude_from_loading=["optimizer", "rng"])
        try:
            restored = probe.load(step)
        finally:
            probe.close()
        self.restored, self._resuming = restored, restored is not None
        if restored is None:
            return None
        folder = self.resume_dir or tempfile.mkdtemp(prefix=f"ckptd-{self.job}-")
        self._made_folder = self.resume_dir is None
        os.makedirs(folder, exist_ok=True)
        _save_weights(trainer.model, os.path.join(folder, _WEIGHTS))
        with open(os.path.join(folder, _TRAINER_STATE), "w") as f:
            f.write(blobs["trainer_state"].value["json"])
        args = trainer.args
        rng_file = "rng_state.pth" if args.world_size <= 1 else f"rng_state_{args.process_index}.pth"
        with open(os.path.join(folder, rng_file), "wb") as f:
            f.write(blobs["hf_rng"].value["data"])
        if blobs["scaler"].value.get("data"):
            with open(os.path.join(folder, _SCALER), "wb") as f:
                f.write(blobs["scaler"].value["data"])
        self._folder = folder
        log.info("ckptd: job %r: restored step %d from %s; the Trainer resumes from %s",
                 self.job, restored, restored.source, folder)
        return folder

    # --- TrainerCallback --------------------------------------------------------------------

    def on_train_begin(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kwargs):
        extra = {"trainer_state": _TrainerStateSource(self, state, control),
                 "hf_rng": _RngSource(args), "scaler": _ScalerSource(self)}
        self.manager = CheckpointManager(
            self.job, model, _unwrapped(optimizer), _unwrapped(lr_scheduler), extra_state=extra,
            socket=self.socket, interval_steps=self.save_steps, interval_seconds=self.interval_seconds,
            keep_last=self.keep_last, daemon_timeout=self.daemon_timeout,
            upload_every_steps=self.upload_every_steps, upload_interval_seconds=self.upload_interval_seconds)
        if self._resuming:
            self._resuming = False  # a later train() without resume_from starts as it is told
            # The model came from the folder; the Trainer restores the RNG, the TrainerState
            # and the scaler from it too. The optimizer and scheduler come from ckptd, in place.
            self.manager.load(step=int(self.restored), exclude=["model", "rng"] + _FROM_FOLDER)
            if state.global_step != int(self.restored):
                raise CheckpointError(f"the Trainer resumed at step {state.global_step}, ckptd "
                                      f"restored step {int(self.restored)}: pass "
                                      "resume_from_checkpoint=callback.resume_from(trainer)")

    def on_step_end(self, args, state, control, **kwargs):
        if self._made_folder and self._folder is not None:
            # The Trainer has read all of it (the RNG file last, before this first step).
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = None
        if self.manager is not None:
            self.manager.maybe_save(state.global_step)

    def on_train_end(self, args, state, control, **kwargs):
        """Waits until the latest save is committed (a finished train() leaves its
        checkpoint durable, as the Trainer's own files would be) and leaves ckptd."""
        if self.manager is None:
            return
        try:
            self.manager.wait(committed=True)
        except CheckpointError as e:
            warnings.warn(f"ckptd: the last checkpoint of job {self.job!r} is not committed: {e}",
                          RuntimeWarning, stacklevel=_user_stacklevel())
        self.manager.close()
        self.manager = None
        if self._made_folder and self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
        # `restored` stays: what the run resumed from, to read after train().
        self._folder, self._made_folder = None, False


# --- what goes in as train state -------------------------------------------------------------

class _Blob:
    """An extra_state entry read back as it was saved (the resume folder's files)."""

    def __init__(self):
        self.value = {}

    def state_dict(self):
        return self.value

    def load_state_dict(self, value):
        self.value = value


class _TrainerStateSource:
    """The TrainerState as the Trainer writes trainer_state.json at a save: the callbacks
    that export state (EarlyStoppingCallback, the TrainerControl) updated to this moment."""

    def __init__(self, callback, state, control):
        self.callback, self.state, self.control = callback, state, control

    def state_dict(self):
        saved = json.loads(json.dumps(dataclasses.asdict(self.state)))  # a copy, as save_to_json writes it
        trainer = self.callback._trainer
        callbacks = (trainer.callback_handler.callbacks if trainer is not None else []) + [self.control]
        exported = {}
        for cb in callbacks:
            if isinstance(cb, ExportableState):
                exported.setdefault(type(cb).__name__, []).append(cb.state())
        for name, states in exported.items():
            saved.setdefault("stateful_callbacks", {})[name] = states if len(states) > 1 else states[0]
        return {"json": json.dumps(saved, indent=2, sort_keys=True) + "\n"}

    def load_state_dict(self, value):
        raise AssertionError("restored from the resume folder by the Trainer")


class _RngSource:
    """The RNG states in the Trainer's own rng_state.pth format (Python, NumPy, PyTorch's CPU
    and CUDA generators), which the Trainer restores at the batch where the resumed run
    picks up: after its fast-forward through the data loader."""

    def __init__(self, args):
        self.args = args

    def state_dict(self):
        states = {"python": random.getstate(), "numpy": numpy.random.get_state(),
                  "cpu": torch.random.get_rng_state()}
        if torch.cuda.is_available():
            states["cuda"] = (torch.cuda.random.get_rng_state_all()
                              if self.args.parallel_mode == ParallelMode.DISTRIBUTED
                              else torch.cuda.random.get_rng_state())
        buffer = io.BytesIO()
        torch.save(states, buffer)
        return {"data": buffer.getvalue()}

    def load_state_dict(self, value):
        raise AssertionError("restored from the resume folder by the Trainer")


class _ScalerSource:
    """The mixed-precision GradScaler's state (fp16), when there is one."""

    def __init__(self, callback):
        self.callback = callback

    def state_dict(self):
        trainer = self.callback._trainer
        scaler = getattr(getattr(trainer, "accelerator", None), "scaler", None)
        if scaler is None:
            return {}
        buffer = io.BytesIO()
        torch.save(scaler.state_dict(), buffer)
        return {"data": buffer.getvalue()}

    def load_state_dict(self, value):
        raise AssertionError("restored from the resume folder by the Trainer")


def _unwrapped(obj):
    """Accelerate's AcceleratedOptimizer / AcceleratedScheduler hold the real one."""
    if obj is None:
        return None
    for attr in ("optimizer", "scheduler"):
        inner = getattr(obj, attr, None)
        if type(obj).__name__.startswith("Accelerated") and inner is not None:
            return inner
    return obj


def _save_weights(model, path):
    """The model's state dict as a safetensors file, every key included (a tensor that
    shares storage with an earlier one, a tied weight, is written as a copy), so that the
    Trainer's load_state_dict finds every key and warns about none."""
    from safetensors.torch import save_file
    tensors, storages = {}, set()
    for key, value in model.state_dict().items():
        value = value.detach()
        storage = value.untyped_storage().data_ptr()
        shared = storage in storages
        storages.add(storage)
        tensors[key] = value.clone() if shared or not value.is_contiguous() else value
    save_file({k: v.cpu() for k, v in tensors.items()}, path, metadata={"format": "pt"})

"""torchtitan's checkpoints through ckptd: a checkpoint manager for torchtitan's Trainer.

    torchrun --nproc-per-node 8 -m torchtitan.train --module llama3 --config llama3_8b \\
        --checkpoint.enable --checkpoint.interval 500 --checkpoint.async_mode async \\
        --override.imports 'ckptd.torchtitan.ckptd_checkpoint={"job": "llama3-8b"}'

`--override.imports` is torchtitan's own switch for swapping a component: the override
`ckptd_checkpoint` replaces the `[checkpoint]` config with `CkptdCheckpointManager.Config`,
keeping every `checkpoint.*` option given (interval, keep_latest_k, async_mode,
last_save_model_only, export_dtype, load_step, exclude_from_loading, initial_load_path...),
and the Trainer builds `CkptdCheckpointManager` where it would build its DCP
`CheckpointManager`. A config_registry function does the same in Python:
`config.checkpoint = ckptd_checkpoint(config.checkpoint, job="llama3-8b")`.

The manager saves and restores through `ckptd.torch.CheckpointManager`: the model parts'
parameters (DTensor shards included) and the optimizers' state registered in place, zero
copy; the LR schedulers, the data loader, the trainer's step and the RNG states as train
state. A job with nothing in ckptd falls back to torchtitan's own load (a DCP checkpoint in
`checkpoint.folder`, `initial_load_path`, HF weights), so a job switches to ckptd with the
same arguments. See docs/python.md ("torchtitan").
"""
import logging
import os
import warnings
from dataclasses import dataclass

import torch

from ckptd._errors import CheckpointError
from ckptd._placement import DTensor, is_dtensor
from ckptd.torch import CheckpointManager

try:
    from torchtitan.components.checkpointer import (DATALOADER, LR_SCHEDULER, MODEL, OPTIMIZER,
                                                    BaseCheckpointManager, ModelWrapper)
    from torchtitan.components.checkpointer import CheckpointManager as _DcpCheckpointManager
    from torchtitan.config import TORCH_DTYPE_MAP
    from torchtitan.config.override import derive, override
    from torchtitan.tools import filesystem
except ImportError as e:
    raise ImportError("ckptd.torchtitan needs torchtitan 0.3 (its Configurable checkpointers and "
                      f"--override.imports): pip install torchtitan ({e})") from e

__all__ = ["CkptdCheckpointManager", "ckptd_checkpoint", "CheckpointError"]

log = logging.getLogger("ckptd")

# torchtitan's keep_latest_k=0 keeps every step. A job's keep_last of 0 means the daemon's
# --keep-last to ckptd (3 by default), so "all" is asked for as the most a job can ask for.
_KEEP_ALL = (1 << 32) - 1


class CkptdCheckpointManager(_DcpCheckpointManager):
    """torchtitan's checkpoint manager, with ckptd in place of DCP.

    It subclasses torchtitan's DCP `CheckpointManager` for what ckptd does not replace: a
    job that ckptd holds nothing of loads as torchtitan would (the newest DCP step in
    `checkpoint.folder`, else `initial_load_path` or the HF assets), and its next save goes
    to ckptd. Everything else is ckptd's: saves, restores, retention, the final export.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(_DcpCheckpointManager.Config):
        job: str = ""
        """ckptd's job name (one per training run; a resumed run keeps it). Default: $CKPTD_JOB."""

        socket: str = ""
        """ckptd's socket. Default: $CKPTD_SOCKET, else /run/ckptd/ckptd.sock."""

        daemon_timeout: float = 120.0
        """How long a load waits for an unreachable ckptd before raising (never a silent fresh start)."""

        interval_seconds: float = 0.0
        """Also save by time, on ckptd's clock (the same steps on every rank); 0: by steps only."""

        save_on_sigterm: bool = False
        """On SIGTERM, save the step in progress, wait until ckptd holds it, then stop. Off: $CKPTD_SAVE_ON_SIGTERM decides."""

    def __init__(self, config, *, dataloader, model_parts, optimizers, lr_schedulers, states,
                 sd_adapter, base_folder=""):
        self.enable = config.enable
        if not self.enable:
            return
        self.save_future = None
        self.manager = None  # __del__ -> _close() may run before it exists (a refused config)
        job = config.job or os.environ.get("CKPTD_JOB", "")
        if not job:
            raise ValueError("ckptd.torchtitan: no job name: pass it to the override "
                             "(--override.imports 'ckptd.torchtitan.ckptd_checkpoint={\"job\": "
                             "\"my-run\"}') or set CKPTD_JOB")
        if config.create_seed_checkpoint:
            raise ValueError("checkpoint.create_seed_checkpoint: ckptd restores a job onto any "
                             "mesh or world size, so it needs no seed checkpoint; to make one for "
                             "DCP, run without the ckptd override")
        if config.last_save_in_hf:
            raise ValueError("checkpoint.last_save_in_hf: ckptd exports the last step's weights "
                             f"as the job '{job}-weights'; write a Hugging Face folder from it with "
                             "`ckptctl export` (docs/operators.md)")

        # What torchtitan's own load reads (the fallback when ckptd holds nothing of the job).
        self.folder = filesystem.join(base_folder, config.folder)
        self.interval = config.interval
        self.states = states
        self.states.update({MODEL: ModelWrapper(model_parts), OPTIMIZER: optimizers,
                            DATALOADER: dataloader, LR_SCHEDULER: lr_schedulers})
        self.load_only = config.load_only
        self.exclude_from_loading = list(config.exclude_from_loading)
        for key in self.exclude_from_loading:
            if key not in self.states:
                raise ValueError(f"checkpoint.exclude_from_loading: {key!r} is none of {sorted(self.states)}")
        self.initial_load_path = config.initial_load_path
        self.initial_load_model_only = config.initial_load_model_only
        self.initial_load_in_hf = config.initial_load_in_hf
        self.initial_load_in_hf_quantized = config.initial_load_in_hf_quantized
        self.enable_first_step_checkpoint = config.enable_first_step_checkpoint
        self.last_save_model_only = config.last_save_model_only
        self.last_save_in_hf = False
        self.export_dtype = TORCH_DTYPE_MAP[config.export_dtype]
        self.keep_latest_k = config.keep_latest_k
        self.sd_adapter = sd_adapter
        self.async_mode = config.async_mode
        # DCP's asynchronous machinery, unused: ckptd copies and writes in its own process.
        self.pg, self.stager, self.staging_future, self.purge_thread = None, None, None, None

        self.job = job
        self.model_parts = list(model_parts)
        extra = {name: obj for name, obj in states.items()
                 if name not in (MODEL, OPTIMIZER, LR_SCHEDULER) and obj is not None}
        # torchtitan's keys are ckptd.torch's: "optimizer", "lr_scheduler" and the extra
        # states by name ("dataloader", "train_state"); a state that is None has nothing to skip.
        exclude = [key for key in self.exclude_from_loading if key in (OPTIMIZER, LR_SCHEDULER) or key in extra]
        self.manager = CheckpointManager(
            job, self.model_parts,
            # OptimizersContainer / LRSchedulersContainer: ckptd registers each optimizer's
            # state in place and hooks each optimizer's step.
            getattr(optimizers, "optimizers", optimizers), getattr(lr_schedulers, "schedulers", lr_schedulers),
            extra_state=extra, socket=config.socket or None,
            interval_seconds=config.interval_seconds or None,
            keep_latest_k=config.keep_latest_k or _KEEP_ALL, daemon_timeout=config.daemon_timeout,
            save_on_sigterm=config.save_on_sigterm or None, exclude_from_loading=exclude)
        # A job ckptd holds nothing of loads torchtitan's way (_load): the manager's load()
        # leaves the misspelt-job warning to _load, which gives it only for a fresh start.
        self.manager._fallback = True
        self.restored = None  # what _load restored from ckptd (a ckptd.torch Restored)
        log.info("ckptd: torchtitan checkpoints of job %r go to ckptd at %s (every %d steps, "
                 "async_mode %s, keep_latest_k %d)", job, self.manager.socket, self.interval,
                 self.async_mode, self.keep_latest_k)

    # --- BaseCheckpointManager ---------------------------------------------------------------

    @torch.no_grad()
    def _save(self, curr_step, last_step=False):
        """torchtitan calls this after every step. Saves at the interval (and step 1 with
        enable_first_step_checkpoint, and by ckptd's clock with interval_seconds, and on
        SIGTERM with save_on_sigterm); the last step is the export or a full save, committed
        before it returns. How long a save holds training is async_mode's (see the docs)."""
        if self.load_only:
            return False
        if last_step:
            return self._save_last(curr_step)
        if curr_step % self.interval == 0 or (curr_step == 1 and self.enable_first_step_checkpoint):
            queued = self.manager.save(curr_step)
        else:
            queued = self.manager.maybe_save(curr_step)  # by time, or the step after a SIGTERM
        if queued:
            self._after_save()
        return queued

    def _after_save(self):
        if self.async_mode == "disabled":      # returns when durable, as DCP's save
            self._committed()
        elif self.async_mode == "async":       # returns when ckptd holds a copy, as DCP's async_save
            self.manager.wait_staged()
            self.save_future = self.manager
        else:                                  # async_with_pinned_mem: the copy overlaps the next step
            self.staging_future = self.save_future = self.manager

    def _committed(self):
        """Waits until the latest save is committed on every rank. A step ckptd fails or
        refuses (a step the job already holds, after a resume from an older one) is a
        warning, as everything ckptd answers a save is: training goes on."""
        try:
            self.manager.wait(committed=True)
        except CheckpointError as e:
            warnings.warn(f"ckptd: job {self.job!r}: {e}", RuntimeWarning, stacklevel=2)

    def _save_last(self, step):
        """torchtitan's last step, synchronous as its own: a model-only export in export_dtype
        (the job '<job>-weights', under the model's state-dict keys, as DCP would hold them),
        or with last_save_model_only=False a full checkpoint of the job."""
        if not self.last_save_model_only:
            queued = self.manager.save(step)
            if queued:
                self._committed()
            self.save_future = self.staging_future = None
            return queued
        self._export_weights(step)
        return True

    def _export_weights(self, step):
        # torchtitan's canonical keys (a fused wqkv split into wq/wk/wv by its state_dict
        # hook, activation-checkpoint wrappers left out), each tensor copied once in the
        # export dtype: the copy owns its memory, which the export registers.
        state = {key: _export_copy(value, self.export_dtype)
                 for key, value in self.states[MODEL].state_dict().items() if torch.is_tensor(value)}
        exporter = CheckpointManager(self.job, _StateDictModule(state), socket=self.manager.socket,
                                     rank=self.manager.rank, world_size=self.manager.world_size)
        try:
            name = exporter.save_weights(step, job=f"{self.job}-weights")
        finally:
            exporter.close()
        log.info("ckptd: step %d exported (model only, %s) as the job %r", step,
                 str(self.export_dtype).replace("torch.", ""), name)

    @torch.no_grad()
    def _load(self, step=-1):
        """Restores the job's newest step from ckptd (or `step`, torchtitan's load_step),
        every rank the same. With nothing in ckptd, torchtitan's own load: the newest DCP step
        in checkpoint.folder (a job switching to ckptd), else initial_load_path or the HF
        assets, else a fresh start."""
        if step != -1 and step not in [c["step"] for c in self.manager.list_checkpoints()] \
                and filesystem.isdir(self._create_checkpoint_id(step)):
            return _DcpCheckpointManager._load(self, step)  # a DCP step of the job's folder
        restored = self.manager.load() if step == -1 else self.manager.load(step=step)
        if restored is not None:
            self.restored = restored
            return True
        loaded = _DcpCheckpointManager._load(self, step)
        if not loaded:
            self.manager._warn_near_jobs()  # a fresh start: a misspelt job name would be one
        return loaded

    def _maybe_wait_for_staging(self):
        # Before the optimizer step (torchtitan calls it): the manager's own step hook
        # would wait there too.
        self.manager.wait_staged()
        self.staging_future = None

    def _wait_for_saving(self):
        self.manager.wait(committed=True)
        self.save_future = self.staging_future = None

    def _close(self):
        manager, self.manager = getattr(self, "manager", None), None
        if manager is not None:
            manager.close()  # waits until ckptd holds the latest step; ckptd commits it


@override(target=BaseCheckpointManager.Config,
          description="ckptd: checkpoints through the node's ckptd daemon (ckptd.torchtitan)")
def ckptd_checkpoint(config, **options):
    """torchtitan's `[checkpoint]` config as `CkptdCheckpointManager.Config`: every option it
    holds is kept; `options` sets ckptd's own (`job`, `socket`, `daemon_timeout`,
    `interval_seconds`, `save_on_sigterm`) or overrides others. Activated with
    `--override.imports 'ckptd.torchtitan.ckptd_checkpoint={"job": "my-run"}'`, or called
    in a config_registry function."""
    if not config.enable:
        log.warning("ckptd: checkpoint.enable is off: the ckptd override changes nothing until "
                    "--checkpoint.enable is given")
    return derive(config, CkptdCheckpointManager.Config, **options)


class _StateDictModule(torch.nn.Module):
    """A state dict as a module whose persistent buffers carry its keys, for save_weights."""

    def __init__(self, state):
        super().__init__()
        for key, tensor in state.items():
            *path, leaf = key.split(".")
            module = self
            for part in path:
                if part not in module._modules:
                    module.add_module(part, torch.nn.Module())
                module = module._modules[part]
            module.register_buffer(leaf, tensor)


def _export_copy(tensor, dtype):
    """A copy of `tensor` (its local shard for a DTensor, same placements) in `dtype` when it
    is floating-point."""
    tensor = tensor.detach()
    if not is_dtensor(tensor):
        return tensor.to(dtype=dtype if tensor.is_floating_point() else tensor.dtype, copy=True)
    local = tensor._local_tensor
    copy = local.to(dtype=dtype if local.is_floating_point() else local.dtype, copy=True)
    return DTensor.from_local(copy, tensor.device_mesh, tensor.placements, run_check=False,
                              shape=tensor.shape, stride=tensor.stride())

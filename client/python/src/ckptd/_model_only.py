"""A step that holds the model only: a seed checkpoint (torchtitan's step 0), a
`save_weights()` step, a step saved by a manager without an optimizer. Loaded into a manager
with an optimizer, the optimizer starts fresh instead of the load failing, and so do the LR
scheduler and the extra_state objects the step has no state for; one warning names them.

A step saved with an optimizer always carries its parameter groups ("optim.param_groups" in
the train state), however few tensors the optimizer had: a step without them, and without
any "optim.*" tensor, holds no optimizer state at all.
"""
import torch

OPTIMIZER_TENSORS = "optim.*"


def holds_no_optimizer(train_state, optimizer_tensors):
    """Whether a step holds no optimizer state: no parameter groups in `train_state` and no
    optimizer tensor (`optimizer_tensors`: how many "optim.*" tensors it holds, as far as
    the caller can tell)."""
    return "optim.param_groups" not in train_state and not optimizer_tensors


def absent_parts(manager, train_state, skip_state):
    """What of the manager's state a model-only step has nothing for: [(train-state prefix,
    how the warning names it)], the optimizer first."""
    absent = []
    if manager.optimizer is not None and "optim" not in skip_state:
        absent.append(("optim", "the optimizer (its state and hyper-parameters)"))
    if manager.lr_scheduler is not None and "lr_scheduler" not in skip_state and "lr_scheduler" not in train_state:
        absent.append(("lr_scheduler", "the LR scheduler"))
    for name, obj in manager.extra_state.items():
        key = f"extra.{name}"
        if key not in skip_state and key not in train_state and not torch.is_tensor(obj):
            absent.append((key, f"extra_state[{name!r}]"))
    return absent


def warning(step, where, absent):
    names = ", ".join(what for _, what in absent)
    return (f"ckptd: step {step}{where} holds the model only (a seed or weights-only checkpoint): "
            f"nothing in it for {names}, which start{'s' if len(absent) == 1 else ''} fresh. Pass "
            "exclude=['optimizer', ...] to say so and silence this")

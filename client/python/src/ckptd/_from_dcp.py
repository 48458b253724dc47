"""Loading a torch.distributed.checkpoint (DCP) directory into a model and its optimizer: a
job switching to ckptd (`CheckpointManager.load(from_dcp=PATH)`).

People save DCP checkpoints in several layouts: torchtitan's model keys at the top and the
optimizer flattened under "optimizer."; `{"model": ..., "optimizer": ...}`; the DCP
tutorial's `{"app": AppState}` (keys "app.model.*" and "app.optim.*"). The layout is found
from the keys the checkpoint holds: where the model's own keys are, and beside them the
optimizer, LR scheduler and extra state. Needs PyTorch 2 (ckptd.dcp says so on import).
"""
from ckptd._errors import CheckpointError

# Where model keys are looked for first (and named in the error when none fits).
_COMMON_PREFIXES = ("", "model.", "app.model.")
_OPTIMIZER_NAMES = ("optimizer", "optim")
# How many of the model's keys are tried to find where the checkpoint keeps them.
_KEYS_TRIED = 64


def load_into(path, model, optimizer=None, lr_scheduler=None, extra_state=None):
    """Loads the DCP checkpoint at `path` into `model` and, where the checkpoint has them,
    `optimizer`, `lr_scheduler` and every `extra_state` object, in place. Wrapper prefixes
    (torch.compile, FSDP) do not matter. A tensor the model has and the checkpoint lacks is
    an error naming it (DCP's)."""
    import ckptd.dcp  # noqa: F401 - the PyTorch 2 check, with its message
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict,
                                                         set_model_state_dict,
                                                         set_optimizer_state_dict)

    keys = set(FileSystemReader(path).read_metadata().state_dict_metadata)
    model_state = get_model_state_dict(model)
    prefix = _model_prefix(keys, model_state)
    base = prefix[:prefix.rstrip(".").rfind(".") + 1] if prefix else ""  # "app.model." -> "app."
    has = lambda key: any(k == key or k.startswith(key + ".") for k in keys)

    parts = {prefix.rstrip(".") or None: model_state}
    options = None
    optimizer_key = next((base + n for n in _OPTIMIZER_NAMES if has(base + n)), None)
    if optimizer is not None and optimizer_key is not None:
        # Flattened (torchtitan): param_groups keyed by parameter name, without the
        # per-group "params" lists that the nested form has.
        flat = not any(k.startswith(optimizer_key + ".param_groups.") and k.endswith(".params")
                       for k in keys)
        options = StateDictOptions(flatten_optimizer_state_dict=flat)
        parts[optimizer_key] = get_optimizer_state_dict(model, optimizer, options=options)
    if lr_scheduler is not None and has(base + "lr_scheduler"):
        parts[base + "lr_scheduler"] = lr_scheduler.state_dict()
    for name, obj in (extra_state or {}).items():
        if has(base + name):
            parts[base + name] = obj.state_dict()

    state = {}
    for dotted, value in parts.items():
        if dotted is None:  # the model's keys at the top
            state.update(value)
        else:
            _put(state, dotted, value)
    dcp.load(state, checkpoint_id=path)
    loaded = lambda dotted: _get(state, dotted) if dotted else {k: state[k] for k in model_state}
    set_model_state_dict(model, loaded(prefix.rstrip(".")))
    if optimizer is not None and optimizer_key is not None:
        set_optimizer_state_dict(model, optimizer, _get(state, optimizer_key), options=options)
    if lr_scheduler is not None and base + "lr_scheduler" in parts:
        lr_scheduler.load_state_dict(_get(state, base + "lr_scheduler"))
    for name, obj in (extra_state or {}).items():
        if base + name in parts:
            obj.load_state_dict(_get(state, base + name))


def _model_prefix(keys, model_state):
    """Where the checkpoint keeps the model's keys: the prefix ("", "model.", "app.model.",
    ...) under which most of them are found. CheckpointError naming what was tried and what
    the checkpoint holds when none is."""
    counts = {}
    for wanted in list(model_state)[:_KEYS_TRIED]:
        for key in keys:
            if key == wanted or key.endswith("." + wanted):
                prefix = key[:len(key) - len(wanted)]
                counts.setdefault(prefix, sum(prefix + k in keys for k in model_state))
        if counts:
            break
    if counts:
        best = max(counts.values())
        winners = sorted(p for p, n in counts.items() if n == best)
        common = [p for p in winners if p in _COMMON_PREFIXES]
        if len(winners) == 1 or len(common) == 1:
            return (common or winners)[0]
        # Two copies of the model (an EMA beside the weights, a teacher and a student): which
        # one is meant is not the reader's guess, and every rank must take the same.
        raise CheckpointError(
            f"the DCP checkpoint holds the model's keys under {len(winners)} prefixes equally "
            f"({', '.join(repr(p) for p in winners)}): it holds several copies of the model; load the one "
            "you mean with torch.distributed.checkpoint directly")
    example = next(iter(model_state), "?")
    tops = sorted({k.split(".")[0] for k in keys})
    shown = sorted(keys)[:5]
    raise CheckpointError(
        f"none of the model's keys (e.g. {example!r}) is in the DCP checkpoint, "
        f"under any prefix: tried {', '.join(repr(p) for p in _COMMON_PREFIXES)} and any other. "
        f"It holds {len(keys)} keys under {', '.join(map(repr, tops[:8]))}"
        f"{' ...' if len(tops) > 8 else ''}, e.g. {', '.join(shown)}. Is it this model's checkpoint?")


def _put(state, dotted, value):
    node = state
    *parents, leaf = dotted.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value


def _get(state, dotted):
    node = state
    for part in dotted.split("."):
        node = node[part]
    return node

"""FSDP1 (`FullyShardedDataParallel`): its flat parameters registered as the original ones.

FSDP1 concatenates the parameters of each wrapped module into one 1-D `FlatParameter` and
gives every rank an equal slice of it, the last one padded. A checkpoint keyed by that
(`layers.0._flat_param`, a rank's slice) would mean nothing outside this very job, so each
original parameter is registered under its own key (the FQN the model has without FSDP, as
FSDP's own state dicts name it) as a flat shard: the elements of the flattened parameter
that this rank holds, as ranges of the global tensor (docs/format.md). Restores then fill
them from any world size and any placement, and other placements restore from them.

The rank's slice moves into shared memory once, whole (padding included, not checkpointed),
its pieces registered in place (`allocate_flat_shard`), and FSDP's own references to it are
pointed there, as FSDP2's padded shard is in _placement.py. Optimizer state shaped like the
slice (Adam's moments) is split the same way under `optim.<fqn>.<key>`. A scalar one (Adam's
`step`, one per FlatParameter) is registered under every original parameter this rank holds,
as a plain model has it: the first of those names holds the tensor the optimizer updates,
the others are copies refreshed after each optimizer step. So the rank registers the same
names whatever it restores from, and every name a plain model, FSDP2 or FSDP1 on another
world size asks for is in the checkpoint.

With `use_orig_params=True` the model's parameters are the original ones already, each a
1-D view into the slice: they are pieces of the slice as above, and their optimizer state
(shaped like the view) a flat shard of its own.

This reads FSDP1's internals, as PyTorch 2 has them: `FullyShardedDataParallel._handle`, its
`flat_param` and `_use_orig_params`, and the FlatParameter's `_fqns`, `_shapes`,
`_shard_param_infos`, `_params` and `_local_shard`. Nothing here imports FSDP (Debian's
PyTorch 1.13 cannot import it on Python 3.11): a model without it costs one walk of its
modules.
"""
import weakref

import torch

from ckptd._placement import Local
from ckptd._state_dict import _WRAPPER_PARTS, _Entry

_FLAT_PARAM = "_flat_param"  # FSDP1's name for the FlatParameter in named_parameters()

# A FlatParameter's copies of its scalar optimizer state, which the names after the first
# hold (see above): {name: (state key, copy)}, kept on the FlatParameter as this attribute.
_COPIES = "_ckptd_state_copies"
# Optimizer -> {id(FlatParameter): FlatParameter} whose copies its steps refresh.
_hooked = weakref.WeakKeyDictionary()


def split(model, optimizer, entries, error):
    """Each entry with its part, as (entry, Local); the part is None where the entry is not
    FSDP1's (_placement.local_part decides), and a FlatParameter or its optimizer state
    becomes one entry per original parameter that this rank holds (none if it holds none).
    `error(message)` makes the exception to raise."""
    handles = _handles(model)
    if not handles:
        return [(e, None) for e in entries]
    by_tensor = {id(e.tensor): e for e in entries}
    expand = {}  # id(entry's tensor) -> entry -> [(entry, Local)]
    for handle in handles:
        _plan(handle, by_tensor, optimizer, expand, error)
    out = []
    for e in entries:
        how = expand.get(id(e.tensor))
        out.extend(how(e) if how is not None else [(e, None)])
    return out


def _handles(model):
    """FSDP1's FlatParamHandles in `model`, each once."""
    found = {}
    for module in model.modules():
        # `_handle` from PyTorch 2.1 on; 2.0 kept a list (whose FlatParameters _plan refuses).
        for handle in getattr(module, "_handles", None) or [getattr(module, "_handle", None)]:
            flat = getattr(handle, "flat_param", None)
            if flat is not None and (getattr(flat, "_is_flat_param", False)
                                     or type(flat).__name__ == "FlatParameter"):
                found.setdefault(id(flat), handle)
    return list(found.values())


def _plan(handle, by_tensor, optimizer, expand, error):
    flat = handle.flat_param
    orig = bool(getattr(handle, "_use_orig_params", False))
    names = _names(flat, orig, by_tensor)
    if names is None:
        return  # FSDP1 applied to a module outside this model: none of its tensors is here
    where = names[0] or "FullyShardedDataParallel"
    for attr in ("_fqns", "_shapes", "_shard_param_infos"):
        if not hasattr(flat, attr):
            raise error(f"tensor {where}: this PyTorch's FSDP1 FlatParameter has no {attr}; "
                        f"ckptd reads FSDP1 from PyTorch 2.1 on (this is {torch.__version__})")
    if flat.is_cuda:
        raise error(f"tensor {where}: FSDP1 flat parameters on a GPU are not supported yet "
                    "(ckptd registers them on the CPU only)")
    local = getattr(flat, "_local_shard", None)
    if local is not None and flat.data_ptr() != local.data_ptr():
        raise error(f"tensor {where}: FSDP1 holds its parameters unsharded now (inside "
                    "summon_full_params, or between a forward and its backward): save and "
                    "load between training steps")
    data = flat.data
    held = []  # (index, name, global shape, begin, end, at in the slice)
    for i, info in enumerate(flat._shard_param_infos):
        if info.in_shard and info.numel_in_shard and names[i] is not None:
            held.append((i, names[i], tuple(flat._shapes[i]), info.intra_param_start_idx,
                         info.intra_param_end_idx + 1, info.offset_in_shard))
    model_shard = _Shard(data, held, _relocate_flat(handle, orig))
    pieces = {i: _piece(data, shape, begin, end, at, model_shard) for i, _, shape, begin, end, at in held}
    if orig:
        for i, p in enumerate(flat._params):
            if names[i] is not None:
                part = pieces.get(i) or Local(data[:0])  # none of it here: nothing to register
                expand[id(p)] = lambda e, part=part: [(e, part)]
    else:
        expand[id(flat)] = lambda e: [(_Entry(name, pieces[i].tensor, None), pieces[i])
                                      for i, name, *_ in held]
    index = {id(p): i for i, p in enumerate(flat._params)} if orig else {}
    for p, key, value in _optimizer_state(optimizer, flat, orig):
        if id(value) not in by_tensor:
            continue
        if orig:
            mine = [h for h in held if h[0] == index[id(p)]]
            how = _orig_state(key, value, mine, error)
        elif value.dim() == 0:
            how = _scalar_state(flat, key, value, held)
            _hook(optimizer, flat)
        elif value.shape == data.shape:
            how = _flat_state(key, value, held)
        else:
            raise error(f"tensor optim.{held[0][1] if held else where}.{key}: optimizer state of "
                        f"shape {tuple(value.shape)} for an FSDP1 flat parameter of "
                        f"{tuple(data.shape)} elements cannot be split by parameter")
        expand[id(value)] = how


def _names(flat, orig, by_tensor):
    """Each original parameter's checkpoint key, in the FlatParameter's order (None where it
    is not in the model), or None when none is."""
    if orig:
        names = [by_tensor[id(p)].name if id(p) in by_tensor else None for p in flat._params]
        return names if any(names) else None
    entry = by_tensor.get(id(flat))
    if entry is None:
        return None
    prefix = entry.name[:-len(_FLAT_PARAM)] if entry.name.endswith(_FLAT_PARAM) else f"{entry.name}."
    return [prefix + ".".join(part for part in fqn.split(".") if part not in _WRAPPER_PARTS)
            for fqn in flat._fqns]


def _piece(data, shape, begin, end, at, shard):
    """The Local of one original parameter's elements [begin, end) at `at` in a slice."""
    return Local(data[at:at + end - begin], shape, flat=[(begin, end)], shard=shard)


def _relocate_flat(handle, orig):
    def relocate(buffer):
        flat = handle.flat_param
        # FSDP1 all-gathers from, and the optimizer updates, flat_param.data; after each
        # reshard FSDP sets it to _local_shard again: both must be the shared memory.
        flat.data = buffer
        if hasattr(flat, "_local_shard"):  # set at FSDP's lazy initialisation
            flat._local_shard = buffer
        if orig:  # the original parameters are views into the slice: view the new one
            handle._use_sharded_views()
    return relocate


def _optimizer_state(optimizer, flat, orig):
    """(parameter, key, tensor) of the optimizer state that FSDP1's parameters have."""
    if optimizer is None:
        return
    params = list(flat._params) if orig else [flat]
    for p in params:
        for key, value in sorted(optimizer.state.get(p, {}).items()):
            if torch.is_tensor(value):
                yield p, key, value


def _flat_state(key, value, held):
    """State shaped like the FlatParameter's slice: its pieces, like the parameter's."""
    def how(e):
        shard = _Shard(value, [(i, f"optim.{name}.{key}", *rest) for i, name, *rest in held],
                       lambda buffer: e.replace(buffer.view(value.shape)))
        parts = [(name, _piece(value, shape, begin, end, at, shard)) for _, name, shape, begin, end, at in held]
        return [(_Entry(f"optim.{name}.{key}", part.tensor, None), part) for name, part in parts]
    return how


def _scalar_state(flat, key, value, held):
    """A scalar for the whole FlatParameter (Adam's step): under every original parameter
    this rank holds. The first name holds the optimizer's tensor; the others copies."""
    def how(e):
        if not held:
            return []
        names = [f"optim.{name}.{key}" for _, name, *_ in held]
        copies = flat.__dict__.setdefault(_COPIES, {})
        first = Local(value, relocate=lambda buffer: e.replace(buffer[:1].view(value.shape)))
        out = [(_Entry(names[0], value, e.replace), first)]
        for name in names[1:]:
            copy = copies.get(name, (key, None))[1]
            if copy is None or copy.shape != value.shape or copy.dtype != value.dtype:
                copy = value.detach().clone()
                copies[name] = (key, copy)
            elif copy.data_ptr() != value.data_ptr():
                with torch.no_grad():
                    copy.copy_(value)  # the optimizer's tensor was replaced (load_state_dict)

            def relocate(buffer, name=name):
                copies[name] = (key, buffer[:1].view(value.shape))
            out.append((_Entry(name, copy, None), Local(copy, relocate=relocate)))
        return out
    return how


def _orig_state(key, value, mine, error):
    """use_orig_params=True: a parameter's own state, shaped like its view into the slice."""
    def how(e):
        if not mine:
            return [(e, Local(value[:0] if value.dim() else value.new_empty(0)))]
        _, name, shape, begin, end, _ = mine[0]
        if value.dim() == 0 or (begin == 0 and end == value.numel() and tuple(value.shape) == shape):
            return [(e, None)]  # a scalar, or the whole parameter: as in a plain model
        if value.numel() != end - begin:
            raise error(f"tensor {e.name}: optimizer state of {value.numel()} elements for a "
                        f"parameter of which this rank holds {end - begin}")

        def relocate(buffer):
            e.replace(buffer.view(value.shape))
        return [(e, Local(value, shape, flat=[(begin, end)], relocate=relocate))]
    return how


class _Shard:
    """A tensor whose pieces are registered as tensors of their own (a FlatParameter's slice,
    or optimizer state like it): the first piece to move moves it whole, once per
    registration, through allocate_flat_shard, and `relocate(buffer)` points its owner at
    the shared memory."""

    __slots__ = ("tensor", "pieces", "relocate", "moved")

    def __init__(self, tensor, held, relocate):
        self.tensor, self.relocate, self.moved = tensor, relocate, False
        # (name, global shape, begin, end, at), as allocate_flat_shard takes them.
        self.pieces = [(name, list(shape), begin, end, at) for _, name, shape, begin, end, at in held]

    def move(self, client, dtype):
        if self.moved:
            return
        self.moved = True
        t = self.tensor
        buffer = client.allocate_flat_shard(dtype, t.numel(), self.pieces)
        flat = torch.frombuffer(buffer, dtype=torch.uint8).view(t.dtype)
        with torch.no_grad():
            flat.copy_(t.reshape(-1))
        self.relocate(flat)


def _hook(optimizer, flat):
    """Has each of the optimizers (several for ckptd._parts' OptimizerParts) refresh the
    copies of `flat`'s scalar state after its steps."""
    for o in getattr(optimizer, "optimizers", None) or [optimizer]:
        if o not in _hooked:
            o.register_step_post_hook(_refresh_copies)  # PyTorch >= 2.0
            _hooked[o] = {}
        _hooked[o][id(flat)] = flat


def _refresh_copies(optimizer, args, kwargs):
    """After an optimizer step: the copies of each FlatParameter's scalar state follow it."""
    with torch.no_grad():
        for flat in _hooked.get(optimizer, {}).values():
            state = optimizer.state.get(flat)
            if not state:
                continue
            for key, copy in getattr(flat, _COPIES, {}).values():
                value = state.get(key)
                if torch.is_tensor(value) and copy.data_ptr() != value.data_ptr():
                    copy.copy_(value)

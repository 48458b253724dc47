"""Tables that changed size since a step was saved: load(on_shapes=) and load(resize=True).

Every save records the global shape of each model tensor (parameters, persistent buffers,
extra_state tensors) in the train state, as JSON. A load that is to resize first restores the
train state alone (ckptd restores no tensor when the selection excludes "*"), hands the saved
shapes to a hook that resizes the model (or resizes the first dimension itself: growing
embedding tables, RecIS-style), makes the optimizer state of every resized parameter follow,
and then restores the tensors of that same step into the new shapes.
"""
import json

import torch

from ckptd._errors import CheckpointError
from ckptd._placement import is_dtensor
from ckptd._state_dict import _named_parameters, _persistent_buffers

KEY = "ckptd.shapes"  # the train-state entry
# A bound on the record (about 40 bytes a tensor): past it the step is saved without it,
# and a resizing load of that step says so.
MAX_BYTES = 4 << 20


def record(parts):
    """The train-state entry for the registered `parts` ((entry, Local) pairs): the global
    shape of each model tensor by name; None when it would exceed MAX_BYTES."""
    shapes = {e.name: list(p.global_shape or p.tensor.shape) for e, p in parts if not e.name.startswith("optim.")}
    data = json.dumps(shapes, separators=(",", ":")).encode()
    return data if len(data) <= MAX_BYTES else None


def saved(train_state, step):
    """{name: torch.Size} that step `step` recorded, or CheckpointError."""
    if KEY not in train_state:
        raise CheckpointError(f"step {step} holds no record of its tensors' shapes (it was saved by an older "
                              "ckptd.torch, or by a model too large for the record): load(on_shapes=) and "
                              "load(resize=True) need a step saved since; load it without them into a model "
                              "of the saved shapes")
    try:
        shapes = json.loads(train_state[KEY])
        return {str(name): torch.Size(int(d) for d in shape) for name, shape in shapes.items()}
    except (ValueError, TypeError, AttributeError) as e:
        raise CheckpointError(f"step {step}: its record of shapes cannot be read: {e}") from e


def model_tensors(model, extra_tensors):
    """{name: (tensor, replace(new))} of every tensor a resize may change."""
    out = {}
    for name, p in _named_parameters(model):
        out.setdefault(name, (p, lambda new, p=p: setattr(p, "data", new)))
    for name, module, leaf in _persistent_buffers(model):
        out.setdefault(name, (module._buffers[leaf],
                              lambda new, m=module, leaf=leaf: m._buffers.__setitem__(leaf, new)))
    for name, t in extra_tensors:
        out.setdefault(f"extra.{name}", (t, lambda new, t=t: setattr(t, "data", new)))
    return out


def resize_first_dimension(model, extra_tensors, shapes):
    """What load(resize=True) does: each plain tensor whose saved shape differs from its own
    in the first dimension only gets the saved number of rows (zeros, until the restore fills
    them); an embedding's num_embeddings follows. Other differences are left for the restore
    to name."""
    rows = {}
    for name, (t, replace) in model_tensors(model, extra_tensors).items():
        want = shapes.get(name)
        if want is None or want == t.shape or is_dtensor(t):
            continue
        if len(want) != t.dim() or t.dim() == 0 or want[1:] != t.shape[1:]:
            continue
        with torch.no_grad():
            replace(torch.zeros(want, dtype=t.dtype, device=t.device))
        rows[id(t)] = want[0]
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and id(weight) in rows:
            module.num_embeddings = rows[id(weight)]


class OptimizerFollows:
    """Taken before a resize, applied after it: the optimizer state of every parameter whose
    shape changed is resized with it (each state tensor shaped as the parameter was: Adam's
    exp_avg, Adagrad's sum; scalars such as step stay), as zeros that the restore fills. A
    parameter the hook replaced instead of resizing (a new nn.Parameter) is an error: the
    optimizer would go on updating the old one."""

    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer
        self.names = {name: p for name, p in _named_parameters(model)}
        self.params = [p for g in optimizer.param_groups for p in g["params"]] if optimizer is not None else []
        self.shapes = {id(p): p.shape for p in self.params}

    def apply(self):
        if self.optimizer is None:
            return
        held = {id(p) for p in self.params}
        now = dict(_named_parameters(self.model))
        for name, p in self.names.items():
            if id(p) in held and now.get(name) is not p:
                raise CheckpointError(
                    f"the resize replaced parameter {name} with another object, which the optimizer does not "
                    f"hold: resize it in place (module.weight.data = torch.empty(new_shape)) so that the "
                    "optimizer keeps it")
        for p in self.params:
            old = self.shapes[id(p)]
            if p.shape == old:
                continue
            state = self.optimizer.state.get(p)
            for key, value in list((state or {}).items()):
                if torch.is_tensor(value) and value.shape == old:
                    state[key] = torch.zeros(p.shape, dtype=value.dtype, device=value.device)

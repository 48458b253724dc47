"""Several model parts, optimizers and schedulers per rank (pipeline stages: torchtitan's
`model_parts`, AReaL's lists), seen by the manager as one of each.

A list of model parts keeps each part's own keys, merged (torchtitan's ModelWrapper does the
same: pipeline stages name their parameters apart, "layers.3.w" on one stage and
"layers.4.w" on the next); a dict of named parts puts each part's keys under its name
("encoder.layers.0.w"). Optimizers and schedulers are matched to nothing: an optimizer's
state is keyed by the parameters it holds, wherever they are, and schedulers are saved and
restored in order (a list) or by name (a dict).
"""
import torch

# Children of a ModelParts made from a list: left out of checkpoint keys (_state_dict.py).
PART_PREFIX = "_ckptd_part"


class ModelParts(torch.nn.Module):
    """Model parts as one module: its parameters, buffers and submodules are the parts'."""

    def __init__(self, parts):
        super().__init__()
        if isinstance(parts, dict):
            for name, part in parts.items():
                if not isinstance(name, str) or not name or "." in name:
                    raise ValueError(f"model part name {name!r}: a non-empty name without dots")
                self.add_module(name, _module(part, name))
            self.parts = list(self.children())
            return
        for i, part in enumerate(parts):
            self.add_module(f"{PART_PREFIX}{i}", _module(part, i))
        self.parts = list(self.children())
        # Merged keys must stay apart: two stages with the same name would overwrite each
        # other in every checkpoint.
        owner = {}
        for i, part in enumerate(self.parts):
            for name in dict(part.state_dict(keep_vars=True)):
                if name in owner:
                    raise ValueError(f"model parts {owner[name]} and {i} both have {name!r}: pass a "
                                     "dict of named parts to keep their keys apart")
                owner[name] = i

    def forward(self, *args, **kwargs):
        raise TypeError("ModelParts holds model parts for checkpointing; call the parts")


def _module(part, which):
    if not isinstance(part, torch.nn.Module):
        raise TypeError(f"model part {which!r} is a {type(part).__name__}, not a torch.nn.Module")
    return part


class OptimizerParts:
    """Several optimizers as one: their parameter groups in order, their state by parameter,
    and a step that steps each."""

    def __init__(self, optimizers):
        self.optimizers = list(optimizers.values()) if isinstance(optimizers, dict) else list(optimizers)
        for i, o in enumerate(self.optimizers):
            if not isinstance(o, torch.optim.Optimizer):
                raise TypeError(f"optimizer {i} is a {type(o).__name__}, not a torch.optim.Optimizer")
        self.state = _StateView(self.optimizers)

    @property
    def param_groups(self):
        return [g for o in self.optimizers for g in o.param_groups]

    def step(self):
        for o in self.optimizers:
            o.step()


class _StateView:
    """The optimizers' state as one mapping from parameter to state: each parameter's lives in
    the optimizer that holds it."""

    def __init__(self, optimizers):
        self._optimizers = optimizers
        self._owners = {}  # id(parameter) -> its optimizer's state; rebuilt when one is missing

    def _owner(self, p):
        if id(p) not in self._owners:  # a parameter added to a group since: look again
            self._owners = {id(q): o.state for o in self._optimizers for g in o.param_groups for q in g["params"]}
        return self._owners.get(id(p))

    def get(self, p, default=None):
        state = self._owner(p)
        return state.get(p, default) if state is not None else default

    def __getitem__(self, p):
        state = self._owner(p)
        if state is None:
            raise KeyError("the parameter is in none of the optimizers")
        return state[p]  # the optimizers' own defaultdicts

    def pop(self, p, default=None):
        state = self._owner(p)
        return state.pop(p, default) if state is not None else default


class SchedulerParts:
    """Several LR schedulers as one state dict: a list in order, or a dict by name."""

    def __init__(self, schedulers):
        self.schedulers = schedulers

    def state_dict(self):
        if isinstance(self.schedulers, dict):
            return {name: s.state_dict() for name, s in self.schedulers.items()}
        return [s.state_dict() for s in self.schedulers]

    def load_state_dict(self, state):
        if isinstance(self.schedulers, dict):
            if not isinstance(state, dict) or state.keys() != self.schedulers.keys():
                raise ValueError(f"the checkpoint's schedulers are {sorted(state) if isinstance(state, dict) else 'a list'}, "
                                 f"these {sorted(self.schedulers)}")
            for name, s in self.schedulers.items():
                s.load_state_dict(state[name])
            return
        if not isinstance(state, list) or len(state) != len(self.schedulers):
            raise ValueError(f"the checkpoint has {len(state) if isinstance(state, list) else 'no list of'} "
                             f"schedulers, this job {len(self.schedulers)}")
        for s, saved in zip(self.schedulers, state):
            s.load_state_dict(saved)


def model_of(model):
    return ModelParts(model) if isinstance(model, (list, tuple, dict)) else model


def optimizer_of(optimizer):
    if isinstance(optimizer, (list, tuple, dict)):
        inner = {k: unwrapped(o) for k, o in optimizer.items()} if isinstance(optimizer, dict) else \
            [unwrapped(o) for o in optimizer]
        return OptimizerParts(inner)
    return unwrapped(optimizer)


def scheduler_of(scheduler):
    if isinstance(scheduler, (list, tuple, dict)):
        return SchedulerParts({k: unwrapped(s) for k, s in scheduler.items()} if isinstance(scheduler, dict)
                              else [unwrapped(s) for s in scheduler])
    return unwrapped(scheduler)


# Wrappers that frameworks put around an optimizer or LR scheduler, and where each keeps the
# real one: Accelerate's `accelerator.prepare` (AcceleratedOptimizer, AcceleratedScheduler),
# Lightning's LightningOptimizer. They hold no state of their own (their state_dict() is the
# inner one's), and AcceleratedOptimizer, an Optimizer that never ran Optimizer.__init__, has
# no step hooks. Only these: an optimizer that wraps another and keeps state of its own
# (Lookahead's slow weights) is checkpointed as it is.
_WRAPPERS = {
    ("accelerate.optimizer", "AcceleratedOptimizer"): "optimizer",
    ("accelerate.scheduler", "AcceleratedScheduler"): "scheduler",
    ("lightning.pytorch.core.optimizer", "LightningOptimizer"): "_optimizer",
    ("pytorch_lightning.core.optimizer", "LightningOptimizer"): "_optimizer",
}


def unwrapped(obj):
    """The optimizer or scheduler inside a framework's wrapper (_WRAPPERS), else `obj`."""
    while obj is not None:
        attr = _WRAPPERS.get((type(obj).__module__, type(obj).__name__))
        inner = getattr(obj, attr, None) if attr else None
        if inner is None or inner is obj:
            return obj
        obj = inner
    return obj


def modules(model):
    """The modules whose forward passes run: the parts, or the model itself."""
    return model.parts if isinstance(model, ModelParts) else [model]


def optimizers(optimizer):
    if optimizer is None:
        return []
    return optimizer.optimizers if isinstance(optimizer, OptimizerParts) else [optimizer]

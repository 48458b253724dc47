"""Loading a torch.distributed.checkpoint (DCP) directory into a manager's model, optimizer,
LR scheduler, RNG states and extra_state: a job switching to ckptd
(`CheckpointManager.load(from_dcp=PATH)`).

People save DCP checkpoints in several layouts, and the layout is found from the keys the
checkpoint holds (its metadata; nothing is read before the plan is made):
- the model: where most of the model's own keys are: at the top (torchtitan, and
  `get_state_dict`'s model dict saved as it is), under "model." (`{"model": ..., "optimizer":
  ...}`), "app.model." (the DCP tutorial's `{"app": AppState}`), or any other prefix;
- beside it (under the same parent, "app." for the tutorial): the optimizer ("optimizer",
  "optim", or get_state_dict's "state."/"param_groups." at the top; nested or flattened), the
  LR scheduler ("lr_scheduler", "lr_schedulers", "scheduler", "sched", ...), RNG states
  ("rng", "rng_state", ...: "torch"/"cpu", "cuda", "python", "numpy" inside, per rank or
  not), each extra_state object under its own name (a data loader also under "dataloader",
  "data_loader", "loader"), and torchtitan's "train_state" (its "step" gives the step);
- the rest is named by the user (`from_dcp_keys`), or named in one warning.
Needs PyTorch 2 (ckptd.dcp says so on import).
"""
import random

import torch

from ckptd._errors import CheckpointError

# Where model keys are looked for first (and named in the error when none fits).
_COMMON_PREFIXES = ("", "model.", "app.model.")
_OPTIMIZER_NAMES = ("optimizer", "optim", "optimizers")
_SCHEDULER_NAMES = ("lr_scheduler", "lr_schedulers", "scheduler", "schedulers", "sched", "lr_sched")
_RNG_NAMES = ("rng", "rng_state", "rng_states", "random_state")
_LOADER_NAMES = ("dataloader", "data_loader", "loader", "train_loader", "dataloader_state")
_TRAIN_STATE = "train_state"
# Inside an RNG entry: what each generator is called.
_RNG_KINDS = {"torch": ("torch", "cpu", "torch_rng_state", "cpu_rng_state"),
              "cuda": ("cuda", "cuda_rng_state"),
              "python": ("python", "random", "python_rng_state"),
              "numpy": ("numpy", "np", "numpy_rng_state")}
# How many of the model's keys are tried to find where the checkpoint keeps them.
_KEYS_TRIED = 64


class Plan:
    """What load(from_dcp=) takes from the checkpoint at `path` and what it leaves: made from
    the checkpoint's metadata alone, so that strict=True raises before anything is loaded."""

    def __init__(self, path, model, optimizer, lr_scheduler, extra_state, keys_map, exclude):
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        self.path, self.model, self.optimizer = path, model, optimizer
        self.lr_scheduler, self.extra_state = lr_scheduler, dict(extra_state or {})
        self.metadata = FileSystemReader(path).read_metadata()
        self.keys = set(self.metadata.state_dict_metadata)
        self.model_state = get_model_state_dict(model)
        parts = ["model", "optimizer", "lr_scheduler", "rng"] + list(self.extra_state)
        keys_map = dict(keys_map or {})
        ignored, skipped = [], set()
        for name, where in keys_map.items():
            if name in parts:
                if where is None:
                    skipped.add(name)
                elif not isinstance(where, str) or not (where == "" or self._has(where)):
                    raise CheckpointError(f"from_dcp_keys[{name!r}] = {where!r}: the DCP checkpoint has no such key; "
                                          f"{self._what_it_holds()}")
            elif where is None and isinstance(name, str) and self._has(name):
                ignored.append(name)
            else:
                raise CheckpointError(
                    f"from_dcp_keys: {name!r} is neither a part of this manager ({', '.join(map(repr, parts))}) "
                    f"mapped to the checkpoint key that holds it, nor a key of the checkpoint mapped to None "
                    f"(left unread); {self._what_it_holds()}")
        for name in exclude:
            if not isinstance(name, str) or "*" in name or name == "model":
                raise ValueError(f"load(from_dcp=) leaves out whole parts (optimizer, lr_scheduler, rng, an "
                                 f"extra_state name, or a key of the checkpoint), not {name!r}")
            if name == "train_state" and name not in self.extra_state:
                name = "rng"  # the manager's own name for its RNG states (exclude=)
            if name in parts:
                skipped.add(name)
            elif self._has(name):
                ignored.append(name)

        if "model" in keys_map and keys_map["model"] is not None:
            self.prefix = keys_map["model"] + "." if keys_map["model"] else ""
        else:
            self.prefix = _model_prefix(self.keys, self.model_state)
        prefix = self.prefix
        self.base = prefix[:prefix.rstrip(".").rfind(".") + 1] if prefix else ""  # "app.model." -> "app."
        base = self.base

        # part -> the checkpoint key (dotted) that holds it; None: none found
        self.found = {}
        self.found["optimizer"] = self._pick("optimizer", keys_map, [base + n for n in _OPTIMIZER_NAMES])
        if self.found["optimizer"] is None and not base and self._has("state") and self._has("param_groups"):
            self.found["optimizer"] = ""  # get_state_dict's optimizer dict saved at the top
        self.found["lr_scheduler"] = self._pick("lr_scheduler", keys_map, [base + n for n in _SCHEDULER_NAMES])
        self.found["rng"] = self._pick("rng", keys_map, [base + n for n in _RNG_NAMES] + list(_RNG_NAMES))
        for name in self.extra_state:
            aliases = [name] + ([n for n in _LOADER_NAMES if n != name] if name in _LOADER_NAMES else [])
            self.found[name] = self._pick(name, keys_map, [base + n for n in aliases])
        taken = {v for v in self.found.values() if v}
        self.train_state = base + _TRAIN_STATE if (base + _TRAIN_STATE) not in taken and \
            (base + _TRAIN_STATE + ".step") in self.keys else None

        # What is loaded: the parts this manager has, not left out, found in the checkpoint.
        has_part = {"model": True, "optimizer": optimizer is not None, "lr_scheduler": lr_scheduler is not None,
                    "rng": True, **{n: True for n in self.extra_state}}
        self.load = {p: k for p, k in self.found.items() if k is not None and has_part[p] and p not in skipped}
        # Left as they are: parts this manager has that the checkpoint has nothing for (RNG
        # states are not named: most checkpoints have none, and every manager has them).
        self.fresh = [_describe(p) for p, k in self.found.items()
                      if k is None and has_part[p] and p not in skipped and p != "rng"]

        consumed = set()
        for key in self.keys:
            if (key[len(prefix):] in self.model_state if key.startswith(prefix) else False) \
                    or any(_under(key, k) for k in self.found.values() if k) \
                    or (self.found["optimizer"] == "" and (_under(key, "state") or _under(key, "param_groups"))) \
                    or any(_under(key, k) for k in ignored) \
                    or (self.train_state and key == self.train_state + ".step"):
                consumed.add(key)
        unread = {}
        for key in sorted(self.keys - consumed):
            if prefix and key.startswith(prefix):
                label = f"{key} (not in the model)"
            else:
                label = base + key[len(base):].split(".")[0] if key.startswith(base) else key.split(".")[0]
            unread[label] = unread.get(label, 0) + 1
        self.unread = [label if n == 1 or "(" in label else f"{label} ({n} keys)" for label, n in unread.items()]
        self.unread_labels = [label.split(" ")[0] for label in unread]

    def _has(self, key):
        return any(_under(k, key) for k in self.keys)

    def _pick(self, part, keys_map, candidates):
        if part in keys_map:
            return keys_map[part]
        return next((c for c in candidates if self._has(c)), None)

    def _what_it_holds(self):
        tops = sorted({".".join(k.split(".")[:2]) for k in self.keys})
        return f"it holds keys under {', '.join(map(repr, tops[:10]))}{' ...' if len(tops) > 10 else ''}"

    def problems(self):
        """What is not imported, in words, or "" when everything is."""
        said = []
        if self.unread:
            said.append(f"the checkpoint's {', '.join(self.unread[:10])}{' ...' if len(self.unread) > 10 else ''} "
                        "not imported")
        if self.fresh:
            said.append(f"nothing found for {', '.join(self.fresh)}, left as {'it is' if len(self.fresh) == 1 else 'they are'}")
        if not said:
            return ""
        fresh_part = next((p for p, k in self.found.items() if k is None and _describe(p) in self.fresh), None)
        unread = _likeliest(fresh_part, self.unread_labels) if self.unread_labels else None
        if fresh_part and unread:
            hint = (f"from_dcp_keys={{{fresh_part!r}: {unread!r}}} maps a part of this manager onto the "
                    f"checkpoint key that holds it, {{{unread!r}: None}} leaves a key unread")
        elif unread:
            hint = (f"from_dcp_keys={{{unread!r}: None}} leaves a key unread, {{'<part>': {unread!r}}} loads "
                    "it into a part of this manager (an extra_state name, lr_scheduler, ...)")
        else:
            hint = (f"exclude=[{fresh_part!r}] says so, from_dcp_keys={{{fresh_part!r}: '<key>'}} names "
                    "where the checkpoint holds it")
        return "; ".join(said) + f". What to do: {hint}"

    def needs_step(self):
        return self.train_state is None

    def load_all(self, rank):
        """Loads everything the plan takes, in place; returns the step that the checkpoint's
        train_state names (None without one)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                             set_model_state_dict, set_optimizer_state_dict)
        prefix, keys = self.prefix, self.keys
        state, options = {}, None
        if prefix:
            _put(state, prefix.rstrip("."), self.model_state)
        else:
            state.update(self.model_state)
        optimizer_key = self.load.get("optimizer")
        if optimizer_key is not None:
            # Flattened (torchtitan): param_groups keyed by parameter name, without the
            # per-group "params" lists that the nested form has.
            groups = (optimizer_key + "." if optimizer_key else "") + "param_groups."
            flat = not any(k.startswith(groups) and k.endswith(".params") for k in keys)
            options = StateDictOptions(flatten_optimizer_state_dict=flat)
            optim_state = get_optimizer_state_dict(self.model, self.optimizer, options=options)
            if optimizer_key:
                _put(state, optimizer_key, optim_state)
            else:
                state.update(optim_state)
        dcp.load(state, checkpoint_id=self.path)
        set_model_state_dict(self.model, _get(state, prefix.rstrip(".")) if prefix
                             else {k: state[k] for k in self.model_state})
        if optimizer_key is not None:
            loaded = _get(state, optimizer_key) if optimizer_key else {k: state[k] for k in optim_state}
            set_optimizer_state_dict(self.model, self.optimizer, loaded, options=options)

        objects = {p: k for p, k in self.load.items() if p not in ("model", "optimizer")}
        wanted = list(objects.values()) + ([self.train_state] if self.train_state else [])
        values = _read_objects(self.path, self.metadata, wanted) if wanted else {}
        if "lr_scheduler" in objects:
            value = values[objects["lr_scheduler"]]
            current = self.lr_scheduler.state_dict()
            if isinstance(value, dict) and isinstance(current, dict):
                value = {**current, **value}  # torchtitan keeps last_epoch only
            self.lr_scheduler.load_state_dict(value)
        if "rng" in objects:
            _set_rng(values[objects["rng"]], rank)
        for name, obj in self.extra_state.items():
            if name in objects:
                _load_object(name, obj, values[objects[name]])
        if self.train_state:
            step = values[self.train_state].get("step") if isinstance(values[self.train_state], dict) else None
            return int(step.item() if torch.is_tensor(step) else step) if step is not None else None
        return None


# Words that a checkpoint key holding a part tends to contain, for the warning's example.
_HINTS = {"optimizer": ("optim", "opt"), "lr_scheduler": ("sched", "lr", "warmup", "decay"),
          "rng": ("rng", "random", "seed")}


def _likeliest(part, labels):
    """The unread checkpoint key that most likely holds `part` (the warning's example)."""
    words = _HINTS.get(part, (part or "",)) if part else ()
    loaders = _LOADER_NAMES if part in _LOADER_NAMES else ()
    for label in labels:
        last = label.split(".")[-1].lower()
        if any(w and w in last for w in words) or last in loaders:
            return label
    return labels[0]


def _describe(part):
    return {"optimizer": "the optimizer", "lr_scheduler": "the LR scheduler", "rng": "the RNG states"}.get(
        part, f"extra_state[{part!r}]")


def _under(key, prefix):
    return prefix == "" or key == prefix or key.startswith(prefix + ".")


def _read_objects(path, metadata, prefixes):
    """{prefix: its value, nested as it was saved} for each checkpoint key in `prefixes`,
    tensors and objects alike, read with DCP's own reader."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    flat = {}
    for key, md in metadata.state_dict_metadata.items():
        if any(_under(key, p) for p in prefixes):
            flat[key] = (torch.empty(md.size, dtype=md.properties.dtype)
                         if isinstance(md, TensorStorageMetadata) else None)
    dcp.load(flat, checkpoint_id=path)
    nested = {}
    for key, value in flat.items():
        where = (metadata.planner_data or {}).get(key) or tuple(key.split("."))
        _set_path(nested, list(where), value)
    out = {}
    for p in prefixes:
        node = nested
        for part in _path_of(p, metadata):
            node = node[part]
        out[p] = node
    return out


def _path_of(prefix, metadata):
    """The saved path (keys and list indices) of a dotted checkpoint key that is a prefix."""
    for key, where in (metadata.planner_data or {}).items():
        if _under(key, prefix):
            dotted = 0
            for i, part in enumerate(where):
                dotted += len(str(part)) + (1 if i else 0)
                if dotted == len(prefix):
                    return list(where[:i + 1])
    return prefix.split(".")


def _set_path(node, path, value):
    for i, part in enumerate(path):
        last = i == len(path) - 1
        if isinstance(node, list):
            while len(node) <= part:
                node.append(None)
            if last:
                node[part] = value
            else:
                if node[part] is None:
                    node[part] = [] if isinstance(path[i + 1], int) else {}
                node = node[part]
        else:
            if last:
                node[part] = value
            else:
                node = node.setdefault(part, [] if isinstance(path[i + 1], int) else {})


def _set_rng(value, rank):
    """RNG states as people save them: {"torch": ByteTensor, "cuda": [ByteTensor, ...],
    "python": random.getstate(), "numpy": np.random.get_state()}, or a list of those per
    rank (this rank's, else rank 0's)."""
    if isinstance(value, (list, tuple)) and value and isinstance(value[0], dict):
        value = value[rank] if rank < len(value) else value[0]
    if not isinstance(value, dict):
        raise CheckpointError(f"the checkpoint's RNG states are a {type(value).__name__}, not a dict of generators")
    found = {kind: next((value[n] for n in names if n in value), None) for kind, names in _RNG_KINDS.items()}
    if found["torch"] is not None:
        torch.set_rng_state(torch.as_tensor(found["torch"], dtype=torch.uint8).cpu())
    if found["cuda"] is not None and torch.cuda.is_available():
        states = found["cuda"] if isinstance(found["cuda"], (list, tuple)) else [found["cuda"]]
        torch.cuda.set_rng_state_all([torch.as_tensor(s, dtype=torch.uint8).cpu() for s in states])
    if found["python"] is not None:
        version, internal, gauss = found["python"]
        random.setstate((version, tuple(internal), gauss))
    if found["numpy"] is not None:
        try:
            import numpy
        except ImportError:
            return
        numpy.random.set_state(tuple(found["numpy"]) if isinstance(found["numpy"], list) else found["numpy"])


def _load_object(name, obj, value):
    if torch.is_tensor(obj):
        with torch.no_grad():
            obj.copy_(value)
    elif isinstance(obj, dict):
        obj.clear()
        obj.update(value)
    elif isinstance(obj, list):
        obj[:] = value
    else:
        obj.load_state_dict(value)


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
            f"({', '.join(repr(p) for p in winners)}): it holds several copies of the model; name the one "
            f"you mean with from_dcp_keys={{'model': {winners[0].rstrip('.')!r}}}")
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

"""Which tensors of a model and its optimizer a checkpoint holds, under which keys, and how
each one's storage moves into ckptd's shared memory.

Keys are the model's own state-dict keys, without the parts that wrappers (DDP,
torch.compile, FSDP1, activation checkpointing) insert; optimizer state goes under
`optim.<param key>.<state key>`. The manager (ckptd.torch) registers tensors under these
keys; dcp.py offers the same tensors to DCP and reads the dtype names back with `_DTYPES`.
"""
import torch

from ckptd._errors import CheckpointError
from ckptd._parts import PART_PREFIX

# torch dtype -> safetensors dtype, the names ckptd stores.
_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}
# And back: the torch dtype of a stored name (readers of ckptd's and safetensors files).
_TORCH_DTYPES = {name: dtype for dtype, name in _DTYPES.items()}


class _Entry:
    """One registered tensor: its checkpoint key, the tensor, and how to swap its storage."""

    __slots__ = ("name", "tensor", "replace")

    def __init__(self, name, tensor, replace):
        self.name, self.tensor, self.replace = name, tensor, replace


# Attribute names that wrappers insert between a model and its submodules: torch.compile's
# OptimizedModule, FSDP1 and activation checkpointing. Checkpoint keys leave them out (as
# DCP's state-dict helpers do), so a checkpoint saved from a compiled or wrapped model loads
# into the plain one and back.
_WRAPPER_PARTS = frozenset({"_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"})


def _checkpoint_key(model, name):
    parts = [part for part in name.split(".")
             if part not in _WRAPPER_PARTS and not part.startswith(PART_PREFIX)]
    if parts and parts[0] == "module" and _is_ddp(model):
        parts = parts[1:]
    return ".".join(parts)


def _is_ddp(model):
    ddp = getattr(torch.nn.parallel, "DistributedDataParallel", None)
    inner = getattr(model, "_orig_mod", model)
    return ddp is not None and isinstance(inner, ddp)


def _named_parameters(model):
    for name, p in model.named_parameters():
        yield _checkpoint_key(model, name), p


def _param_names(model):
    return {id(p): n for n, p in _named_parameters(model)}


def _persistent_buffers(model):
    """(checkpoint key, module, attribute) of every buffer that belongs in a checkpoint."""
    for module_name, module in model.named_modules():
        for leaf, b in module._buffers.items():
            if b is not None and leaf not in module._non_persistent_buffers_set:
                name = f"{module_name}.{leaf}" if module_name else leaf
                yield _checkpoint_key(model, name), module, leaf


def _set_data(param, tensor):
    param.data = tensor


def _set_buffer(module, leaf, tensor):
    module._buffers[leaf] = tensor


def _set_item(mapping, key, tensor):
    mapping[key] = tensor


def _dtype_name(name, dtype):
    """ckptd's name of a torch dtype (safetensors'), or CheckpointError naming the tensor."""
    if dtype not in _DTYPES:
        raise CheckpointError(f"tensor {name}: dtype {dtype} cannot be checkpointed")
    return _DTYPES[dtype]


def _move_to_arena(client, name, dtype, part):
    """Copies `part` (a _placement.Local) into ckptd's shared memory and points its owner
    there: same dtype and shape, and the spare elements after it that FSDP2 pads with. A
    piece of an FSDP1 flat shard moves its whole shard, once."""
    if part.shard is not None:
        part.shard.move(client, dtype)
        return
    t = part.tensor
    if part.flat:
        buffer = client.allocate_flat(name, dtype, part.global_shape, part.flat)
    else:
        buffer = client.allocate(name, dtype, list(t.shape), part.global_shape, part.global_offset,
                                 spare_bytes=part.spare * t.element_size())
    # Writable (the buffer protocol says so), so frombuffer has nothing to warn about, and no
    # warnings.catch_warnings here: with one trainer thread per rank it races (see load()).
    flat = torch.frombuffer(buffer, dtype=torch.uint8).view(t.dtype)
    with torch.no_grad():
        flat[:t.numel()].view(t.shape).copy_(t)
    part.relocate(flat)


# At most this many aliases are recorded: the step's metadata travels in one command.
_MAX_ALIASES = 1024


def _aliases(model):
    """{other key: registered key} for tensors a model holds under several names (tied
    parameters: GPT-2's lm_head.weight is transformer.wte.weight). A checkpoint stores each
    tensor once, under the first name (the one named_parameters gives), but a state dict
    has every name, and DCP asks for each."""
    first = {}
    for name, p in _named_parameters(model):
        first.setdefault(id(p), name)
    for name, module, leaf in _persistent_buffers(model):
        first.setdefault(id(module._buffers[leaf]), name)
    aliases = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        tensors = list(module._parameters.items())
        tensors += [(leaf, b) for leaf, b in module._buffers.items()
                    if leaf not in module._non_persistent_buffers_set]
        for leaf, t in tensors:
            if t is None or id(t) not in first:
                continue
            name = _checkpoint_key(model, f"{module_name}.{leaf}" if module_name else leaf)
            if name != first[id(t)] and len(aliases) < _MAX_ALIASES:
                aliases[name] = first[id(t)]
    return aliases

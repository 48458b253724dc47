"""What of a tensor this rank registers, and where it sits in the global tensor.

A plain tensor is registered whole. A DTensor (`distribute_tensor`, tensor parallelism,
FSDP2's `fully_shard`) registers its local shard with the global shape and the shard's
offset in it, so that the manifest describes the global tensor; a replicated DTensor is
registered whole on every rank (replicas). FSDP2 keeps each shard in a flat buffer padded to
the same size on every rank and all-gathers from that buffer, so for its parameters the
whole padded buffer moves into shared memory (the padding as spare bytes that ckptd does
not checkpoint), and FSDP2's own reference is pointed at it.
"""
import torch

try:  # PyTorch >= 2.4
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
except ImportError:  # PyTorch 1.13: no DTensor
    DTensor = None


class Local:
    """The part of a tensor this rank registers.

    `tensor`: the plain local tensor; `global_shape`/`global_offset`: its place in the
    global tensor (empty: whole); `spare`: elements after it that are allocated with it
    but not checkpointed; `relocate(buffer)`: points the owner at `buffer` (a flat tensor of
    `tensor.numel() + spare` elements whose head holds the data) instead of the old storage.
    A flat shard (FSDP1, _fsdp1.py) has `flat`, the ranges [begin, end) of the flattened
    global tensor that the 1-D `tensor` holds, instead of an offset; `shard`, when set, is the
    _fsdp1._Shard that `tensor` is a piece of, which moves into shared memory as a whole.
    """

    __slots__ = ("tensor", "global_shape", "global_offset", "spare", "relocate", "flat", "shard")

    def __init__(self, tensor, global_shape=(), global_offset=(), spare=0, relocate=None,
                 flat=(), shard=None):
        self.tensor, self.spare, self.relocate = tensor, spare, relocate
        self.global_shape, self.global_offset = list(global_shape), list(global_offset)
        self.flat, self.shard = list(flat), shard


def is_dtensor(t):
    return DTensor is not None and isinstance(t, DTensor)


def storage_address(t):
    """Where a tensor's bytes are (its local shard's, for a DTensor): cheap, for fingerprints."""
    return t._local_tensor.data_ptr() if is_dtensor(t) else t.data_ptr()


def fsdp2_params(model):
    """{id(sharded parameter): FSDPParam} for every parameter `fully_shard` manages in
    `model` (empty without FSDP2)."""
    found = {}
    for module in model.modules():
        get_state = getattr(module, "_get_fsdp_state", None)
        if get_state is None:
            continue
        state = get_state()
        groups = getattr(state, "_fsdp_param_groups", None)  # newer: one group per mesh
        if groups is None:
            groups = [getattr(state, "_fsdp_param_group", None)]
        for group in groups:
            for fsdp_param in getattr(group, "fsdp_params", None) or ():
                found[id(fsdp_param.sharded_param)] = fsdp_param
    return found


def local_part(name, t, replace, fsdp_params, error):
    """The Local for tensor `t` (checkpoint key `name`); `replace(tensor)` swaps a plain
    tensor's storage; `error(message)` makes the exception to raise."""
    if not is_dtensor(t):
        return Local(t, relocate=lambda flat: replace(flat[:t.numel()].view(t.shape)))
    local, global_shape, global_offset = box(name, t, error, "saving")
    fsdp_param = fsdp_params.get(id(t))
    if fsdp_param is None:
        if local.untyped_storage().nbytes() > local.numel() * local.element_size():
            # A view into a bigger buffer that something else reads (FSDP2 applied to a
            # module outside `model`?): moving only the view would part them.
            raise error(f"tensor {name}: its local shard is a view into a larger buffer that "
                        "ckptd cannot move with it (is fully_shard applied to a module outside "
                        "the model given to CheckpointManager?)")

        def relocate(flat):
            local.data = flat[:local.numel()].view(local.shape)
        return Local(local, global_shape, global_offset, 0, relocate)
    return _fsdp2_local(name, t, local, fsdp_param, global_shape, global_offset, error)


def box(name, t, error, doing="loading"):
    """(local tensor, global shape, offset) of DTensor `t`'s local shard: a box of the global
    tensor (global shape and offset empty when the shard is the whole tensor). What this
    rank saves of `t`, and what it reads into it in place (`doing` names which, in errors)."""
    for placement in t.placements:
        if placement.is_partial():
            raise error(f"tensor {name}: a DTensor with a Partial placement holds partial sums, "
                        f"not values: reduce it (redistribute to Shard or Replicate) before {doing}")
        if type(placement).__name__ == "_StridedShard":
            # FSDP + TP on one dimension: the local rows are strided, not one block; an offset
            # and a shape cannot describe them.
            raise error(f"tensor {name}: strided sharding ({placement}, FSDP and tensor "
                        "parallelism on the same dimension) is not supported yet")
    local = t._local_tensor
    local_shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    if tuple(local.shape) != tuple(local_shape):
        raise error(f"tensor {name}: local shard {tuple(local.shape)} is not the "
                    f"{tuple(local_shape)} its placements {t.placements} give")
    if tuple(local_shape) == tuple(t.shape):
        return local, [], []
    return local, list(t.shape), list(offset)


def _fsdp2_local(name, t, local, fsdp_param, global_shape, global_offset, error):
    padded = torch.Size(fsdp_param.padded_sharded_param_size)
    dim = fsdp_param.fsdp_placement.dim
    if dim != 0 and padded != local.shape:
        raise error(f"tensor {name}: FSDP2 shards padded along dim {dim} are not supported")
    length = local.size(0) if local.numel() > 0 else 0

    def relocate(flat):
        shard = flat.view(padded).narrow(0, 0, length)
        # FSDP2 all-gathers from _sharded_param_data and the optimizer updates the
        # parameter's local tensor: both must be the shared memory, or they part ways.
        fsdp_param._sharded_param_data = flat
        t._local_tensor = shard

    return Local(local, global_shape, global_offset, padded.numel() - local.numel(), relocate)

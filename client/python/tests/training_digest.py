"""A digest of a model's and optimizer's state, for workers whose resumed run must match an
uninterrupted one bit for bit (accelerate_worker.py, hf_worker.py): every tensor of the model's
state dict and of the optimizer's state, in a fixed order, and the learning rate."""
import hashlib

import torch


def digest(model, optimizer):
    h = hashlib.sha256()
    tensors = [v for _, v in sorted(model.state_dict().items())]
    for group in optimizer.param_groups:
        for p in group["params"]:
            tensors += [v for _, v in sorted(optimizer.state.get(p, {}).items()) if torch.is_tensor(v)]
    for t in tensors:
        h.update(t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    h.update(repr(optimizer.param_groups[0]["lr"]).encode())
    return h.hexdigest()

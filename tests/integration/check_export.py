"""Opens an export of `ckptctl export` with the stock safetensors library and checks each
named tensor, bit for bit, against the resharding tests' global pattern
(tests/integration/global_pattern.h).

usage: check_export.py PATH NAME=ID [NAME=ID ...]
  PATH: an hf folder (read through its model.safetensors.index.json) or one .safetensors file
"""
import json
import os
import sys

import numpy as np
from safetensors.numpy import load_file


def global_values(tensor_id, count):
    with np.errstate(over="ignore"):
        g = np.arange(1, count + 1, dtype=np.uint64)
        x = (g * np.uint64(0x9E3779B97F4A7C15)) ^ np.uint64(tensor_id << 58)
        x ^= x >> np.uint64(31)
        return ((x * np.uint64(0xBF58476D1CE4E5B9)) >> np.uint64(32)).astype(np.uint32)


def main():
    path, wanted = sys.argv[1], dict(arg.split("=") for arg in sys.argv[2:])
    if os.path.isdir(path):
        index = json.load(open(os.path.join(path, "model.safetensors.index.json")))
        tensors = {}
        for file in sorted(set(index["weight_map"].values())):
            loaded = load_file(os.path.join(path, file))
            assert all(index["weight_map"][k] == file for k in loaded), file
            tensors.update(loaded)
        assert set(tensors) == set(index["weight_map"]), (sorted(tensors), sorted(index["weight_map"]))
        total = sum(t.nbytes for t in tensors.values())
        assert index["metadata"]["total_size"] == total, (index["metadata"], total)
    else:
        tensors = load_file(path)
    assert set(tensors) == set(wanted), (sorted(tensors), sorted(wanted))
    for name, tensor_id in wanted.items():
        got = tensors[name].reshape(-1).view(np.uint32)
        if not np.array_equal(got, global_values(int(tensor_id), got.size)):
            print(f"{name}: differs from the global tensor", file=sys.stderr)
            return 1
    print(f"export ok: {len(tensors)} tensors")
    return 0


if __name__ == "__main__":
    sys.exit(main())

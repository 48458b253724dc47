"""Opens each shard of a ckptd step directory with the stock safetensors library and
compares every registered tensor with the raw bytes the trainer dumped.

usage: check_safetensors.py STEP_DIR DUMP_DIR_RANK0 [DUMP_DIR_RANK1 ...]
"""
import json
import os
import sys

import torch
from safetensors import safe_open
from safetensors.torch import load_file


def main() -> int:
    step_dir, dumps = sys.argv[1], sys.argv[2:]
    manifest = json.load(open(os.path.join(step_dir, "manifest.json")))
    assert manifest["world_size"] == len(dumps), manifest["world_size"]
    # rank-00000.safetensors written whole, rank-00000.<run>.safetensors with increments
    files = {shard["rank"]: shard["file"] for shard in manifest["shards"]}
    for rank, dump in enumerate(dumps):
        path = os.path.join(step_dir, files[rank])
        tensors = load_file(path)  # the stock loader validates the whole file
        with safe_open(path, framework="pt") as f:
            assert f.metadata().get("seed"), f.metadata()
        matched = 0
        for name in sorted(os.listdir(dump)):
            key = name[: -len(".bin")]
            expected = open(os.path.join(dump, name), "rb").read()
            got = tensors[key].reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
            if got != expected:
                print(f"rank {rank}: tensor {key} differs", file=sys.stderr)
                return 1
            entry = manifest["tensors"][key]
            shard = [s for s in entry["shards"] if s["rank"] == rank][0]
            assert list(tensors[key].shape) == shard["shape"], (key, tensors[key].shape, shard)
            matched += 1
        print(f"rank {rank}: {matched} tensors match")
    return 0


if __name__ == "__main__":
    sys.exit(main())

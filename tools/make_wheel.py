"""Packs the ckptd Python package (the files Bazel built) into a wheel for pip.

usage: make_wheel.py --python 3.X OUT.whl FILE... (each FILE ends in ckptd/<name>)

The wheel is tagged cp3X-cp3X-linux_x86_64: its _native.so links Debian 12's libraries.
tools/wheels.sh vendors them into it with auditwheel, which retags it manylinux.
"""
import argparse
import base64
import hashlib
import os
import zipfile

VERSION = "0.1.0"


def record_line(name, data):
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def main(out, files, python):
    abi = "cp" + python.replace(".", "")
    tag = f"{abi}-{abi}-linux_x86_64"
    dist_info = f"ckptd-{VERSION}.dist-info"
    entries = []
    for path in files:
        parts = path.split("/")
        name = "/".join(parts[parts.index("ckptd", len(parts) - 2):])
        with open(path, "rb") as f:
            entries.append((name, f.read()))
    entries.append((f"{dist_info}/METADATA", (
        "Metadata-Version: 2.1\nName: ckptd\nVersion: " + VERSION + "\n"
        "Summary: Python client and PyTorch checkpoint manager for the ckptd daemon\n"
        "Requires-Python: >=3.10\n"
        # ckptd.torch, .dcp, .lightning, .transformers need PyTorch; the bindings do not.
        # A range, not a build: any PyTorch 2.1 or newer, CPU or CUDA, that the user has.
        "Provides-Extra: torch\n"
        "Requires-Dist: torch>=2.1; extra == \"torch\"\n"
        "Description-Content-Type: text/plain\n\n"
        "The Python client of ckptd, the per-node checkpoint daemon for GPU training, and\n"
        "its PyTorch checkpoint manager (ckptd.torch.CheckpointManager). Its manylinux wheels\n"
        "carry the libraries it links; the ckptd daemon runs on the node.\n").encode()))
    entries.append((f"{dist_info}/WHEEL", (
        "Wheel-Version: 1.0\nGenerator: ckptd make_wheel.py\nRoot-Is-Purelib: false\n"
        f"Tag: {tag}\n").encode()))
    record = [record_line(n, d) for n, d in entries] + [f"{dist_info}/RECORD,,"]
    entries.append((f"{dist_info}/RECORD", ("\n".join(record) + "\n").encode()))
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as whl:
        for name, data in entries:
            info = zipfile.ZipInfo(name, date_time=(2020, 1, 1, 0, 0, 0))
            info.external_attr = (0o755 if name.endswith(".so") else 0o644) << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            whl.writestr(info, data)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", required=True, help="the CPython version, e.g. 3.11")
    parser.add_argument("out")
    parser.add_argument("files", nargs="+")
    args = parser.parse_args()
    main(args.out, args.files, args.python)

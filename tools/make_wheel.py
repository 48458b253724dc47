"""Packs the ckptd Python package (the files Bazel built) into a wheel for pip.

usage: make_wheel.py OUT.whl FILE... (each FILE ends in ckptd/<name>)
"""
import base64
import hashlib
import os
import sys
import zipfile

VERSION = "0.1.0"
TAG = "cp311-cp311-linux_x86_64"


def record_line(name, data):
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def main(out, files):
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
        "Requires-Python: ==3.11.*\n"
        # ckptd.torch, .dcp, .lightning, .transformers need PyTorch; the bindings do not.
        "Provides-Extra: torch\n"
        "Requires-Dist: torch>=1.13; extra == \"torch\"\n"
        # _native.so links Debian 12's gRPC, protobuf and Abseil: a wheel for Debian 12
        # (and its python3.11), where the python3-ckptd package says so in its Depends.
        "Description-Content-Type: text/plain\n\n"
        "Built on Debian 12 against its gRPC 1.51, protobuf 3.21 and Abseil 20220623\n"
        "(libgrpc++1.51, libprotobuf32, libabsl20220623): install those, or use the\n"
        "python3-ckptd package, which depends on them.\n").encode()))
    entries.append((f"{dist_info}/WHEEL", (
        "Wheel-Version: 1.0\nGenerator: ckptd make_wheel.py\nRoot-Is-Purelib: false\n"
        f"Tag: {TAG}\n").encode()))
    record = [record_line(n, d) for n, d in entries] + [f"{dist_info}/RECORD,,"]
    entries.append((f"{dist_info}/RECORD", ("\n".join(record) + "\n").encode()))
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as whl:
        for name, data in entries:
            info = zipfile.ZipInfo(name, date_time=(2020, 1, 1, 0, 0, 0))
            info.external_attr = (0o755 if name.endswith(".so") else 0o644) << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            whl.writestr(info, data)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])

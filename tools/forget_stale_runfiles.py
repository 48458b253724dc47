"""Removes the runfiles manifests of an output base that name a source file that is gone.

A runfiles manifest lists each source file of a test's runfiles by its absolute path in the
checkout that built it, and Bazel does not write it again when the same output base (this
project shares its output bases between clones, so that a clean clone finds its tests'
results cached) is used from a checkout at another path. Once that checkout is deleted, a
test that runs again finds its data files missing ("can't open file .../check_export.py").
Removing such a manifest and its runfiles tree makes Bazel write both anew from this
checkout. Manifests naming existing files are left alone: a cached test stays cached.

Usage: forget_stale_runfiles.py OUTPUT_BASE
"""

import glob
import os
import shutil
import sys


def stale(manifest):
    with open(manifest, errors="replace") as f:
        for line in f:
            parts = line.rstrip("\n").split(" ", 1)
            if len(parts) == 2 and parts[1] and not os.path.lexists(parts[1]):
                return parts[1]
    return None


def main(output_base):
    for manifest in glob.glob(os.path.join(output_base, "execroot", "*", "bazel-out", "**", "*.runfiles_manifest"),
                              recursive=True):
        gone = stale(manifest)
        if gone is None:
            continue
        os.remove(manifest)
        shutil.rmtree(manifest[: -len("_manifest")], ignore_errors=True)
        print(f"{os.path.basename(manifest)}: named {gone}, which is gone; Bazel writes it again")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: forget_stale_runfiles.py OUTPUT_BASE")
    main(sys.argv[1])

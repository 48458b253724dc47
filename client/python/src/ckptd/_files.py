"""Files stored with a checkpoint step: `save(step, files={"config.yaml": ...})`.

Each goes in as a train-state entry of the rank that gives it, named "file/<name>"
(format/user_files.h), so it travels, is checksummed, verified, replicated, uploaded and
deleted with that rank's shard; `ckptctl list` names them, `ckptctl export` writes them
into the export folder, and a load gives the rank's files back. The limits are ckptd's
(format/user_files.h), said here before anything is sent.
"""
import os
import re

PREFIX = "file/"
MAX_BYTES = 16 << 20   # format::kMaxUserFilesBytes: per rank and step, in all
MAX_FILES = 256        # format::kMaxUserFiles
_NAME = re.compile(r"[A-Za-z0-9_+-][A-Za-z0-9._+-]{0,127}")  # format::ValidateUserFileName


def encode(files):
    """{"file/<name>": bytes} of `files`, {name: bytes, str (stored as UTF-8) or a path
    (os.PathLike: the file's bytes, read now)}; TypeError or ValueError naming what is wrong."""
    if not files:
        return {}
    if not isinstance(files, dict):
        raise TypeError(f"files is a dict of file names to bytes, str or paths, not a {type(files).__name__}")
    if len(files) > MAX_FILES:
        raise ValueError(f"files: {len(files)} files; a rank may store {MAX_FILES} with a step at most")
    out, total = {}, 0
    for name, value in files.items():
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ValueError(f"files: the name {name!r} is not allowed: 1 to 128 letters, digits, '.', '_', "
                             "'-' or '+', not starting with '.' (a file's own name, no folder)")
        if isinstance(value, str):
            data = value.encode("utf-8")
        elif isinstance(value, (bytes, bytearray, memoryview)):
            data = bytes(value)
        elif isinstance(value, os.PathLike):
            with open(value, "rb") as f:
                data = f.read(MAX_BYTES + 1)
        else:
            raise TypeError(f"files[{name!r}] is a {type(value).__name__}: give bytes, a str (stored as "
                            "UTF-8) or a path (pathlib.Path: the file's bytes)")
        total += len(data)
        if total > MAX_BYTES:
            raise ValueError(f"files: more than {MAX_BYTES >> 20} MiB in all (at {name!r}); a rank may store "
                             f"{MAX_BYTES >> 20} MiB of files with a step: small files such as a config or a "
                             "tokenizer (tensors belong in the model or extra_state)")
        out[PREFIX + name] = data
    return out


def decode(train_state):
    """{name: bytes} of the files among a restored train state."""
    return {k[len(PREFIX):]: v for k, v in train_state.items() if k.startswith(PREFIX)}

"""Reads a step's tensor pieces and train state from its files, following a version 5 step's
references (docs/design/incremental.md, section 3): a piece written whole is one entry of its
rank's file, as in every version; a piece with `extents` is assembled from runs of its
chunks, each in this step's file (a `__delta__` entry) or in an origin's (an earlier step's
file, found by _StepFiles.open_origin). Every chunk is checked against its checksum and the
piece against its own before a byte is handed on. What ckptd.dcp's reader and
load(from_path=) both read through.
"""
import json

from ckptd._increment import ITEMSIZE, chunk_count, delta_entry, piece_bytes
from ckptd._native import xxh3_64
from ckptd._step_files import read_train_state

_MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit (format/safetensors.cc)


def _digest(data):
    return f"xxh3:{xxh3_64(data):016x}"


class _Open:
    """A file open for reading: where its data region starts, its header once parsed, and
    what messages call it."""

    def __init__(self, f, label):
        self.f, self.label, self._entries = f, label, None
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{label}: truncated safetensors header")
        if int.from_bytes(head, "little") > _MAX_HEADER_BYTES:
            raise ValueError(f"{label}: not a safetensors file (a header of {int.from_bytes(head, 'little')} bytes)")
        self.header_bytes = int.from_bytes(head, "little")
        self.start = 8 + self.header_bytes

    def entries(self):
        if self._entries is None:
            self.f.seek(8)
            text = self.f.read(self.header_bytes)
            try:
                entries = json.loads(text) if len(text) == self.header_bytes else None
            except ValueError:
                entries = None
            if not isinstance(entries, dict):
                raise ValueError(f"{self.label}: its safetensors header is not JSON (a damaged file)")
            self._entries = entries
        return self._entries

    def read(self, at, n):
        self.f.seek(self.start + at)
        return self.f.read(n)


class PieceReader:
    """Reads pieces and train state of one step (`files`, a _StepFiles), opening each file
    once; close() closes them. `rank_files` (per piece or shard) is the rank's entry of
    _increment.check's answer: its own file name and its origins by step."""

    def __init__(self, files):
        self._files, self._open = files, {}

    def close(self):
        for opened in self._open.values():
            opened.f.close()
        self._open.clear()

    def _file(self, rank_files, step=None, rank=None, own=None):
        """This step's file `own` (a rank's), or the origin file of `step` for `rank`."""
        key = own if step is None else (step, rank)
        if key not in self._open:
            if step is None:
                f, label = self._files.open(own), self._files.name(own)
            else:
                origin = rank_files["origins"][step]
                f, where = self._files.open_origin(origin)
                label = f"{where} (step {step}'s file of rank {rank})"
            try:
                self._open[key] = _Open(f, label)
            except BaseException:
                f.close()
                raise
        return self._open[key]

    def check_origins(self, files):
        """Opens every origin file of `files` (_increment.check's answer): each found, of its
        size, a safetensors file; ValueError naming the first that is not."""
        for rank, mine in sorted(files.items()):
            for step in sorted(mine["origins"]):
                self._file(mine, step=step, rank=rank)

    def piece(self, name, dtype, piece, rank_files):
        """The piece's bytes, whole and checked: ValueError naming the file, the tensor and
        what is wrong (a byte range for a chunk) otherwise."""
        if "extents" not in piece:
            opened = self._file(rank_files, own=piece["file"])
            lo, hi = piece["data_offsets"]
            data = bytearray(opened.read(lo, hi - lo))
            if len(data) != hi - lo:
                raise ValueError(f"{opened.label}: tensor {name}: the file ends {hi - lo - len(data)} bytes "
                                 "early (truncated)")
            if not piece.get("checksum") or piece["checksum"] != _digest(data):
                raise ValueError(f"{opened.label}: tensor {name}: checksum mismatch (a damaged file); "
                                 "nothing of it was copied")
            return data
        nbytes, cb, rank = piece_bytes(piece, ITEMSIZE[dtype]), piece["chunk_bytes"], piece["rank"]
        chunks = chunk_count(nbytes, cb)
        sums = piece.get("chunk_checksums") or [piece["checksum"]]
        whole = bytearray(nbytes)
        for extent in piece["extents"]:
            c0, c1 = extent["chunks"]
            lo, hi, at = c0 * cb, min(c1 * cb, nbytes), extent["at"]
            if "step" in extent:
                opened = self._file(rank_files, step=extent["step"], rank=rank)
            else:
                opened = self._file(rank_files, own=rank_files["own"])
            _check_entry(opened, name, dtype, at, at + hi - lo)
            data = opened.read(at, hi - lo)
            if len(data) != hi - lo:
                raise ValueError(f"{opened.label}: tensor {name}: the file ends before bytes [{at}, {at + hi - lo}) "
                                 "of its data region (truncated)")
            for c in range(c0, c1):
                a, b = c * cb - lo, min((c + 1) * cb, nbytes) - lo
                if sums[c] != _digest(memoryview(data)[a:b]):
                    raise ValueError(f"{opened.label}: tensor {name}: chunk {c} of {chunks}, bytes "
                                     f"[{at + a}, {at + b}) of its data region, does not match its checksum "
                                     "(a damaged file); nothing of the piece was copied")
            whole[lo:hi] = data
        if piece["checksum"] != _digest(whole):
            raise ValueError(f"{self._files.name(rank_files['own'])}: tensor {name}: rank {rank}'s piece, "
                             "assembled from its extents, does not match its checksum; nothing of it was copied")
        return whole

    def train_state(self, shard, rank_files):
        """A shard's train-state blobs, each checked; those with a `step` from that origin's file."""
        by_file = {}
        for name, entry in (shard.get("train_state") or {}).items():
            by_file.setdefault(entry.get("step"), {})[name] = entry
        blobs = {}
        for step, entries in sorted(by_file.items(), key=lambda kv: -1 if kv[0] is None else kv[0]):
            if step is None:
                opened = self._file(rank_files, own=shard["file"])
            else:
                opened = self._file(rank_files, step=step, rank=shard["rank"])
            blobs.update(read_train_state(opened.f, opened.start, entries, opened.label))
        return blobs


def _check_entry(opened, name, dtype, lo, hi):
    """Bytes [lo, hi) of a file's data region lie in one entry of its header that holds the
    tensor's chunks: of its dtype, named the tensor or a `__delta__` of it."""
    delta = delta_entry(name)
    for key, entry in opened.entries().items():
        if key != name and not delta.fullmatch(key):
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if (entry.get("dtype") == dtype and isinstance(offsets, list) and len(offsets) == 2
                and offsets[0] <= lo and hi <= offsets[1]):
            return
    raise ValueError(f"{opened.label}: tensor {name}: bytes [{lo}, {hi}) of its data region are in no "
                     f"{dtype} entry of {name} (or of a __delta__ of it) in the file's header")


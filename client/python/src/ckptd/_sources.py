"""Loading a checkpoint from somewhere other than the job's own steps in the node's ckptd:
`load(from_path=...)`, a committed step directory read straight from its files (a copy on
another disk, a step of another cluster, `s3://...` in a bucket), and `load(from_job=...)`,
another job of the same user through ckptd (a model bank, a warm start).

A step directory is read in this process, with its user's own permissions, never by the
daemon: every piece is checked against its XXH3-64 checksum before it is copied, pieces of a
sharded tensor are joined into the global tensor, and this rank's part of it (its DTensor
shard, its FSDP flat ranges, or the whole) is copied into the registered tensor. The
manifest's job name does not matter (a step copied to another job's folder loads). An
incremental step (format version 5) is read through its references, in the earlier steps'
files beside it (_references.py).
"""
import fnmatch
import os

import torch

from ckptd import _increment
from ckptd._errors import CheckpointError
from ckptd._references import PieceReader
from ckptd._state_dict import _TORCH_DTYPES
from ckptd._step_files import _StepFiles, _check_file_name


class StepDirectory:
    """A committed step read from its files: `path` is `<root>/<job>/step-NNNNNNNN` or
    `s3://bucket/prefix/<job>/step-NNNNNNNN`."""

    def __init__(self, path):
        self.path = path
        self._files = _StepFiles(path)
        self._reader = PieceReader(self._files)
        try:
            manifest = self._files.read_manifest()
        except FileNotFoundError:
            raise CheckpointError(_not_a_step(path)) from None
        except (OSError, ValueError, RuntimeError) as e:  # RuntimeError: ckptd.Error (a store's answer)
            if "NOT_FOUND" == getattr(e, "code", None):
                raise CheckpointError(_not_a_step(path)) from None
            raise CheckpointError(f"load(from_path={path!r}): {self._files.name('manifest.json')} "
                                  f"cannot be read: {e}") from e
        if not isinstance(manifest, dict) or manifest.get("format") != "ckptd-manifest" \
                or not isinstance(manifest.get("tensors"), dict):
            raise CheckpointError(f"load(from_path={path!r}): {self._files.name('manifest.json')} is not a "
                                  "ckptd manifest (a DCP checkpoint loads with from_dcp=, a Hugging Face "
                                  "folder with from_hf=)")
        try:
            self._rank_files = _increment.check(manifest)
        except (KeyError, TypeError, IndexError, ValueError) as e:
            raise CheckpointError(f"load(from_path={path!r}): {self._files.name('manifest.json')}: "
                                  f"{e if isinstance(e, ValueError) else f'not well formed ({e!r})'}") from e
        try:
            self._reader.check_origins(self._rank_files)  # before a byte is copied
        except (OSError, ValueError, RuntimeError) as e:
            self._reader.close()
            raise CheckpointError(f"load(from_path={path!r}): {e}") from e
        self.manifest = manifest
        self.step = int(manifest.get("step", 0))
        self.job = manifest.get("job", "?")
        self.world_size = int(manifest.get("world_size", 1))
        self.tensors = manifest["tensors"]

    def close(self):
        self._reader.close()

    def train_state(self, rank):
        """Rank `rank`'s train-state blobs, each checked; {} when the step has none."""
        shard = next((s for s in self.manifest.get("shards", []) if s.get("rank") == rank), None)
        entries = (shard or {}).get("train_state") or {}
        if not entries:
            return {}
        try:
            return self._reader.train_state(shard, self._rank_files[rank])
        except ValueError as e:
            raise CheckpointError(str(e)) from None

    def global_tensor(self, name):
        """The whole tensor `name`, joined from its pieces (replicas read once), each piece
        checked against its checksum and the pieces against the global shape."""
        entry = self.tensors[name]
        dtype = _TORCH_DTYPES[entry["dtype"]]
        shape = [int(d) for d in entry["global_shape"]]
        whole = torch.empty(shape, dtype=dtype)
        flat_view = whole.view(-1)
        itemsize = whole.element_size()
        boxes, ranges, seen = [], [], set()
        for piece in entry["shards"]:
            flat = [tuple(r) for r in piece.get("flat") or []]
            offset = tuple(piece.get("offset") or [0] * len(shape))
            local = tuple(piece["shape"])
            key = (tuple(flat), offset, local)
            if key in seen:
                continue  # a replica
            seen.add(key)
            numel = sum(e - b for b, e in flat) if flat else _numel(local)
            if "extents" not in piece:  # else _increment checked its chunks against its elements
                lo, hi = piece["data_offsets"]
                if not (isinstance(lo, int) and isinstance(hi, int)) or lo < 0 or hi - lo != numel * itemsize:
                    raise CheckpointError(f"{self.path}: tensor {name}: a piece of {hi - lo} bytes for {numel} "
                                          "elements")
            data = self._piece_bytes(name, piece)
            src = torch.frombuffer(data, dtype=torch.uint8).view(dtype) if numel else torch.empty(0, dtype=dtype)
            if flat:
                at = 0
                for b, e in flat:
                    if not 0 <= b <= e <= flat_view.numel():
                        raise CheckpointError(f"{self.path}: tensor {name}: flat range [{b}, {e}) outside it")
                    flat_view[b:e].copy_(src[at:at + e - b])
                    at += e - b
                    ranges.append((b, e))
                continue
            if len(offset) != len(shape) or len(local) != len(shape) or any(
                    o < 0 or n < 0 or o + n > s for o, n, s in zip(offset, local, shape)):
                raise CheckpointError(f"{self.path}: tensor {name}: piece at {list(offset)} of shape "
                                      f"{list(local)} lies outside {shape}")
            _region(whole, offset, local).copy_(src.view(local))
            boxes.append((offset, local))
        _check_cover(self.path, name, shape, boxes, ranges)
        return whole

    def _piece_bytes(self, name, piece):
        version = self.manifest["format_version"]
        try:
            if "extents" not in piece:
                _check_file_name(piece["file"], version, piece["rank"])
            return self._reader.piece(name, self.tensors[name]["dtype"], piece, self._rank_files[piece["rank"]])
        except ValueError as e:
            raise CheckpointError(str(e)) from None


def _not_a_step(path):
    """What a path that holds no manifest is, and what to pass instead."""
    if not path.startswith("s3://") and os.path.isdir(path):
        steps = sorted(d for d in os.listdir(path) if d.startswith("step-") and "." not in d)
        if steps:
            return (f"load(from_path={path!r}): not a step directory but a job's, holding "
                    f"{', '.join(steps[-3:])}{' ...' if len(steps) > 3 else ''}: name one of its steps "
                    f"(e.g. {os.path.join(path, steps[-1])!r})")
        return (f"load(from_path={path!r}): no manifest.json in it: not a committed ckptd step "
                "(a step directory is <root>/<job>/step-NNNNNNNN; one still being written has no manifest)")
    if not path.startswith("s3://"):
        return f"load(from_path={path!r}): no such directory"
    return f"load(from_path={path!r}): no manifest.json there: no committed ckptd step at that URL"


def _numel(shape):
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _region(t, offset, shape):
    for dim, (o, n) in enumerate(zip(offset, shape)):
        t = t.narrow(dim, o, n)
    return t


def _check_cover(path, name, shape, boxes, ranges):
    """The pieces tile the tensor exactly once, as ckptd checks before it commits a step: a
    step copied by hand may have lost a rank's file from its manifest's view."""
    total = _numel(shape)
    if ranges:
        at = 0
        for b, e in sorted(ranges):
            if b != at:
                raise CheckpointError(f"{path}: tensor {name}: its pieces leave elements [{at}, {b}) out"
                                      if b > at else f"{path}: tensor {name}: its pieces overlap at {b}")
            at = e
        if at != total or boxes:
            raise CheckpointError(f"{path}: tensor {name}: its pieces do not cover its {total} elements")
        return
    if sum(_numel(local) for _, local in boxes) != total:
        raise CheckpointError(f"{path}: tensor {name}: its pieces do not cover its global shape {shape} exactly")
    for i, (a_off, a_shape) in enumerate(boxes):
        for b_off, b_shape in boxes[i + 1:]:
            if all(ao < bo + bs and bo < ao + as_ for ao, as_, bo, bs in zip(a_off, a_shape, b_off, b_shape)):
                raise CheckpointError(f"{path}: tensor {name}: pieces at {list(a_off)} and {list(b_off)} overlap")


def selected(name, include, exclude):
    """Whether load(exclude=)'s selection takes tensor `name`: ckptd's own rule (a name is
    restored when no include is given or one matches, and no exclude matches; `*` matches
    dots too)."""
    if include and not any(fnmatch.fnmatchcase(name, p) for p in include):
        return False
    return not any(fnmatch.fnmatchcase(name, p) for p in exclude)


def copy_parts(step_dir, parts, include, exclude, strict, cast):
    """Copies each selected part (the manager's (entry, _placement.Local) pairs) from
    `step_dir`. Checks everything first (names on both sides, shapes, dtypes), so that a step
    that does not fit changes nothing. Returns (bytes copied, names not in the step, names in
    the step that no part took), the last two only with strict=False."""
    wanted = [(e, p) for e, p in parts if selected(e.name, include, exclude)]
    names = {e.name for e, _ in wanted}
    missing = sorted(n for n in names if n not in step_dir.tensors)
    unexpected = sorted(n for n in step_dir.tensors if n not in names and selected(n, include, exclude))
    where = f"load(from_path={step_dir.path!r})"
    if strict and (missing or unexpected):
        raise CheckpointError(
            f"{where}: step {step_dir.step} does not match the model:"
            + (f" {len(missing)} of its tensors are not in the step ({_some(missing)});" if missing else "")
            + (f" {len(unexpected)} tensors of the step are not in the model ({_some(unexpected)});"
               if unexpected else "")
            + (" exclude=['optimizer'] loads the model alone;" if unexpected and not missing
               and all(n.startswith("optim.") for n in unexpected) else "")
            + " strict=False skips them (with a warning), exclude= leaves parts out")
    mismatched = []
    for e, part in wanted:
        stored = step_dir.tensors.get(e.name)
        if stored is None:
            continue
        target_global = part.global_shape or list(part.tensor.shape)
        if [int(d) for d in stored["global_shape"]] != [int(d) for d in target_global]:
            raise CheckpointError(f"{where}: tensor {e.name} is {list(stored['global_shape'])} in step "
                                  f"{step_dir.step}, {list(target_global)} here")
        dtype = _TORCH_DTYPES.get(stored["dtype"])
        if dtype is None:
            raise CheckpointError(f"{where}: tensor {e.name}: dtype {stored['dtype']} has no torch equivalent")
        if dtype != part.tensor.dtype and not (cast and dtype.is_floating_point and part.tensor.is_floating_point()):
            mismatched.append(f"{e.name} ({stored['dtype']} in the step, {part.tensor.dtype} here)")
    if mismatched:
        raise CheckpointError(f"{where}: {len(mismatched)} tensors were saved in another dtype: "
                              f"{_some(mismatched)}; cast=True converts floating-point ones")
    nbytes = 0
    with torch.no_grad():
        for e, part in wanted:
            if e.name not in step_dir.tensors:
                continue
            whole = step_dir.global_tensor(e.name)
            if part.flat:
                flat = whole.view(-1)
                source = torch.cat([flat[b:end] for b, end in part.flat])
            elif part.global_shape:
                source = _region(whole, part.global_offset, list(part.tensor.shape))
            else:
                source = whole
            part.tensor.copy_(source.reshape(part.tensor.shape))
            nbytes += part.tensor.numel() * part.tensor.element_size()
    return nbytes, missing, unexpected


def _some(names, n=5):
    return ", ".join(names[:n]) + (", ..." if len(names) > n else "")


def source_steps(socket, job, step, list_checkpoints):
    """The committed steps of job `job` that the node's ckptd holds (any tier), for
    load(from_job=): CheckpointError naming what was not found (the job, or the step, and
    what there is instead) before anything registers under that job's name."""
    try:
        listed, _ = list_checkpoints(socket, job)
    except Exception as e:  # noqa: BLE001 - ckptd.Error, named in the message
        raise CheckpointError(f"load(from_job={job!r}): cannot list its checkpoints: {e}") from e
    steps = sorted({c["step"] for c in listed if c.get("job", job) == job and not c.get("error")})
    if not steps:
        try:
            everything, _ = list_checkpoints(socket, "")
            jobs = sorted({c["job"] for c in everything if c.get("job")})
        except Exception:  # noqa: BLE001 - only the hint is lost
            jobs = []
        from ckptd import _advice
        near = _advice.close_jobs(job, jobs) if jobs else []
        raise CheckpointError(f"load(from_job={job!r}): job {job!r} has no committed checkpoint on this "
                              f"node's ckptd (memory, disk or its remote tier)"
                              + (f"; jobs that do: {', '.join(map(repr, near))} (a misspelt job name?)"
                                 if near else f"; it holds {len(jobs)} other jobs (ckptctl list)" if jobs else ""))
    if step is not None and int(step) not in steps:
        raise CheckpointError(f"load(from_job={job!r}, step={step}): job {job!r} has no step {step}; "
                              f"its committed steps: {_some([str(s) for s in steps[::-1]], 8)}")
    return steps

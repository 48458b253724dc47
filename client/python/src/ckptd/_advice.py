"""What a Python user can do about what ckptd reports.

ckptd's messages name the problem in terms of tensors and steps, the same for every client;
the ways out are spelled here as this package's own arguments (`strict=False`,
`exclude_from_loading=`), never as the C++ client's options.
"""
import difflib
import re

# Said by ckptd (daemon/restorer.cc, format/read_plan.cc); kept in one place so that a
# change of wording there shows up here as a missing hint in the tests, not as silence.
_NAMES_DIFFER = "does not match the registered tensors"
_LAYOUT_DIFFERS = "cannot be read from step"
_DTYPE_DIFFERS = re.compile(r"saved as (\w+), wanted as (\w+)")
_OTHER_PROBLEMS = ("shape [", "no saved shard", "not in the checkpoint", "the wanted piece")
_FLOATS = {"F64", "F32", "F16", "BF16"}


def _only_float_dtypes_differ(message):
    """Whether every problem listed is a floating-point tensor saved in another float dtype:
    what load(cast=True) reads."""
    pairs = _DTYPE_DIFFERS.findall(message)
    return bool(pairs) and all(a in _FLOATS and b in _FLOATS for a, b in pairs) and not any(
        w in message for w in _OTHER_PROBLEMS)


def restore_advice(message):
    """The Python way out of a failed restore, or None when the message is not one we know."""
    if _NAMES_DIFFER in message:
        return ("to load part of it, pass exclude_from_loading=['optimizer'] to the "
                "CheckpointManager (or load(exclude=['optimizer'])) for the model alone, or a "
                "tensor-name pattern such as 'lm_head.*'; load(strict=False) skips tensors found "
                "on one side only, with a warning naming them")
    if _LAYOUT_DIFFERS in message and _only_float_dtypes_differ(message):
        return ("the checkpoint holds these tensors in another floating-point dtype (a weights-only "
                "save in bf16?): load(cast=True) casts them into the model's dtype as Tensor.to does")
    if _LAYOUT_DIFFERS in message and "wanted" in message:
        return ("the model is not the one that was saved (shapes or dtypes differ): build it with "
                "the configuration it was saved with, or leave those tensors out with "
                "load(exclude=['name-or-pattern', ...])")
    return None


_DIGITS = re.compile(r"\d+")


def _edits(a, b):
    """The edit distance of a and b: insertions, deletions, substitutions and swaps of two
    neighbours (a typo's slips) each count one."""
    before, row = None, list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        here = [i]
        for j, y in enumerate(b, 1):
            d = min(row[j] + 1, here[j - 1] + 1, row[j - 1] + (x != y))
            if before is not None and i > 1 and j > 1 and x == b[j - 2] and a[i - 2] == y:
                d = min(d, before[j - 2] + 1)
            here.append(d)
        before, row = row, here
    return row[-1]


def close_jobs(name, jobs, n=3):
    """The jobs in `jobs` whose names `name` may be a misspelling of, closest first: one slip
    in a short name, two in a longer one, or another case. Names that differ only in their
    numbers ("run-7" beside "run-6", "exp2" beside "exp", "llama3-70b" beside "llama3-8b")
    are other jobs of a series, not slips."""
    def slips(job):
        if job.lower() == name.lower():
            return 0
        if _DIGITS.sub("", job) == _DIGITS.sub("", name):
            return None
        d = _edits(name, job)
        return d if d <= (1 if len(name) <= 5 else 2) else None
    near = [(slips(job), job) for job in jobs if job != name]
    return [job for d, job in sorted((d, job) for d, job in near if d is not None)][:n]


def other_run(job, steps, count, step, resume):
    """The warning for a run that saves `step` into a job already holding `count` committed
    steps (the newest `steps`) without having resumed from them; `resume` says how to resume
    in the caller's terms."""
    return (f"ckptd: job {job!r} already holds committed steps {describe_steps(steps, count)} from an "
            f"earlier run, and this run saves step {step} without having resumed from it. Its steps "
            "join the job's after them (restores take the newest run's newest step), and retention "
            f"(keep_last) deletes the oldest of all, the earlier run's first. To resume that run, "
            f"{resume}; to start clean, use another job name or delete its steps "
            f"(ckptctl --job {job} delete STEP).")


def describe_steps(steps, count):
    """"10, 20, 30" or "..., 80, 90 (12 in all)": the newest of a job's steps."""
    shown = ", ".join(str(s) for s in steps[-5:])
    return shown if count <= 5 else f"..., {shown} ({count} in all)"

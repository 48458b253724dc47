"""What load() restored: the step, as an int, that also says where it came from."""
import types


class Restored(int):
    """The step load() restored (an int: `(manager.load() or 0) + 1` is the next step), with
    where it came from: `source` ("memory", "disk", "remote", "peer", or "path":
    load(from_path=)), `bytes` restored, and
    `resharded_from`, the world size the step was saved with when that differs from the
    job's now (None otherwise). `extra`: the plain values of extra_state (numbers, strings),
    which load() cannot restore in place, as saved. `manager.restored` is the same object
    (None when nothing was restored); `restored["source"]` reads as `restored.source`."""

    extra = types.MappingProxyType({})  # none (a load set its own)

    def __new__(cls, step, source, nbytes, resharded_from=None):
        restored = super().__new__(cls, step)
        restored.source, restored.bytes, restored.resharded_from = source, nbytes, resharded_from
        return restored

    @property
    def step(self):
        return int(self)

    def describe(self):
        """"restored step 40 from memory (1.2 GB)", and ", resharded from 4 ranks" if so."""
        resharded = f", resharded from {self.resharded_from} ranks" if self.resharded_from else ""
        return f"restored step {int(self)} from {self.source} ({self.bytes / 1e9:.3g} GB{resharded})"

    # An int wherever it is printed or formatted (f"step {step}"); the details in the REPL.
    __str__ = int.__repr__

    def __format__(self, spec):
        return int(self).__format__(spec)

    def __repr__(self):
        return (f"Restored(step={int(self)}, source={self.source!r}, bytes={self.bytes}, "
                f"resharded_from={self.resharded_from})")

    # manager.restored was once a dict of these: code that reads it so keeps working.
    _KEYS = ("step", "source", "bytes", "resharded_from", "extra")

    def __getitem__(self, key):
        if key not in self._KEYS:
            raise KeyError(key)
        return getattr(self, key)

    def __reduce__(self):  # pickles (and copies) as what it is
        return (Restored, (int(self), self.source, self.bytes, self.resharded_from))

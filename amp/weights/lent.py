"""The FP32 values handed out for rows that hold no FP32 tensor (an exact master's bf16 weight and
remainder, a compact one's weight and correction): by `model.state_dict()` and, with the master
gradients on them, by `amp.master_params`.

A state dict at O2 hands out FP32 values, and code writes through them as through torch's own
(timm's ModelEmaV2/V3 update a model through a state dict they then drop; torch's distributed
checkpoint loads into the tensors of the state dict it was given). So a row keeps the tensor it
lent in step with it, as an FP32 master is: a write into the tensor is the row's value from the
next step or forward on (the FP32 side wins, as for an FP32 master), and a step, a load or a
write taken in is seen in it.

A lent DTensor (an FSDP2 shard's value) is watched through its version counter and its local
shard's: an in-place op on the DTensor bumps the first only, torch's distributed checkpoint
loads into the shard, which bumps the second only. (An in-place foreach op on DTensors bumps
neither, and is not seen.)

Lending only reads: it decodes the row into a new tensor and notes it, or hands out the one
already lent. Nothing that reads (a step hook, another thread's state dict, amp.master_params)
writes a row or a mark; only the training thread's step, forward, load and undo take what was
written (`written`) and refresh the tensors (`refresh`). A lent tensor is held until its writes
have been taken, then only weakly: one dropped costs nothing after, one kept stays in step. The
usual check, nothing written, is a few C-level compares over parallel lists.
"""

import operator
import threading
import weakref

import torch

from ..distributed import dtensor_class
from .columns import NONES as _NONES
from .columns import address

__all__ = ["LentValues"]

_VERSION = operator.attrgetter("_version")
_CALL = operator.call
_NOT_NONE = operator.is_not


def _version(value):
    """A lent tensor's version counter (a DTensor's: with its local shard's, the module doc)."""
    local = getattr(value, "_local_tensor", None)
    return value._version if local is None else value._version + local._version


def _versions(values, sharded):
    """_version of each of `values` (at C level but where some are DTensors)."""
    return list(map(_version if sharded else _VERSION, values))


class LentValues:
    """The FP32 tensors lent for rows of one owner, by the id of their parameter."""

    def __init__(self):
        self.keys, self.refs, self.versions = [], [], []
        self.strong = {}  # index -> the tensor, held until its writes are taken
        self.seen = []  # the parameter's (version, address) when its value was lent
        self.position = {}  # key -> its index in the lists
        self.sharded = False  # some are DTensors: their shards' counters are read
        # Another thread's state dict lends while the training thread takes writes and refreshes:
        # each holds this while it reads or rebuilds the lists (an index is a place in them).
        self.lock = threading.RLock()

    def lend(self, key, param, value_of):
        """The FP32 tensor lent for `key` (the row of `param`): the one still held, unless
        `param` was written since it was made and it was not (a new one then: the row's value
        now), else `value_of()` (a new tensor of the row's value), noted. Writes nothing but
        these lists."""
        with self.lock:
            index = self.position.get(key)
            value = None if index is None else self.refs[index]()
            mark = (param._version, address(param))
            unwritten = value is not None and _version(value) == self.versions[index]
            if unwritten and self.seen[index] != mark:
                value = None  # made before a write from outside amp, and not written since
            if value is None:
                value = value_of()
                dtensor = dtensor_class()
                self.sharded = self.sharded or (dtensor is not None and isinstance(value, dtensor))
                if index is None:
                    index = self.position[key] = len(self.keys)
                    for column in (self.keys, self.refs, self.versions, self.seen):
                        column.append(None)
                    self.keys[index] = key
                self.refs[index] = weakref.ref(value)
                self.versions[index] = _version(value)
                self.seen[index] = mark
            self.strong[index] = value  # held until its writes are taken
            return value

    def pending(self, key):
        """The tensor lent for `key` if it was written since amp last wrote or lent it, else
        None (what the row's value is until the write is taken)."""
        with self.lock:
            index = self.position.get(key)
            value = None if index is None else self.refs[index]()
            if value is not None and _version(value) != self.versions[index]:
                return value
            return None

    def _values(self):
        return list(map(_CALL, self.refs))

    def unchanged(self):
        """True when every lent tensor is alive and unwritten (C-level compares)."""
        values = self._values()
        if not all(map(_NOT_NONE, values, _NONES)):
            return False
        return _versions(values, self.sharded) == self.versions

    def written(self, rows_of):
        """[(row, tensor)] of the lent tensors written since amp last wrote or lent them, for
        rows still there (`rows_of`: id -> row); from then on every tensor is held only by whoever
        kept it. Forgets the tensors no one holds."""
        with self.lock:
            if self.unchanged():
                self.strong = {}
                return []
            found, kept = [], []
            for key, ref, version, seen in zip(self.keys, self.refs, self.versions, self.seen):
                value, row = ref(), rows_of.get(key)
                if value is None or row is None:
                    continue
                if _version(value) != version:
                    found.append((row, value))
                kept.append((key, ref, _version(value), seen))
            self.keys = [key for key, _, _, _ in kept]
            self.refs = [ref for _, ref, _, _ in kept]
            self.versions = [version for _, _, version, _ in kept]
            self.seen = [seen for _, _, _, seen in kept]
            self.strong = {}
            self.position = {key: index for index, key in enumerate(self.keys)}
            return found

    def refresh(self, rows_of, value_of, params, rows=None):
        """The rows (all, or `rows`) were written by amp: their lent tensors take the values (of
        `params`, the rows' parameters, as they are now)."""
        with self.lock:
            with torch.no_grad():
                for index, (key, ref) in enumerate(zip(self.keys, self.refs)):
                    value, row = ref(), rows_of.get(key)
                    if value is None or row is None or (rows is not None and row not in rows):
                        continue
                    value.copy_(value_of(row))
                    self.versions[index] = _version(value)
                    self.seen[index] = (params[row]._version, address(params[row]))

"""The FP32 values a state dict lends out for compact rows (which hold no FP32 tensor).

`model.state_dict()` at O2 hands out the FP32 tensors themselves, and code writes through them
(timm's ModelEmaV2 updates a model through a state dict it then drops). A compact row's value is
decoded from its bf16 weight and int8 correction into a new tensor, so the table keeps the tensor
it lent in step with the row, as an exact master's tensor is: a write into it reaches the row
before a step, a forward or deinitialize (the FP32 side wins), and a step, a load or an outside
write to the weight is seen in it (a step or a load refreshes it; a state dict taken later reads
the row again). The table holds it until its writes have been taken (the next step or forward),
then only weakly: a state dict dropped costs nothing after, one kept stays in step.
"""

import weakref

import torch

__all__ = ["LentValues"]

_STRONG, _WEAK, _VERSION = 0, 1, 2  # an entry: [the tensor or None, a weak reference, version]


class LentValues(dict):
    """id(model parameter) -> [the FP32 tensor lent out until its writes are taken, else None; a
    weak reference to it; its version when amp last wrote it]."""

    def lend(self, table, row):
        """The row's FP32 value as a state dict hands it out: one tensor while it is held,
        brought in step with the row (a write into it taken in first)."""
        key = id(table.models[row])
        lent = self.get(key)
        value = None if lent is None else lent[_WEAK]()
        if value is None:
            table.sync_row(row)
            value = table.value(row)
            self[key] = [value, weakref.ref(value), value._version]
            return value
        if value._version != lent[_VERSION]:  # written through a state dict: the FP32 side wins
            table.set_value(row, value)
        else:  # a step, a load or a write to the weight since: the row's value now
            table.sync_row(row)
            with torch.no_grad():
                value.copy_(table.value(row))
        lent[_STRONG], lent[_VERSION] = value, value._version
        return value

    def push_writes(self, table):
        """Writes into the lent tensors reach their rows (before a step, a forward, an undo);
        from then on the tensors are held only by whoever kept them."""
        for lent, value, row in self._held(table):
            if value._version != lent[_VERSION]:
                table.set_value(row, value)
                lent[_VERSION] = value._version
            lent[_STRONG] = None

    def refresh(self, table, rows=None):
        """A step (or a load of `rows`) wrote the rows: the lent tensors take their values."""
        with torch.no_grad():
            for lent, value, row in self._held(table):
                if rows is None or row in rows:
                    value.copy_(table.value(row))
                    lent[_VERSION] = value._version

    def _held(self, table):
        """(entry, tensor, row) of the lent tensors still held and of rows still there; the
        others are forgotten."""
        held = []
        for key, lent in list(self.items()):
            value, row = lent[_WEAK](), table.index.get(key)
            if value is None or row is None:
                del self[key]
            else:
                held.append((lent, value, row))
        return held

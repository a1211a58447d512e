"""The FP32 values a state dict lends out for compact rows (which hold no FP32 tensor).

`model.state_dict()` at O2 hands out the FP32 tensors themselves, and code writes through them
(timm's ModelEmaV2 updates a model through its state dict). A compact row's value is decoded from
its bf16 weight and int8 correction into a new tensor, so the table keeps the tensor it lent and
keeps the two in step until the next forward: a write into it reaches the row before a step, at
the next forward or at deinitialize (the FP32 side wins, as for exact masters), and a step or an
outside write to the weight is seen in it (a step refreshes it; a state dict taken later reads
the row again), so it behaves as an exact master's tensor would.
"""

import torch

__all__ = ["LentValues"]


class LentValues(dict):
    """id(model parameter) -> [the FP32 tensor lent out, its version when amp last wrote it]."""

    def lend(self, table, row):
        """The row's FP32 value as a state dict hands it out: one tensor until the next forward,
        brought in step with the row (a write into it taken in first)."""
        key = id(table.models[row])
        lent = self.get(key)
        if lent is None:
            table.sync_row(row)
            value = table.value(row)
            self[key] = [value, value._version]
            return value
        value = lent[0]
        if value._version != lent[1]:  # written through a state dict: the FP32 side wins
            table.set_value(row, value)
        else:  # a step, a load or a write to the weight since: the row's value now
            table.sync_row(row)
            with torch.no_grad():
                value.copy_(table.value(row))
        lent[1] = value._version
        return value

    def push_writes(self, table):
        """Writes into the lent tensors reach their rows (before a step, a forward, an undo)."""
        for key, lent in self.items():
            row = table.index.get(key)
            if row is not None and lent[0]._version != lent[1]:
                table.set_value(row, lent[0])
                lent[1] = lent[0]._version

    def refresh(self, table):
        """A step wrote the rows: the lent tensors take their new values."""
        with torch.no_grad():
            for key, lent in self.items():
                row = table.index.get(key)
                if row is not None:
                    lent[0].copy_(table.value(row))
                    lent[1] = lent[0]._version

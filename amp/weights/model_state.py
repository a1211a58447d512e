"""FP32 state dicts of a cast model at O2/O3: live FP32 values behind the low-precision tensors.

At O2 every cast parameter has an FP32 value in a table (table.py): its master when an optimizer
steps it, an FP32 copy in the table of frozen parameters when none does (or, with compact
masters, the weight and its correction, decoded for a state dict). At O2/O3 every cast floating
buffer keeps its FP32 original in the model's buffer table (buffers.py). O3 keeps no FP32 copy
of its parameters: `state_dict()` makes one (`Handed`), kept until the next forward has taken
what was written into it; compact masters hold none either, and their table lends one (lent.py). `model.state_dict()` returns the FP32 tensors themselves, so that code
which updates a model in place through its state dict (timm's ModelEmaV2/V3 on a
`copy.deepcopy` of the model) changes what the model computes with: a write into an FP32 value
is copied into the low-precision tensor before the next forward, and a write into the
low-precision tensor is taken into the FP32 value where it changed the low-precision value
(table.py says how). Once a state dict has handed them out, a forward checks every FP32 side's
version counter in one C-level compare per table: it costs no more Python calls than before.

Parameters are found by identity, wherever they sit: one that `torch.nn.utils.parametrize` or
`torch.nn.utils.prune` moved (to `<module>.parametrizations.<name>.original`, `<name>_orig`) is
served under its new key, and a load under that key reaches its FP32 value. Each hook handles its
module's own tensors and those of the submodules made after `amp.initialize` (which have no hooks
of their own), so a state dict of any module is FP32 throughout.

The hooks hold everything they read (picklable module-level classes), so a deepcopy or a pickle
of the model carries its own FP32 values along.
"""

import operator

import torch

from ..casting.casts import LOW_PRECISION
from .buffers import BufferTable, held_exactly
from .table import find

__all__ = [
    "ModelCopies",
    "Handed",
    "SyncBeforeForward",
    "FP32StateDict",
    "LoadIntoCopies",
    "MarkLoaded",
]

_VERSION = operator.attrgetter("_version")


class ModelCopies:
    """What the state-dict hooks of one model read: the tables of the parameters (shared by every
    model of one initialize), the model's buffer table, O3's parameters a state dict handed out,
    and the modules that have hooks of their own."""

    def __init__(self, tables, buffers):
        self.tables = tables  # the optimizers' tables and the frozen parameters' table
        self.buffers = buffers  # BufferTable of the model's cast buffers
        self.handed = None  # Handed: FP32 values a state dict made, kept to the next forward
        self.hooked = set()  # the modules amp registered the hooks on
        self.lent = False  # a state dict handed out FP32 tensors: they may be written any time

    def walk(self, module, prefix):
        """(module, prefix) for `module` and its submodules that have no hooks of their own."""
        found = [(module, prefix)]
        for name, child in module._modules.items():
            if child is not None and child not in self.hooked:
                found.extend(self.walk(child, f"{prefix}{name}."))
        return found

    def sync(self):
        """Every write since the last mark taken across (before deinitialize's undo)."""
        for table in self.tables:
            table.take_outside_writes()
        self.buffers.sync()
        if self.handed is not None:
            self.handed.sync()


class SyncBeforeForward:
    """Forward pre-hook: writes made through a state dict reach the model before it computes."""

    def __init__(self, copies):
        self.copies = copies

    def __call__(self, module, args):
        copies = self.copies
        if not copies.lent:
            return
        # Rows.masters_unwritten, inlined: a forward costs no Python call per table.
        for table in (*copies.tables, copies.buffers):
            if list(map(_VERSION, table.masters)) != table.master_versions:
                table.push_written_masters()
        for table in copies.tables:
            if table.lent:  # compact rows' FP32 values written through a state dict
                table.lent.push_writes(table)
        if copies.handed is not None:  # O3's: taken over, then dropped
            copies.handed.push_written_masters()
            copies.handed = None


class Handed(BufferTable):
    """The FP32 values a state dict made of O3's parameters (which hold none), kept until the
    next forward has taken what was written into them into the parameters."""

    def __init__(self):
        super().__init__("_parameters")


class FP32StateDict:
    """State-dict post-hook: the low-precision entries of a module as their FP32 values."""

    def __init__(self, copies):
        self.copies = copies

    def __call__(self, module, state_dict, prefix, local_metadata):
        copies = self.copies
        buffers = copies.buffers
        for owner, owner_prefix in copies.walk(module, prefix):
            for name, param in owner._parameters.items():
                value = state_dict.get(owner_prefix + name)
                if _low(value, param):
                    state_dict[owner_prefix + name] = self._param_value(owner, name, param)
            rows = buffers.rows.get(owner, {})
            for name, buffer in owner._buffers.items():
                value = state_dict.get(owner_prefix + name)
                if _low(value, buffer):
                    row = rows.get(name)
                    if row is None:
                        state_dict[owner_prefix + name] = value.float()  # made after initialize
                        continue
                    buffers.sync_row(row)
                    state_dict[owner_prefix + name] = buffers.full(row).detach()
                    copies.lent = True

    def _param_value(self, owner, name, param):
        copies = self.copies
        copies.lent = True
        table, row = find(param, copies.tables)
        if table is not None:
            if table.compact:  # one decoded tensor, kept in step with the row (lent.py)
                return table.lent.lend(table, row)
            table.sync_row(row)
            return table.masters[row].detach()  # shares the version counter: writes show
        handed = copies.handed  # O3's
        if handed is None:
            handed = copies.handed = Handed()
        made = handed.rows.get(owner, {}).get(name)
        if made is None or handed.current(made) is not param:
            made = handed.add(owner, name, param.detach().float())
        handed.sync_row(made)
        return handed.masters[made].detach()


def _low(value, tensor):
    """Whether a state-dict entry is a low-precision value to replace (not a live Parameter
    kept by keep_vars=True, not absent, not already FP32)."""
    return value is not None and value is not tensor and value.dtype in LOW_PRECISION


class LoadIntoCopies:
    """Load-state-dict pre-hook: full-precision values go into the FP32 copies, not only into the
    model (whose own load rounds them)."""

    def __init__(self, copies):
        self.copies = copies

    def __call__(self, module, state_dict, prefix, *args):
        copies = self.copies
        buffers = copies.buffers
        with torch.no_grad():
            for owner, owner_prefix in copies.walk(module, prefix):
                for name, param in owner._parameters.items():
                    table, row = find(param, copies.tables)
                    if table is not None:
                        table.sync_row(row)  # a write not yet taken over is not lost to a load
                        value = state_dict.get(owner_prefix + name)
                        if table.compact and _fits(value, param):
                            table.set_value(row, value)
                            if table.lent:  # a tensor lent before shows the load (it wins)
                                table.lent.refresh(table, (row,))
                        elif not table.compact:
                            _load(table.masters[row], value)
                for name, row in buffers.rows.get(owner, {}).items():
                    buffers.sync_row(row)
                    value = state_dict.get(owner_prefix + name)
                    if not (buffers.exact[row] and _held_exactly(value, buffers.current(row))):
                        _load(buffers.full(row), value)


def _held_exactly(value, low):
    """Whether the model's own load of `value` into the low-precision `low` keeps every bit."""
    return (
        isinstance(value, torch.Tensor)
        and low is not None
        and value.shape == low.shape
        and value.dtype is torch.float32
        and held_exactly(value, value.to(low.dtype))
    )


def _fits(value, tensor):
    return isinstance(value, torch.Tensor) and value.shape == tensor.shape


def _load(fp32, value):
    if _fits(value, fp32):
        fp32.copy_(value)


class MarkLoaded:
    """Load-state-dict post-hook: what was just loaded is amp's own write, not an outside one."""

    def __init__(self, copies):
        self.copies = copies

    def __call__(self, module, incompatible_keys):
        copies = self.copies
        for owner, _ in copies.walk(module, ""):
            for param in owner._parameters.values():
                table, row = find(param, copies.tables)
                if table is not None:
                    table.mark_row(row)
            for row in copies.buffers.rows.get(owner, {}).values():
                copies.buffers.mark_place(row)

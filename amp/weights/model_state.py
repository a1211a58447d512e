"""FP32 state dicts of a cast model at O2/O3: live FP32 values behind the low-precision tensors.

At O2 every cast parameter's FP32 value is a row (rows.py) of one owner: its optimizer's, or
this initialize's frozen rows for one no optimizer steps. At O2/O3 every cast floating buffer
keeps its FP32 original in the model's buffer table (buffers.py). O3 keeps no FP32 copy of its
parameters: `state_dict()` makes one (`Handed`), kept until the next forward has taken what was
written into it.

`model.state_dict()` hands out FP32 tensors that stay in step with the model, as torch's own
state dict's tensors are its parameters: an FP32 master itself, or a value a row lends (lent.py).
A write into one is the model's value from its next forward or step on (the FP32 side wins); a
step or a load shows in it. Reading writes nothing: a state dict taken in a step hook or another
thread changes no bit of the run. Once a state dict has handed them out, a forward checks every
row's marks in C-level compares.

Parameters are found by identity, wherever they sit: one that `torch.nn.utils.parametrize` or
`torch.nn.utils.prune` moved (to `<module>.parametrizations.<name>.original`, `<name>_orig`) is
served under its new key, and a load under that key reaches its FP32 value. Each hook handles its
module's own tensors and those of the submodules made after `amp.initialize` (which have no hooks
of their own), so a state dict of any module is FP32 throughout.

The hooks hold what they read (picklable module-level classes). A deepcopy or a pickle of the
model carries the rows of its own parameters along, as frozen rows of their own (a copy steps
nothing: timm's EMA of a model, its FP32 values exact).
"""

import itertools
import operator

import torch

from .._state import amp_state
from ..casting.casts import LOW_PRECISION
from .buffers import BufferTable, held_exactly
from .rows import FrozenRows

__all__ = [
    "ModelCopies",
    "Handed",
    "SyncBeforeForward",
    "FP32StateDict",
    "LoadIntoCopies",
    "MarkLoaded",
]

_VERSION = operator.attrgetter("_version")
_CALL = operator.call
_VERSIONS = itertools.repeat("_version")
_NONES = itertools.repeat(None)


class ModelCopies:
    """What the state-dict hooks of one model read: its cast parameters' rows (this initialize's,
    or a copy's own), its buffer table, O3's parameters a state dict handed out, and the modules
    that have hooks of their own."""

    def __init__(self, params, buffers):
        self.params = params  # the model's cast parameters
        self.own = None  # a copy's [FrozenRows] of its parameters (None: amp_state's)
        self.buffers = buffers  # BufferTable of the model's cast buffers
        self.handed = None  # Handed: FP32 values a state dict made, kept to the next forward
        self.hooked = set()  # the modules amp registered the hooks on
        self.lent = False  # a state dict handed out FP32 tensors: they may be written any time
        self.loaded = []  # (rows, row, FP32 value) a load's pre-hooks found, for its post-hook

    def rows(self):
        """Every Rows the model's parameters are in."""
        return amp_state.rows if self.own is None else self.own

    def find(self, param):
        """(rows, row) of `param`'s FP32 value, or (None, None)."""
        if self.own is None:
            rows = amp_state.owners.get(id(param))
        else:
            rows = next((r for r in self.own if id(param) in r.index), None)
        return (None, None) if rows is None else (rows, rows.index[id(param)])

    def walk(self, module, prefix):
        """(module, prefix) for `module` and its submodules that have no hooks of their own."""
        found = [(module, prefix)]
        for name, child in module._modules.items():
            if child is not None and child not in self.hooked:
                found.extend(self.walk(child, f"{prefix}{name}."))
        return found

    def sync(self):
        """Every write since the last mark taken in (before deinitialize's undo)."""
        for rows in self.rows():
            rows.take_writes()
        self.buffers.sync()
        if self.handed is not None:
            self.handed.sync()

    # -- copies of the model (deepcopy, pickle) ------------------------------------------------

    def __getstate__(self):
        state = dict(self.__dict__)
        if self.own is None:  # the copy keeps its parameters' rows as frozen rows of its own
            state["own"] = _copied_rows(self)
        return state


def _copied_rows(copies):
    """Frozen rows holding copies of the rests of `copies`' parameters (and whether each side
    was written since its mark: a copy takes such a write in as the original would)."""
    by_form = {}
    for param in copies.params:
        rows, row = copies.find(param)
        if rows is None:
            continue
        frozen = by_form.get(rows.form.name)
        if frozen is None:
            frozen = by_form[rows.form.name] = FrozenRows(rows.form)
        new = frozen.add(param, rows.rest(row).detach().clone())
        if rows.param_written(row):
            frozen.marks[0][new] = None  # its version: written
        if rows._rest_written(row):
            frozen.rest_versions[new] = None
    return list(by_form.values())


class SyncBeforeForward:
    """Forward pre-hook: writes made through a state dict reach the model before it computes."""

    def __init__(self, copies):
        self.copies = copies

    def __call__(self, module, args):
        copies = self.copies
        if not copies.lent:
            return
        # What must reach the model before it computes: writes into lent values and FP32 masters.
        # C-level compares, inlined: a forward costs no Python call per owner.
        for rows in amp_state.rows if copies.own is None else copies.own:
            lent = rows.lent
            if lent.keys and (
                lent.sharded  # read through their shards: LentValues.written does
                or list(map(getattr, map(_CALL, lent.refs), _VERSIONS, _NONES)) != lent.versions
            ):
                rows.take_writes()
            elif rows.fp32 and list(map(_VERSION, rows.rests_seen)) != rows.rest_versions:
                rows.take_writes()
            else:  # nothing written: the lent values are held by whoever kept them
                lent.strong = {}
        buffers = copies.buffers
        if list(map(_VERSION, buffers.masters)) != buffers.master_versions:
            buffers.push_written_masters()
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
                if _low(value, param) or _converted(value, param, copies):
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
        rows, row = copies.find(param)
        if rows is not None:
            return rows.lend(row)
        handed = copies.handed  # O3's
        if handed is None:
            handed = copies.handed = Handed()
        made = handed.rows.get(owner, {}).get(name)
        if made is None or handed.current(made) is not param:
            made = handed.add(owner, name, param.detach().float())
        handed.sync_row(made)
        return handed.masters[made].detach()


def _converted(value, param, copies):
    """Whether a state-dict entry is an FP32 parameter that holds a row's rest (the model was
    converted: model.float()): its value is the row's, the master."""
    return (
        value is not None
        and value is not param
        and value.dtype is torch.float32
        and copies.find(param)[0] is not None
    )


def _low(value, tensor):
    """Whether a state-dict entry is a low-precision value to replace (not a live Parameter
    kept by keep_vars=True, not absent, not already FP32)."""
    return value is not None and value is not tensor and value.dtype in LOW_PRECISION


class LoadIntoCopies:
    """Load-state-dict pre-hook: full-precision values go into the rows (the model's own load,
    which this hook's post-hook then marks, would round them to nearest even)."""

    def __init__(self, copies):
        self.copies = copies

    def __call__(self, module, state_dict, prefix, *args):
        copies = self.copies
        buffers = copies.buffers
        with torch.no_grad():
            for owner, owner_prefix in copies.walk(module, prefix):
                for name, param in owner._parameters.items():
                    rows, row = copies.find(param)
                    if rows is None:
                        continue
                    rows.take_writes()  # a write not yet taken in is not lost to the load
                    value = state_dict.get(owner_prefix + name)
                    if _fits(value, param):
                        copies.loaded.append((rows, row, value))
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
    """Load-state-dict post-hook: the loaded FP32 values become the rows' (their weights the
    encoding's, over what the model's own load wrote), amp's own write; the buffers' places
    marked."""

    def __init__(self, copies):
        self.copies = copies

    def __call__(self, module, incompatible_keys):
        copies = self.copies
        loaded, copies.loaded = copies.loaded, []
        written = {}
        for rows, row, value in loaded:
            rows.set_value(row, value)
            written.setdefault(id(rows), (rows, set()))[1].add(row)
        for rows, rows_written in written.values():
            rows.refresh(rows_written)
        for owner, _ in copies.walk(module, ""):
            for row in copies.buffers.rows.get(owner, {}).values():
                copies.buffers.mark_place(row)
        amp_state.cast_cache.clear()

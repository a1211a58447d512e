"""Rows: the cast parameters of one owner and the rest of each one's FP32 value, with the marks of
amp's last write into them. The owner is an optimizer's (owner.py, for an optimizer amp steps;
copies.py: an FP32 master the optimizer steps) or, for the cast parameters no optimizer steps, an
initialize's (`FrozenRows`, which a copy of a model holds for its own).

A row's FP32 value is its low-precision parameter (as the model holds it) and its rest, in one of
three forms (`MasterForm`): an FP32 tensor ("fp32": the master itself, the parameter its rounding
to nearest even), an int16 remainder ("remainder": exact, for bf16 parameters) or an int8
correction ("correction": compact).

Reading a row (`value`, `lend`) never writes: a step hook, a state dict taken in another thread,
`amp.master_params` change no bit. Writes from outside amp (a `param.copy_`, a pruning mask, new
data by `param.data = ...`, a write into a lent FP32 value) are seen by the marks: both sides'
version counters, the parameter's address (storage and offset) and shape. The training thread
takes them in at its next step, forward, load or undo (`take_writes`): a written FP32 side wins;
a parameter written in place is the value where it changed (an FP32 master keeps the elements it
did not change; a remainder or correction, which cannot tell, is dropped: the written weight is
the value); new data with the version unchanged (the model moved to another device or layout, or
an assignment to `.data`) keeps its rest, which follows it to its device with the optimizer's
state of it. Writes through `param.data` in place bump no version counter: they are not seen.

Marks and reads go over whole lists at C level (`map`), so that a step costs a constant number of
Python calls however many parameters the model has.
"""


import torch

from .. import distributed, kernels
from ..casting.casts import LOW_PRECISION
from .columns import MARKS, VERSION
from .lent import LentValues

__all__ = ["FP32", "REMAINDER", "CORRECTION", "MasterForm", "Rows", "FrozenRows"]

FP32, REMAINDER, CORRECTION = "fp32", "remainder", "correction"


class MasterForm:
    """How a master's FP32 value is held beside its `dtype` parameter: `name` FP32, REMAINDER or
    CORRECTION (the last two bf16 only), and `key`, its optimizer state key."""

    KEYS = {FP32: "master", REMAINDER: "master_remainder", CORRECTION: "master_correction"}
    DTYPES = {FP32: torch.float32, REMAINDER: torch.int16, CORRECTION: torch.int8}

    def __init__(self, name, dtype):
        self.name, self.dtype = name, dtype
        self.key = self.KEYS[name]
        self.rest_dtype = self.DTYPES[name]

    def __repr__(self):
        return f"MasterForm({self.name!r}, {self.dtype})"

    def encode(self, fp32):
        """(the low-precision weight, the rest) of FP32 values, the weight in their layout (a
        channels_last or transposed parameter stays so)."""
        if self.name == FP32:
            return fp32.to(self.dtype), fp32.detach().clone()
        encode = kernels.remainder_encode if self.name == REMAINDER else kernels.compact_encode
        low, rest = distributed.shardwise(encode, fp32)  # a DTensor's (FSDP2): shard by shard
        if not fp32.is_contiguous():
            low = torch.empty_like(fp32, dtype=low.dtype).copy_(low)
        return low, rest

    def decode(self, low, rest):
        """The FP32 value a weight and its rest hold (a new tensor but for FP32: the rest)."""
        if self.name == REMAINDER:
            return distributed.shardwise(kernels.remainder_decode, low, rest)
        if self.name == CORRECTION:
            return distributed.shardwise(kernels.compact_decode, low, rest)
        return rest

    def empty_rest(self, low):
        """The rest of a weight that is its own value (a write from outside amp took its place)."""
        if self.name == FP32:
            return low.detach().float()
        return torch.zeros_like(low, dtype=self.rest_dtype, memory_format=torch.contiguous_format)


class Rows:
    """The rows of one owner: its cast parameters (`params`), their rests (`rests()`, where the
    owner keeps them) in `form`, and the marks of amp's last write."""

    def __init__(self, form):
        self.form = form
        self.fp32 = form.name == FP32  # the rests are FP32 masters, written through state dicts
        self.params = []
        self.index = {}  # id(param) -> row
        self.lent = LentValues()  # FP32 values handed out for rows without an FP32 tensor
        self.rest_list = []  # each row's rest (but where the owner keeps them elsewhere: copies.py)
        self.marks = [[] for _ in MARKS]  # a list per columns.MARKS: each row's, as amp wrote it
        self.rest_versions = []
        self.rests_seen = []  # FP32 rests as marked: their versions are compared, not looked up

    # -- the rests --------------------------------------------------------------------------

    def rests(self):
        return self.rest_list

    def rest(self, row):
        return self.rest_list[row]

    def set_rest(self, row, rest):
        """The row's rest becomes `rest` (a new tensor: a load, a shape the model's write
        changed)."""
        self.rest_list[row] = rest

    # -- marks --------------------------------------------------------------------------------

    def _add(self, param):
        """A row for `param` (its rest where the owner keeps it); returns its index."""
        self.params.append(param)
        for column in (*self.marks, self.rest_versions, self.rests_seen):
            column.append(None)
        self.index[id(param)] = len(self.params) - 1
        return len(self.params) - 1

    def _reindex(self):
        self.index = {id(param): row for row, param in enumerate(self.params)}

    def mark(self, rests=None):
        """amp (or a load) has just made every row's two sides agree (`rests`: the rows' rests,
        where the caller has them at hand)."""
        params = self.params
        self.marks = [list(map(read, params)) for read in MARKS]
        if self.fp32:
            self.rests_seen = list(self.rests() if rests is None else rests)
            self.rest_versions = list(map(VERSION, self.rests_seen))

    def mark_row(self, row):
        param = self.params[row]
        for column, read in zip(self.marks, MARKS):
            column[row] = read(param)
        if self.fp32:
            rest = self.rests_seen[row] = self.rest(row)
            self.rest_versions[row] = rest._version

    def unchanged(self):
        """True when no row was written since its mark (C-level compares)."""
        params = self.params
        return [list(map(read, params)) for read in MARKS] == self.marks and (
            not self.fp32 or list(map(VERSION, self.rests_seen)) == self.rest_versions
        )

    def param_written(self, row):
        param = self.params[row]
        return any(read(param) != column[row] for column, read in zip(self.marks, MARKS))

    def _rest_written(self, row):
        return self.fp32 and self.rests_seen[row]._version != self.rest_versions[row]

    # -- reads (they write nothing) -------------------------------------------------------------

    def _moved(self, row):
        """Whether the row's parameter holds new data that no in-place write made (its version
        unchanged): a move of the model (model.cpu(), .cuda(), a layout), or an assignment to
        `.data`; also a conversion to FP32 (model.float()) whose values the weight's dtype holds
        exactly. A remainder or correction is kept with it (within half a weight's ulp of any
        weight, it holds the moved one's value exactly); an FP32 master is compared element by
        element as after any write."""
        param, rest = self.params[row], self.rest(row)
        if (
            self.form.name == FP32
            or param._version != self.marks[0][row]
            or param.shape != rest.shape
        ):
            return False
        if param.dtype is self.form.dtype:
            return True
        data = param.detach()
        return data.dtype is torch.float32 and torch.equal(data.to(self.form.dtype).float(), data)

    def value(self, row):
        """The row's FP32 value (an FP32 master: the tensor itself while nothing outside amp
        wrote its parameter; else a new tensor), on its parameter's device."""
        param, rest = self.params[row], self.rest(row)
        moved = self._moved(row)
        if rest.device != param.device:
            rest = rest.to(param.device)
        if moved or not self.param_written(row) or self._rest_written(row):
            return self.form.decode(param.detach().to(self.form.dtype), rest)
        if param.dtype not in LOW_PRECISION or param.shape != rest.shape:
            return param.detach().float()  # new data of another dtype or shape: the value
        if self.form.name != FP32:
            return param.detach().float()  # the weight was written: its rest no longer holds
        changed = param.detach() != rest.to(param.dtype)
        return torch.where(changed, param.detach().float(), rest)

    def value_with(self, row, weight):
        """The row's FP32 value with `weight` in its parameter's place (a conversion of the model
        made a new parameter of the same values: model.to("meta")), on the weight's device."""
        rest = self.rest(row).to(weight.device)
        if self.form.name == FP32:
            return torch.where(weight != rest.to(weight.dtype), weight.float(), rest)
        return self.form.decode(weight, rest)

    def lend(self, row):
        """The FP32 value a state dict hands out, live (lent.py): an FP32 master itself, else a
        tensor the row keeps in step."""
        if self.form.name == FP32 and not self.param_written(row):
            return self.rest(row).detach()
        param = self.params[row]
        return self.lent.lend(id(param), param, lambda: self.value(row).clone())

    def saved_rest(self, row):
        """The row's rest as its value now has it, for a checkpoint (a pure read): a lent value
        written and not yet taken is the value; a parameter written from outside, its own."""
        pending = self.lent.pending(id(self.params[row])) if self.lent.keys else None
        if pending is not None:
            return self.form.encode(pending.detach())[1]
        if self.param_written(row) and not self._moved(row):
            param = self.params[row]
            return self.value(row) if self.form.name == FP32 else self.form.empty_rest(param)
        return self.rest(row).detach()

    # -- amp's writes ---------------------------------------------------------------------------

    def set_value(self, row, fp32):
        """Make `fp32` the row's value (a load, a write into a lent value): the weight its
        encoding, amp's own write."""
        param = self.params[row]
        with torch.no_grad():
            low, rest = self.form.encode(fp32.detach().to(param.device, torch.float32))
            param.copy_(low)
            self.rest(row).copy_(rest)
        self.mark_row(row)

    def take_writes(self):
        """Bring every row in step after writes from outside amp (the module doc): writes into lent
        values first (the FP32 side wins), then the marks' compare, which is all the usual
        answer, nothing written, costs."""
        if self.lent.keys:
            for row, value in self.lent.written(self.index):
                self.set_value(row, value)
        if self.params and not self.unchanged():
            for row in range(len(self.params)):
                self._take(row)

    def _take(self, row):
        param = self.params[row]
        rest_written = self._rest_written(row)
        if not (rest_written or self.param_written(row)):
            return
        moved = not rest_written and self._moved(row)
        if param.device != self.rest(row).device:  # the model moved: its FP32 side follows
            self.follow(row)
        if moved:
            self.mark_row(row)
            return
        with torch.no_grad():
            if param.dtype not in LOW_PRECISION:
                pass  # replaced by FP32 data: nothing to keep
            elif param.shape != self.rest(row).shape:
                self.set_rest(row, self.form.empty_rest(param))
            elif rest_written:  # the FP32 side wins
                param.copy_(self.rest(row))
            elif self.form.name == FP32:  # the elements the write changed
                self.rest(row).copy_(self.value(row))
            else:  # a remainder or correction of another weight: the weight is the value
                self.rest(row).zero_()
        self.mark_row(row)

    def follow(self, row):
        """The row's FP32 side (its rest) onto its parameter's device, where a move of the model
        took the parameter (the owners move what else they keep of it: its optimizer state)."""
        self.set_rest(row, self.rest(row).to(self.params[row].device))

    def refresh(self, rows=None):
        """amp wrote the rows (all, or `rows`): the values lent out take them."""
        if self.lent.keys:
            self.lent.refresh(self.index, self.value, self.params, rows)

    def written_by_amp(self, rests=None):
        """A step wrote every row: its own write, marked (`rests` as for mark); lent values
        refreshed."""
        self.mark(rests)
        self.refresh()


class FrozenRows(Rows):
    """The rows of the cast parameters no optimizer steps (one table per initialize), and the rows
    a copy of a model carries for its parameters."""

    def add(self, param, rest):
        """A row for `param` whose rest is `rest` (they agree: amp has just written both)."""
        self.rest_list.append(rest)
        row = self._add(param)
        self.mark_row(row)
        return row

    def pop(self, param):
        """Remove `param`'s row; returns its rest (it joins an optimizer)."""
        row = self.index[id(param)]
        rest = self.rest_list.pop(row)
        for column in (self.params, *self.marks, self.rest_versions, self.rests_seen):
            del column[row]
        self._reindex()
        return rest

    # -- copies of a model (deepcopy, pickle) ---------------------------------------------------

    def __getstate__(self):
        # A copy's tensors count versions anew: a write not yet taken in is taken in the copy
        # from whether each side was written, which the copy keeps.
        rows = range(len(self.params))
        state = dict(form=self.form, params=self.params, rests=self.rest_list)
        state["written"] = [self.param_written(r) for r in rows]
        state["rest_written"] = [self._rest_written(r) for r in rows]
        return state

    def __setstate__(self, state):
        Rows.__init__(self, state["form"])
        self.rest_list = state["rests"]
        self.params = state["params"]
        self._reindex()
        self.mark()
        for row, (param, rest) in enumerate(zip(state["written"], state["rest_written"])):
            if param:
                self.marks[0][row] = None  # its version: written
            if rest:
                self.rest_versions[row] = None

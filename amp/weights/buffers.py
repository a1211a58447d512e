"""The FP32 values of the low-precision tensors a model's modules hold by name: its cast buffers
(kept from initialize on) and, at O3, the parameters a state dict handed out (kept until the next
forward has taken what was written into them).

Pairs (`Pairs`), found by place (a module and a name) rather than by identity: a module may
replace a buffer by assignment, and the new tensor is then the value, in a new FP32 object (the
old one may be held elsewhere). A buffer is compared at every sync: batch norm updates its
running statistics in place without bumping their version counter.

A buffer whose values the low precision holds exactly (a causal mask of 0 and -inf, integer
positions) keeps its original FP32 object with the memory released (`release_exact`) until a
state dict or a load needs the FP32 values apart (`full`), so that O2 holds it once.
"""

import operator
import sys

import torch

from ..casting.casts import LOW_PRECISION
from .columns import address

__all__ = ["Pairs", "BufferTable", "held_exactly"]

_VERSION = operator.attrgetter("_version")
_SHAPE = operator.attrgetter("shape")
_DATA = address  # where the low side's data lies (columns.ADDRESS)


class Pairs:
    """Pairs of a low-precision tensor as the model holds it (`models`) and its FP32 value, the
    one that wins (`masters`), with the marks of amp's last write: both sides' version counters,
    the low side's address and shape. A write into the FP32 value reaches the low-precision
    tensor; a write into the low-precision tensor is taken into the FP32 value where it changed
    the low-precision value; the FP32 side wins a conflict."""

    def __init__(self):
        self.models, self.masters = [], []
        self.low_versions, self.low_datas, self.master_versions, self.shapes = [], [], [], []

    def _append(self, model, master):
        """A new row, not marked yet; returns its index."""
        self.models.append(model)
        self.masters.append(master)
        self.low_versions.append(None)
        self.low_datas.append(None)
        self.master_versions.append(None)
        self.shapes.append(None)
        return len(self.models) - 1

    def mark(self):
        """amp (or a load) has just made every row's two sides agree."""
        models = self.models
        self.low_versions = list(map(_VERSION, models))
        self.low_datas = list(map(_DATA, models))
        self.master_versions = list(map(_VERSION, self.masters))
        self.shapes = list(map(_SHAPE, models))

    def mark_row(self, row):
        model, master = self.models[row], self.masters[row]
        self.low_versions[row] = model._version
        self.low_datas[row] = _DATA(model)
        self.master_versions[row] = master._version
        self.shapes[row] = model.shape

    def unchanged(self):
        """True when no side of any row was written since its mark (C-level compares)."""
        models = self.models
        return (
            list(map(_VERSION, models)) == self.low_versions
            and list(map(_DATA, models)) == self.low_datas
            and list(map(_VERSION, self.masters)) == self.master_versions
            and list(map(_SHAPE, models)) == self.shapes
        )

    def masters_unwritten(self):
        """True when no FP32 side was written since its mark (a C-level compare)."""
        return list(map(_VERSION, self.masters)) == self.master_versions

    def push_written_masters(self):
        """Copy every FP32 value written since its mark into its low-precision tensor (a state
        dict handed it out and the model is about to compute)."""
        if self.models and not self.masters_unwritten():
            for row in range(len(self.models)):
                if self.masters[row]._version != self.master_versions[row]:
                    self.sync_row(row)

    def written(self, row):
        model = self.models[row]
        return (
            model._version != self.low_versions[row]
            or _DATA(model) != self.low_datas[row]
            or model.shape != self.shapes[row]
            or self.masters[row]._version != self.master_versions[row]
        )

    def sync_row(self, row):
        """Copy a write made since the row's mark across; the FP32 side wins a conflict."""
        if self.written(row):
            self._sync(row, self.models[row], compare=False)

    def _sync(self, row, model, compare):
        """The FP32-wins rule for `model`, the row's low-precision tensor now (a new one when the
        model replaced it): a new shape is the value; a new tensor (the model moved, an
        assignment) keeps the FP32 value where it holds its rounding; else a written FP32 side is
        copied into it; else (or `compare`: always) its changed elements into the FP32 side."""
        master = self.masters[row]
        if model.dtype in LOW_PRECISION:  # else replaced by FP32 data: nothing to keep
            with torch.no_grad():
                if model.shape != master.shape:
                    self._replace(row, model.detach().float())
                elif model is not self.models[row]:  # a new tensor (model.cpu(), an assignment)
                    moved = master.to(model.device)  # kept where the new one holds its rounding
                    changed = model != moved.to(model.dtype)
                    self._replace(row, torch.where(changed, model.detach().float(), moved))
                elif master._version != self.master_versions[row]:
                    model.copy_(master)
                elif compare or model._version != self.low_versions[row] or (
                    _DATA(model) != self.low_datas[row]
                ):
                    changed = model != master.to(model.dtype)
                    master.copy_(torch.where(changed, model.float(), master))
        self.models[row] = model
        self.mark_row(row)

    def _replace(self, row, value):
        """The row's FP32 side becomes `value` (the master keeps its identity: the optimizer
        holds it)."""
        self.masters[row].data = value

    # -- copies of the model (deepcopy, pickle) ------------------------------------------------

    def __getstate__(self):
        # A copy's tensors count versions anew: it keeps, for each row, whether each side was
        # written since its mark, so that a write not yet taken over is taken over in the copy
        # as in the original.
        state = self.__dict__.copy()
        models = self.models
        state["low_versions"] = [
            version == model._version and data == _DATA(model)
            for model, version, data in zip(models, self.low_versions, self.low_datas)
        ]
        state["master_versions"] = [
            version == master._version
            for master, version in zip(self.masters, self.master_versions)
        ]
        del state["low_datas"]
        return state

    def __setstate__(self, state):
        clean_low, clean_master = state.pop("low_versions"), state.pop("master_versions")
        self.__dict__.update(state)
        self.low_versions = [
            model._version if clean else None for model, clean in zip(self.models, clean_low)
        ]
        self.low_datas = [
            _DATA(model) if clean else None for model, clean in zip(self.models, clean_low)
        ]
        self.master_versions = [
            master._version if clean else None for master, clean in zip(self.masters, clean_master)
        ]




class BufferTable(Pairs):
    """The rows of one model's tensors of one kind: `slot` is the modules' dict they sit in
    ("_buffers", or "_parameters" for O3's)."""

    def __init__(self, slot="_buffers"):
        super().__init__()
        self.slot = slot
        self.places = []  # (module, name) of each row
        self.exact = []  # the low precision holds the row's values: its FP32 side is released
        self.rows = {}  # module -> {name: row}

    def add(self, module, name, fp32, exact=False):
        """A row for the tensor `module` holds under `name`, whose FP32 value is `fp32` (`exact`:
        the low precision holds it bit for bit)."""
        row = self._append(getattr(module, self.slot)[name], fp32)
        self.rows.setdefault(module, {})[name] = row
        self.places.append((module, name))
        self.exact.append(exact)
        self.mark_row(row)
        return row

    def current(self, row):
        """The tensor in the row's place now (None if it was removed)."""
        module, name = self.places[row]
        return getattr(module, self.slot).get(name)

    def mark_places(self):
        """The tensors in the rows' places (amp cast them, or a load wrote them) agree with their
        FP32 values: amp's own write."""
        for row in range(len(self.models)):
            self.mark_place(row)

    def mark_place(self, row):
        low = self.current(row)
        if low is not None:
            self.models[row] = low
            self.mark_row(row)

    def sync(self):
        """Every write since the marks taken across (the FP32 side wins a conflict)."""
        for row in range(len(self.models)):
            self.sync_row(row)

    def sync_row(self, row):
        low = self.current(row)
        if low is None or low.dtype not in LOW_PRECISION:
            return  # removed, or replaced by an FP32 tensor: nothing to keep
        if self.exact[row]:  # the FP32 values are the low-precision tensor's, whatever was written
            if low is not self.models[row]:  # a new tensor was assigned: it is the value
                self.masters[row], self.exact[row] = low.detach().float(), False
            self.models[row] = low
            self.mark_row(row)
            return
        self._sync(row, low, compare=True)

    def _replace(self, row, value):
        self.masters[row] = value  # a new object: the old one may be held elsewhere

    def full(self, row):
        """The row's FP32 tensor, its values made from the low-precision tensor if it held them
        (in the original object: its identity is kept)."""
        if self.exact[row]:
            low = self.current(row)
            if low is not None:
                self.masters[row].data = low.detach().float()
            self.exact[row] = False
            self.mark_place(row)
        return self.masters[row]

    def release_exact(self):
        """Release the FP32 originals of the exact rows where nothing else holds them or their
        memory (a module kept FP32, another model, an alias, a view would see them empty) and
        torch owns that memory (not numpy's, shared or from DLPack: released, it would stop
        being shared); the others become ordinary rows."""
        masters = self.masters
        for row in range(len(masters)):
            if not self.exact[row]:
                continue
            alone = _ALONE is not None and _references(masters, row) == _ALONE
            storage = masters[row].untyped_storage()
            owned = storage.resizable() and not storage.is_shared()
            del storage  # it would count as a use of the storage
            if owned and alone and masters[row]._base is None:
                masters[row].data = torch.empty(0, device=masters[row].device)
            else:
                self.exact[row] = False


_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)  # None: nothing is released


def _references(column, row):
    """(Python references, uses of its storage) of `column[row]`, counted from here."""
    if _USE_COUNT is None:
        return None
    tensor = column[row]
    return sys.getrefcount(tensor), _USE_COUNT(tensor.untyped_storage()._cdata)


# What _references counts for a tensor that its list alone holds (measured, not assumed: how many
# references the interpreter's stack adds differs between Python versions).
_ALONE = _references([torch.zeros(1)], 0)


def held_exactly(fp32, low):
    """Whether `low`, the FP32 tensor `fp32` cast to low precision, holds every value of it bit
    for bit (False for a tensor without values to compare: meta, fake, or a subclass)."""
    if type(fp32) is not torch.Tensor or fp32.device.type == "meta":
        return False
    bits = torch.int32
    return torch.equal(low.float().view(bits), fp32.detach().view(bits))

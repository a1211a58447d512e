"""The table of one optimizer: the parameters it steps, where each sits in its model, and at O2
their FP32 masters with the marks amp took after its own last write into them; and `Rows`, the
marks and the sync of every pair of a low-precision tensor and its FP32 value amp keeps (the
masters here, the buffers' FP32 values in buffers.py).

Parallel lists keyed by parameter identity, read over whole lists at C level (`map`), so that a
step costs a constant number of Python calls however many parameters the model has:

- every row: a parameter it steps as the model holds it (`params`), the module `_parameters` dict
  and the name it sits under (`dicts`, `names`), its qualified name for messages; and the
  optimizer's parameters that are no masters (`plain_params`, by its param groups);
- the master rows (O2, the parameters amp cast): the low-precision parameter (`models`), its FP32
  master (`masters`, what the optimizer steps) and the marks: both sides' version counters, the
  parameter's data pointer and shape (`param.data = t` keeps the version counter: the storage
  tells) as they were after amp's last write.

A write from outside amp (DataParallel's broadcast, a `param.copy_`, a pruning mask, new data by
`param.data = ...`) changes a mark: it is taken into the master where it changed the
low-precision value, so a write that changes nothing leaves the FP32 value alone. A write into the
master (through `model.state_dict()`, which returns it) reaches the parameter; the FP32 side wins
a conflict. Writes through `param.data` in place bump no version counter: they are not seen.

amp keeps one more table per `amp.initialize` for the cast parameters no optimizer steps (frozen):
master rows whose FP32 copy nothing steps, so that their exact FP32 values come back too. Every
FP32 copy of a cast parameter is in one table of `amp_state.tables` (`find` says which).
"""

import operator

import torch

from .. import distributed, kernels
from ..casting.casts import LOW_PRECISION
from .columns import NONES, consume, repeat
from .lent import LentValues

__all__ = ["Rows", "ParamTable", "find", "hollow"]

_VERSION = operator.attrgetter("_version")
_SHAPE = operator.attrgetter("shape")
_DATA = torch.Tensor.data_ptr
_PARAMS = operator.itemgetter("params")


def hollow(shape, device):
    """A float32 tensor of `shape` holding no values: one NaN seen at every index (a read of a
    compact row's master shows as NaN, never as a plausible weight)."""
    return torch.full((), float("nan"), device=device).expand(shape)


def find(param, tables):
    """(table, row) of `param`'s FP32 copy among `tables` (this initialize's: amp_state.tables;
    a copy of a model holds copies of them), or (None, None)."""
    for table in tables:
        row = table.index.get(id(param))
        if row is not None:
            return table, row
    return None, None


class Rows:
    """Pairs of a low-precision tensor as the model holds it (`models`) and its FP32 value, the
    one that wins (`masters`: the optimizer's master for a parameter it steps), with the marks of
    amp's last write: both sides' version counters, the low side's data pointer and shape."""

    lent = ()  # FP32 values a state dict handed out for rows that hold none (ParamTable's)

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

    def take_outside_writes(self):
        """Bring every row in step after writes from outside amp (see the module doc). The usual
        answer, nothing written, costs the list compares of `unchanged`. Writes into FP32
        values a state dict lent out come first (that side wins)."""
        if self.lent:
            self.lent.push_writes(self)
        if self.models and not self.unchanged():
            for row in range(len(self.models)):
                self.sync_row(row)

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
        model replaced it): a new shape or tensor is the value; else a written FP32 side is
        copied into it; else (or `compare`: always) its changed elements into the FP32 side."""
        master = self.masters[row]
        if model.dtype in LOW_PRECISION:  # else replaced by FP32 data: nothing to keep
            with torch.no_grad():
                if model is not self.models[row] or model.shape != master.shape:
                    self._replace(row, model.detach().float())
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


class ParamTable(Rows):
    """The rows of one optimizer (or of the frozen parameters of one initialize)."""

    def __init__(self, frozen=False, compact=False):
        super().__init__()
        self.frozen = frozen  # the cast parameters no optimizer steps
        # master_weights="compact": each master is hollow (masters.hollow), the row's value its
        # bf16 weight and int8 correction (kernels.compact_encode's), kept here
        self.compact = compact
        self.corrections = []
        self.lent = LentValues()  # compact rows' FP32 values a state dict handed out
        self.params, self.dicts, self.names, self.qualified = [], [], [], []
        self.qualified_of = {}  # id(parameter as the model holds it) -> its qualified name
        self.index = {}  # id(model parameter) -> its master row
        self.master_index = {}  # id(master) -> its row
        self.sharded = False  # some parameters are DTensors (FSDP2): unscale their local shards
        self._plain = (None, [])  # (the param groups' lengths, the plain parameters)

    # -- where the parameters sit --------------------------------------------------------------

    def anchor(self, params, places):
        """Remember where each of `params` sits: `places` maps id(param) to (module._parameters,
        name, qualified name, ...). Parameters in no model are not watched."""
        found = [(param, places[id(param)]) for param in params if id(param) in places]
        self.params = [param for param, _ in found]
        self.dicts = [place[0] for _, place in found]
        self.names = [place[1] for _, place in found]
        self.qualified = [place[2] for _, place in found]
        self.qualified_of = dict(zip(map(id, self.params), self.qualified))

    def in_place(self):
        """True when every parameter still sits where it was anchored (C-level lookups)."""
        return all(map(operator.is_, map(dict.get, self.dicts, self.names), self.params))

    def name_of(self, param, groups):
        """The qualified name of a parameter the optimizer steps (a master: its model
        parameter's), or its place in `groups` for one in no model."""
        row = self.master_index.get(id(param))
        held = param if row is None else self.models[row]
        name = self.qualified_of.get(id(held))
        if name is not None:
            return name
        for group_index, group in enumerate(groups):
            for param_index, candidate in enumerate(group["params"]):
                if candidate is param or candidate is held:
                    return f"param_groups[{group_index}]['params'][{param_index}]"
        return None

    # -- the optimizer's parameters ------------------------------------------------------------

    def plain_params(self, groups):
        """The parameters in `groups` that are not FP32 masters (kept while the groups' lengths
        stay)."""
        signature = tuple(map(len, map(_PARAMS, groups)))
        cached_signature, params = self._plain
        if signature != cached_signature:
            masters = self.master_index
            params = [p for group in groups for p in group["params"] if id(p) not in masters]
            self._plain = (signature, params)
            self.sharded = distributed.has_dtensors(params)  # FSDP2: unscale the local shards
        return params  # shared: callers do not modify it

    def grad_holders(self, groups):
        """Every tensor whose `.grad` a backward of the optimizer's loss writes."""
        plain = self.plain_params(groups)
        return plain + self.models if self.models else plain

    def forget_groups(self):
        """The param groups changed (a load, a new group): plain_params looks again."""
        self._plain = (None, [])

    def models_of(self, params):
        """Each of `params`' model parameter, None for one that is no master."""
        models, index = self.models, self.master_index
        return [None if row is None else models[row] for row in map(index.get, map(id, params))]

    # -- master rows -------------------------------------------------------------------------

    def add_master(self, model_param, master, correction=None):
        """A master row: amp has just made `master` from `model_param` (they agree; a compact
        row's value is `model_param` with `correction`)."""
        row = self._append(model_param, master)
        self.index[id(model_param)] = self.master_index[id(master)] = row
        if self.compact:
            self.corrections.append(correction)

    def pop_master(self, model_param):
        """Remove the master row of `model_param`; returns (its master, its correction)."""
        row = self.index.pop(id(model_param))
        master = self.masters[row]
        correction = self.corrections.pop(row) if self.compact else None
        for column in (
            self.models,
            self.masters,
            self.low_versions,
            self.low_datas,
            self.master_versions,
            self.shapes,
        ):
            del column[row]
        self._index()
        return master, correction

    def clear_masters(self):
        Rows.__init__(self)
        self.corrections = []
        self._index()

    # -- a row's FP32 value ----------------------------------------------------------------

    def value(self, row):
        """The row's FP32 value: its master, or a compact row's decoded (a new tensor)."""
        if not self.compact:
            return self.masters[row]
        return kernels.compact_decode(self.models[row].detach(), self.corrections[row])

    def set_value(self, row, fp32):
        """Make `fp32` the row's value (a load; a write into a state dict's FP32 tensor), and the
        model's weight its rounding: amp's own write."""
        with torch.no_grad():
            if self.compact:
                low, correction = kernels.compact_encode(fp32.detach().float())
                self.models[row].copy_(low)
                self.corrections[row].copy_(correction)
            else:
                self.masters[row].copy_(fp32)
                self.models[row].copy_(self.masters[row])
        self.mark_row(row)

    def sync_row(self, row):
        """Copy a write made since the row's mark across; the FP32 side wins a conflict. A
        compact row's value is the weight a write from outside left (its correction goes)."""
        if not self.compact:
            super().sync_row(row)
            return
        if not self.written(row):
            return
        model = self.models[row]
        if model.shape != self.shapes[row]:  # new data of another shape: the value
            self.masters[row].data = hollow(model.shape, model.device)
            self.corrections[row] = torch.zeros(model.shape, dtype=torch.int8, device=model.device)
        else:
            self.corrections[row].zero_()
        self.mark_row(row)

    def _index(self):
        self.index = {id(param): row for row, param in enumerate(self.models)}
        self.master_index = {id(master): row for row, master in enumerate(self.masters)}

    def write_models(self, drop_grads=True):
        """After the optimizer stepped the masters: the model takes their values (rounded to
        nearest even), amp marks that write as its own, and the master gradients go (no
        model.zero_grad() reaches them; apex did the same) unless not `drop_grads`."""
        # torch.no_grad() inlined: its context manager's calls would run at every step.
        grad_enabled = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        try:
            kernels.copy_(self.masters, self.models, check=False)
        finally:
            torch._C._set_grad_enabled(grad_enabled)
        self.models_written(drop_grads)

    def models_written(self, drop_grads=True):
        """A step wrote the masters into the model (the fused step does it in its pass): amp
        marks that write as its own, and the master gradients go unless not `drop_grads`."""
        self.mark()
        if self.lent:
            self.lent.refresh(self)
        if drop_grads:
            consume(map(setattr, self.masters, repeat("grad"), NONES))

    def __getstate__(self):
        state = super().__getstate__()
        del state["index"], state["master_index"], state["qualified_of"]
        state["lent"] = LentValues()  # keyed by the ids of this process's parameters
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        self._index()
        self.qualified_of = dict(zip(map(id, self.params), self.qualified))

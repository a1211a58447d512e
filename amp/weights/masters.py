"""O2 master weights: the FP32 copies an optimizer steps in place of the model's low-precision
parameters, made, stepped around and given back through the optimizer's table (table.py)."""

import itertools
import operator

import torch

from .. import kernels
from .._state import amp_state
from .fused_step import FusedStep
from .grad_stash import add_to_master_grad
from .columns import GRAD, NONES, set_each
from .table import ParamTable

__all__ = [
    "new_master",
    "match_state_to_params",
    "frozen_table",
    "master_row",
    "master_for",
    "Deferred",
    "Masters",
]

_TENSOR_GRAD = torch.Tensor.grad  # the C-level attribute, under a deferring master's property


def new_master(param):
    """An FP32 copy of `param`, as a Parameter so that an optimizer can step it."""
    master = torch.nn.Parameter(param.detach().clone().float(), requires_grad=param.requires_grad)
    if param.grad is not None:
        master.grad = param.grad.detach().float()
    return master


def match_state_to_params(optimizer):
    """Cast floating optimizer state to its parameter's dtype, as torch's load_state_dict does."""
    for param, state in optimizer.state.items():
        for key, value in state.items():
            if (
                key != "step"
                and isinstance(value, torch.Tensor)
                and value.is_floating_point()
                and value.dtype != param.dtype
            ):
                state[key] = value.to(param.dtype)


def frozen_table():
    """The table of this initialize's cast parameters that no optimizer steps (made once)."""
    tables = amp_state.tables
    if not tables or not tables[-1].frozen:
        tables.append(ParamTable(frozen=True))
    return tables[-1]


def master_row(param):
    """(table, row) of `param`'s FP32 copy in this initialize's tables, or (None, None)."""
    for table in amp_state.tables:
        row = table.index.get(id(param))
        if row is not None:
            return table, row
    return None, None


def master_for(param):
    """The master a cast parameter gets when it joins an optimizer: its FP32 copy as a frozen
    parameter (its exact FP32 value, any write not yet taken over included), else a new one;
    None when an optimizer steps it already. Changes nothing."""
    table, row = master_row(param)
    if table is None:
        return new_master(param)
    if not table.frozen:
        return None
    table.sync_row(row)
    return table.masters[row]


def _deferring_class(masters):
    """The class a master wears while its gradient is deferred (one per optimizer): reading,
    writing or deleting its `.grad` (clip_grad_norm_ over optimizer.param_groups, a gradient
    log, a list of amp.master_params kept from earlier) makes the deferred gradients FP32
    first, so that it sees and changes what the general path's step would use."""

    def made(param):
        if masters.deferred is not None:
            masters.materialize()
        return param

    grad = property(
        lambda param: _TENSOR_GRAD.__get__(made(param)),
        lambda param, value: _TENSOR_GRAD.__set__(made(param), value),
        lambda param: _TENSOR_GRAD.__delete__(made(param)),
        doc=_TENSOR_GRAD.__doc__,
    )
    return type(
        "DeferredGradParameter",
        (torch.nn.Parameter,),
        {"grad": grad, "__deepcopy__": _plain_deepcopy},
    )


def _plain_deepcopy(param, memo):
    """A copy of a master made while its gradient is deferred is a plain Parameter (the class
    belongs to this optimizer's deferral, not to the copy)."""
    copied = torch.nn.Parameter.__deepcopy__(param, memo)
    copied.__class__ = torch.nn.Parameter
    return copied


class Deferred:
    """The masters' gradients kept in low precision until the step (with the CuPy kernels): the
    fused step unscales them as it reads them; the FP32 master gradients are made only where
    something reads `.grad` (the masters wear a deferring class until then: materialize)."""

    __slots__ = ("models", "masters", "grads", "inv_scale", "flags", "by_master")

    def __init__(self, models, masters, grads, inv_scale, flags):
        self.models, self.masters, self.grads = models, masters, grads
        self.inv_scale = inv_scale  # 1/scale the gradients were scaled with
        self.flags = flags  # kernels.check_'s: which of them held inf/NaN, asked on a skip
        self.by_master = dict(zip(map(id, masters), grads))

    def grads_of(self, masters):
        return list(map(self.by_master.get, map(id, masters)))


class Masters:
    """The O2 half of an optimizer's record (none at O1 and O3): its master rows, stepped around."""

    def __init__(self, record):
        self.record = record
        self.table = record.table
        self.deferred = None  # a Deferred between scale_loss's exit and the step
        self.deferring = _deferring_class(self)
        self.fused = FusedStep(record)

    def defer(self, models, masters, grads, inv_scale, found_inf):
        """scale_loss's exit with the CuPy kernels: check the gradients (found_inf) and keep
        them for the fused step with the inverse scale they were scaled with (no update writes
        it: scaling/checks.py)."""
        flags = kernels.check_(grads, found_inf)
        self.deferred = Deferred(models, masters, grads, inv_scale, flags)
        set_each(masters, "__class__", itertools.repeat(self.deferring))

    def forget_deferred(self):
        """The deferred gradients go (a step used or skipped them, zero_grad dropped them): the
        masters are plain Parameters again."""
        deferred, self.deferred = self.deferred, None
        if deferred is not None:
            set_each(deferred.masters, "__class__", itertools.repeat(torch.nn.Parameter))
        return deferred

    def materialize(self):
        """The deferred gradients as FP32 master gradients (the general path, a read of a
        master's `.grad`, a next scale_loss block): unscaled as scale_loss's exit would have
        made them."""
        deferred = self.forget_deferred()
        fresh = list(map(torch.empty_like, deferred.masters))
        scratch = torch.zeros((), dtype=torch.float32, device=deferred.inv_scale.device)
        kernels.unscale_to_(deferred.grads, fresh, deferred.inv_scale, scratch, check=False)
        set_each(deferred.masters, "grad", fresh)

    def nonfinite_models(self):
        """The model parameters whose deferred gradients held inf/NaN (reads the device)."""
        deferred = self.deferred
        return [deferred.models[i] for i in deferred.flags.tensors()]

    def take_outside_writes(self):
        """One outside-write check (at step(), state_dict() and amp.master_params())."""
        self.table.take_outside_writes()

    def before_step(self):
        """Before the optimizer steps the masters: a write to the model since the last step (a
        pruning mask applied after backward) is kept, and gradients of model parameters made
        by a backward outside scale_loss join the master gradients unscaled (apex dropped them;
        without this O2 would not step)."""
        table = self.table
        table.take_outside_writes()
        if all(map(operator.is_, map(GRAD, table.models), NONES)):
            return  # the usual case: scale_loss took them
        if self.deferred is not None:
            self.materialize()
        for model_param, master in zip(table.models, table.masters):
            grad = model_param.grad
            if grad is not None:
                add_to_master_grad(master, grad.float())
                model_param.grad = None

    def after_fused_step(self):
        """The fused step wrote the masters into the model: amp marks that write as its own, and
        the gradients go (as after_step)."""
        self.table.mark()
        self.forget_deferred()
        set_each(self.table.masters, "grad", NONES)

    def after_step(self):
        """After the optimizer stepped the masters: the model takes their values (rounded to
        nearest even), amp marks that write as its own, and the master gradients go (no
        model.zero_grad() reaches them; apex did the same)."""
        table = self.table
        # torch.no_grad() inlined: its context manager's calls would run at every step.
        grad_enabled = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        try:
            kernels.copy_(table.masters, table.models, check=False)
        finally:
            torch._C._set_grad_enabled(grad_enabled)
        table.mark()
        set_each(table.masters, "grad", NONES)

    def drop_grads(self):
        self.forget_deferred()
        set_each(self.table.masters, "grad", NONES)

    def master_indices(self):
        """{index in the optimizer's state dict: (model param, master)} for every master."""
        table = self.table
        of_master = {id(master): row for row, master in enumerate(table.masters)}
        found = {}
        groups = self.record.optimizer.param_groups
        for index, param in enumerate(p for group in groups for p in group["params"]):
            row = of_master.get(id(param))
            if row is not None:
                found[index] = (table.models[row], param)
        return found

    def add(self, param, master):
        """A cast parameter joins this optimizer (add_param_group) with `master`
        (master_for's)."""
        table, row = master_row(param)
        if table is not None:  # its frozen FP32 copy becomes its master
            table.pop_master(param)
        self.table.add_master(param, master)
        self.table.mark_row(len(self.table.models) - 1)

    def give_back(self):
        """Undo of master creation: the optimizer steps the model's own parameters again."""
        if self.deferred is not None:  # an FP32 model parameter takes its master's gradient
            self.materialize()
        table = self.table
        model_of = dict(zip(map(id, table.masters), table.models))
        optimizer = self.record.optimizer
        for group in optimizer.param_groups:
            group["params"] = [model_of.get(id(p), p) for p in group["params"]]
        state = optimizer.state
        for model_param, master in zip(table.models, table.masters):
            if master in state:
                state[model_param] = state.pop(master)
            if model_param.dtype is torch.float32:
                model_param.grad = master.grad
        table.clear_masters()
        self.record.forget_param_groups()

"""O2 master weights: the FP32 copies an optimizer steps in place of the model's low-precision
parameters, kept in step with the model both ways."""

import itertools
import operator

import torch

from .. import distributed, kernels
from .._state import amp_state
from .grad_stash import add_to_master_grad, set_each
from .shadows import ParamMarks, sync_params

_grad = operator.attrgetter("grad")
_PARAMS = operator.itemgetter("params")
_NONES = itertools.repeat(None)


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


class MasterWeights:
    """The master-weight half of an OptimizerRecord: which optimizer parameters are FP32 masters
    of which model parameters."""

    def __init__(self, optimizer):
        self.optimizer = optimizer
        self.master_pairs = []  # (model parameter, FP32 master) for O2
        self.models, self.masters = [], []  # the same pairs as two parallel lists
        self._shadows = None  # the model parameters' shadows, once all are known
        self._marks = ParamMarks()  # their marks since amp last wrote the model (shadows.py)
        self.chunk_plan = None  # how scale_loss slices all master gradients (grad_stash.py)
        self._plain_cache = (None, [])
        self.sharded = False  # some parameters are DTensors (FSDP2): unscale their local shards

    def add_master(self, param, master):
        self.master_pairs.append((param, master))
        self.models.append(param)
        self.masters.append(master)
        self._shadows = None
        self.chunk_plan = None
        amp_state.masters[id(param)] = master

    def shadows(self):
        """The shadows of the model parameters (shadows.py), in pair order.

        Looked up once: amp.initialize registers them after the masters are made.
        """
        shadows = self._shadows
        if shadows is None:
            shadows = [amp_state.shadows.get(id(param)) for param in self.models]
            if None in shadows:  # not all registered yet (or a model not cast): look up again
                return [shadow for shadow in shadows if shadow is not None]
            self._shadows = shadows
        return shadows

    def remember_versions(self):
        """amp (or a state-dict load) just wrote the model parameters from their masters."""
        if self.models:
            shadows = self._shadows or self.shadows()
            if shadows is self._shadows:  # every parameter has its shadow: one batch
                self._marks.mark(shadows, self.models)
            else:  # some have none (a model not passed to initialize)
                for shadow in shadows:
                    shadow.mark()

    def follow_external_writes(self):
        """Bring masters and model parameters in step after writes from outside amp.

        DataParallel's broadcast or a `param.copy_(...)` change the model after the masters were
        made; a write through `model.state_dict()` changes the master. See shadows.Shadow.sync.
        The usual answer, nothing written since amp's own write at the last step, comes from the
        batched marks.
        """
        if self.models:
            shadows = self._shadows or self.shadows()
            if not self._marks.unchanged(shadows):
                self._marks.write()
                sync_params(shadows)

    def before_step(self):
        """O2, before the optimizer steps the masters: a write to the model since the last step
        (a pruning mask applied after backward) is kept, and gradients of model parameters made
        by a backward outside scale_loss join the master gradients unscaled (apex dropped them;
        without this O2 would not step)."""
        shadows = self._shadows or self.shadows()  # follow_external_writes, inlined: every step
        if not self._marks.unchanged(shadows):
            self._marks.write()
            sync_params(shadows)
        if all(map(operator.is_, map(_grad, self.models), _NONES)):
            return  # the usual case: scale_loss took them
        for model_param, master in zip(self.models, self.masters):
            grad = model_param.grad
            if grad is not None:
                add_to_master_grad(master, grad.float())
                model_param.grad = None

    def after_step(self):
        """O2, after the optimizer stepped the masters: the model takes their values (rounded to
        nearest even), amp marks that write as its own, and the master gradients go (no
        model.zero_grad() reaches them; apex did the same)."""
        # torch.no_grad(), without its eight Python calls per step.
        grad_enabled = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        try:
            kernels.copy_(self.masters, self.models, check=False)
        finally:
            torch._C._set_grad_enabled(grad_enabled)
        shadows = self._shadows
        if shadows is not None:  # every parameter has its shadow: one batch (remember_versions)
            self._marks.mark(shadows, self.models)
        else:
            self.remember_versions()
        set_each(self.masters, "grad", _NONES)

    def grad_holders(self):
        """Every tensor whose `.grad` a backward of this optimizer's loss writes."""
        if not self.master_pairs:
            return self.plain_params()
        return self.plain_params() + self.models

    def plain_params(self):
        """The optimizer's parameters that are not FP32 masters (cached by group shape)."""
        groups = self.optimizer.param_groups
        signature = tuple(map(len, map(_PARAMS, groups)))
        cached_signature, params = self._plain_cache
        if signature != cached_signature:
            masters = {id(master) for _, master in self.master_pairs}
            params = [p for group in groups for p in group["params"] if id(p) not in masters]
            self._plain_cache = (signature, params)
            self.sharded = distributed.has_dtensors(params)  # FSDP2: unscale the local shards
        return params  # shared: callers do not modify it

    def forget_param_groups(self):
        self._plain_cache = (None, [])

    def master_indices(self):
        """{index in the optimizer's state dict: (model param, master)} for every master."""
        pairs = {id(master): (model_param, master) for model_param, master in self.master_pairs}
        found = {}
        params = (p for group in self.optimizer.param_groups for p in group["params"])
        for index, param in enumerate(params):
            if id(param) in pairs:
                found[index] = pairs[id(param)]
        return found

    def give_back_model_params(self):
        """Undo of master creation: the optimizer steps the model's own parameters again."""
        model_param_of = {id(master): model_param for model_param, master in self.master_pairs}
        for group in self.optimizer.param_groups:
            group["params"] = [model_param_of.get(id(p), p) for p in group["params"]]
        state = self.optimizer.state
        for model_param, master in self.master_pairs:
            if master in state:
                state[model_param] = state.pop(master)
            if model_param.dtype is torch.float32:
                model_param.grad = master.grad
            amp_state.masters.pop(id(model_param), None)
        self.master_pairs, self.models, self.masters = [], [], []
        self._shadows = None
        self.chunk_plan = None
        self.forget_param_groups()

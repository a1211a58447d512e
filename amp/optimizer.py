"""Optimizer instrumentation: FP32 master weights, the gradient stash of scale_loss, skipped
steps, and state dicts that carry the master weights."""

import functools
import operator
import types

import torch

from . import distributed, kernels
from ._state import amp_state, logger
from .autocast import policy_scope
from .diagnostics import OverflowReport

MASTER_PARAMS_KEY = "amp_master_params"
_grad = operator.attrgetter("grad")  # one C-level read per parameter on the per-step paths
_is_sparse = operator.attrgetter("is_sparse")


def _dense_values(param, grad):
    """What to unscale of a gradient: a sparse one's values (FP16 coalesced first, as
    torch.amp.GradScaler does: summing duplicate indices of scaled values could overflow)."""
    if not grad.is_sparse:
        return grad
    if grad.dtype is torch.float16:
        param.grad = grad = grad.coalesce()
    return grad._values()


_PATCHED_METHODS = ("step", "zero_grad", "state_dict", "load_state_dict", "add_param_group")


def check_optimizer(optimizer, index):
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            "amp.initialize: optimizers must be a torch.optim.Optimizer or a list of them; "
            f"optimizers[{index}] is a {type(optimizer).__name__}."
        )
    if "_amp_record" in vars(optimizer):
        raise RuntimeError("A given optimizer should only be passed through amp.initialize once.")


def _new_master(param):
    master = torch.nn.Parameter(param.detach().clone().float(), requires_grad=param.requires_grad)
    if param.grad is not None:
        master.grad = param.grad.detach().float()
    return master


class OptimizerRecord:
    """amp's bookkeeping for one optimizer."""

    def __init__(self, optimizer, names):
        self.optimizer = optimizer
        self.names = names  # id(model parameter) -> qualified name, for overflow reports
        self.master_pairs = []  # (model parameter, FP32 master) for O2
        self.originals = {}  # the optimizer's own methods, called by the patched ones
        self.stash = None  # (param, gradient) kept apart during a scale_loss block
        self.params_have_scaled_gradients = False  # set by scale_loss(delay_unscale=True)
        self.pending = []  # (loss_id, OverflowFlag) to check at the next step
        self._plain_cache = (None, [])
        self.sharded = False  # some parameters are DTensors (FSDP2): unscale their local shards

    # -- parameters ---------------------------------------------------------------------------

    def add_master(self, param, master):
        self.master_pairs.append((param, master))
        amp_state.masters[id(param)] = master
        amp_state.master_versions[id(param)] = param._version

    def remember_versions(self):
        """Note the model parameters' versions after amp (or a state-dict load) wrote them."""
        versions = amp_state.master_versions
        for model_param, _ in self.master_pairs:
            versions[id(model_param)] = model_param._version

    def follow_external_writes(self):
        """Refresh the masters of model parameters written from outside amp.

        DataParallel's initial broadcast, or a `param.copy_(...)` by the user, change the model
        after the masters were made; the master follows (from the low-precision values, which
        are then all there is). Writes through `.data` bypass the version counter.
        """
        versions = amp_state.master_versions
        for model_param, master in self.master_pairs:
            version = model_param._version
            if version != versions.get(id(model_param)):
                with torch.no_grad():
                    master.copy_(model_param)
                versions[id(model_param)] = version

    def plain_params(self):
        """The optimizer's parameters that are not FP32 masters (cached by group shape)."""
        groups = self.optimizer.param_groups
        signature = tuple(len(group["params"]) for group in groups)
        cached_signature, params = self._plain_cache
        if signature != cached_signature:
            masters = {id(master) for _, master in self.master_pairs}
            params = [p for group in groups for p in group["params"] if id(p) not in masters]
            self._plain_cache = (signature, params)
            self.sharded = distributed.has_dtensors(params)
        return params

    def param_name(self, param):
        for model_param, master in self.master_pairs:
            if master is param:
                param = model_param
                break
        name = self.names.get(id(param))
        if name is None:
            for group_index, group in enumerate(self.optimizer.param_groups):
                for param_index, candidate in enumerate(group["params"]):
                    if candidate is param:
                        return f"param_groups[{group_index}]['params'][{param_index}]"
        return name

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
            amp_state.master_versions.pop(id(model_param), None)
        self.master_pairs = []
        self._plain_cache = (None, [])

    # -- backward protocol of scale_loss ------------------------------------------------------

    def prepare_backward(self):
        """Keep existing gradients apart, so this backward writes only its own into `.grad`."""
        self.follow_external_writes()
        params = self.plain_params()
        grads = list(map(_grad, params))
        # No gradient at all is the usual case after zero_grad(set_to_none=True): skip the scan.
        no_grads = grads.count(None) == len(grads)
        self.stash = [] if no_grads else [(p, g) for p, g in zip(params, grads) if g is not None]
        for param, _ in self.stash:
            param.grad = None
        for model_param, master in self.master_pairs:
            grad = model_param.grad
            if grad is not None:
                # Made by a backward outside amp, so unscaled: it joins the master gradient
                # (apex dropped it).
                grad = grad.to_dense() if grad.is_sparse else grad
                if master.grad is None:
                    master.grad = grad.float()
                else:
                    master.grad.add_(grad)
                model_param.grad = None

    def discard_backward(self):
        """The block raised: put the gradients back as they were before it."""
        if self.stash is None:
            return
        for param in self.plain_params():
            param.grad = None
        for param, grad in self.stash:
            param.grad = grad
        for model_param, _ in self.master_pairs:
            model_param.grad = None
        self.stash = None

    def unscale_gradients(self, scaler, flag):
        """Unscale this backward's gradients into place and add back the ones kept apart.

        O2: model gradients become (or are added to) the FP32 master gradients and are dropped.
        Only the new gradients are checked for inf/NaN; `flag` records what is found.
        """
        inv_scale = scaler.inv_scale(flag.tensor.device)
        params = self.plain_params()
        plain = [g for g in map(_grad, params) if g is not None]
        if any(map(_is_sparse, plain)):
            plain = [_dense_values(p, p.grad) for p in params if p.grad is not None]
        if self.sharded:
            plain = distributed.local_tensors(plain)
        kernels.unscale_(plain, inv_scale, flag.tensor)
        if self.stash:
            new, kept = [], []
            for param, grad in self.stash:
                if param.grad is None:
                    param.grad = grad
                elif param.grad.is_sparse or grad.is_sparse:
                    param.grad = param.grad + grad  # new + kept, as autograd accumulates
                else:
                    new.append(param.grad)
                    kept.append(grad)
            if new:
                torch._foreach_add_(new, kept)  # new + kept == kept + new, bit for bit
        self.stash = None
        if self.master_pairs:
            fresh_sources, fresh, add_sources, add_to = [], [], [], []
            for model_param, master in self.master_pairs:
                grad = model_param.grad
                if grad is None:
                    continue
                if grad.is_sparse:
                    grad = grad.to_dense()  # masters keep dense gradients
                if master.grad is None:
                    master.grad = torch.empty_like(master)
                    fresh_sources.append(grad)
                    fresh.append(master.grad)
                else:
                    add_sources.append(grad)
                    add_to.append(master.grad)
                model_param.grad = None
            kernels.unscale_to_(fresh_sources, fresh, inv_scale, flag.tensor, check=False)
            kernels.unscale_add_(add_sources, add_to, inv_scale, flag.tensor, check=False)

    # -- step ---------------------------------------------------------------------------------

    def step(self, *args, **kwargs):
        closure = kwargs.get("closure", args[0] if args else None)
        if closure is not None:
            raise RuntimeError(
                "Currently, Amp does not support closure use with optimizers. Call backward "
                "inside `with amp.scale_loss(loss, optimizer)` and then optimizer.step() with no "
                "closure."
            )
        distributed.check_parameters("optimizer.step()")
        overflowed = self._take_overflows()
        if overflowed:
            self._skip(overflowed)
            return None
        with policy_scope(None):  # optimizer arithmetic is never cast
            result = self.originals["step"]()
        if self.master_pairs:
            models = [model_param for model_param, _ in self.master_pairs]
            masters = [master for _, master in self.master_pairs]
            with torch.no_grad():
                kernels.copy_(masters, models, check=False)
            self.remember_versions()
            for master in masters:
                master.grad = None  # no model.zero_grad() reaches these (apex did the same)
        amp_state.cast_cache.clear()  # the weights changed
        return result

    def _take_overflows(self):
        pending, self.pending = self.pending, []
        return [(loss_id, flag) for loss_id, flag in pending if flag.is_set()]

    def _skip(self, overflowed):
        if getattr(self.originals["step"], "_wrapped_by_lr_sched", False):
            # The user did call step(): an LR scheduler made before amp.initialize must not warn
            # that its step() came first.
            self.optimizer._opt_called = True
        params = self.plain_params() + [master for _, master in self.master_pairs]
        names = distributed.nonfinite_names(params, self.param_name)
        for _, master in self.master_pairs:
            master.grad = None
        for loss_id, flag in overflowed:
            params = names
            previous = amp_state.last_overflow
            if previous is not None and previous.flag is flag:  # another optimizer of that loss
                params = previous.params + tuple(n for n in names if n not in previous.params)
            report = OverflowReport(loss_id, params, amp_state.loss_scalers[loss_id].loss_scale())
            report.flag = flag
            amp_state.last_overflow = report
            message = (
                f"Gradient overflow.  Skipping step, loss scaler {loss_id} reducing loss scale "
                f"to {report.loss_scale}"
            )
            if amp_state.verbosity >= 2:
                message += f"; non-finite gradients in: {', '.join(names) or 'none left'}"
            if amp_state.verbosity >= 1:
                logger.info(message)

    # -- state dict ---------------------------------------------------------------------------

    def master_indices(self):
        """{index in the optimizer's state dict: (model param, master)} for every master."""
        pairs = {id(master): (model_param, master) for model_param, master in self.master_pairs}
        found = {}
        params = (p for group in self.optimizer.param_groups for p in group["params"])
        for index, param in enumerate(params):
            if id(param) in pairs:
                found[index] = pairs[id(param)]
        return found

    def state_dict(self):
        state = self.originals["state_dict"]()
        if self.master_pairs:
            state[MASTER_PARAMS_KEY] = {
                index: master.detach() for index, (_, master) in self.master_indices().items()
            }
        return state

    def load_state_dict(self, state_dict):
        masters = state_dict.get(MASTER_PARAMS_KEY) if hasattr(state_dict, "get") else None
        plan = self._check_masters(masters) if masters is not None else []
        if masters is not None:
            state_dict = {k: v for k, v in state_dict.items() if k != MASTER_PARAMS_KEY}
        self.originals["load_state_dict"](state_dict)
        if plan:
            with torch.no_grad():
                for value, _, master in plan:
                    master.copy_(value)
                kernels.copy_([m for _, _, m in plan], [p for _, p, _ in plan])
            self.remember_versions()
        self._plain_cache = (None, [])
        amp_state.cast_cache.clear()

    def _check_masters(self, masters):
        if not isinstance(masters, dict):
            raise TypeError(
                f"optimizer.load_state_dict: {MASTER_PARAMS_KEY!r} must map parameter indices "
                f"to tensors; got {type(masters).__name__}."
            )
        here = self.master_indices()
        plan = []
        for index, value in masters.items():
            if index not in here:
                raise ValueError(
                    f"optimizer.load_state_dict: the checkpoint has an FP32 master weight for "
                    f"parameter {index!r}, which is not an O2 master here (this optimizer has "
                    f"masters for {sorted(here)}). Load it into an optimizer set up the same way."
                )
            model_param, master = here[index]
            if not isinstance(value, torch.Tensor) or value.shape != master.shape:
                raise ValueError(
                    f"optimizer.load_state_dict: master weight {index} has shape "
                    f"{getattr(value, 'shape', type(value).__name__)}, expected "
                    f"{tuple(master.shape)}."
                )
            if not value.is_floating_point():
                raise ValueError(
                    f"optimizer.load_state_dict: master weight {index} is not floating."
                )
            plan.append((value, model_param, master))
        return plan

    # -- the rest of the optimizer API --------------------------------------------------------

    def zero_grad(self, set_to_none=True):
        self.originals["zero_grad"](set_to_none)
        for model_param, _ in self.master_pairs:
            if set_to_none:
                model_param.grad = None
            elif model_param.grad is not None:
                model_param.grad.detach_()
                model_param.grad.zero_()

    def add_param_group(self, param_group):
        if not isinstance(param_group, dict):
            raise TypeError(f"param group must be a dict; got {type(param_group).__name__}.")
        params = param_group.get("params")
        if isinstance(params, torch.Tensor):
            params = [params]
        elif isinstance(params, set):
            raise TypeError(
                "optimizer parameters need to be organized in ordered collections, but the "
                "ordering of tensors in sets will change between runs. Please use a list instead."
            )
        else:
            params = list(params) if params is not None else params
        new_pairs = []
        if amp_state.properties.master_weights:
            for i, param in enumerate(params or ()):
                if id(param) in amp_state.cast_params and id(param) not in amp_state.masters:
                    master = _new_master(param)
                    new_pairs.append((param, master))
                    params[i] = master
        group = dict(param_group, params=params)
        self.originals["add_param_group"](group)
        for param, master in new_pairs:
            self.add_master(param, master)
        self._plain_cache = (None, [])


def _delegate(name):
    """The method amp puts on an optimizer instance: amp's record does the work, or the
    optimizer's own class once amp.deinitialize() ran (or on a copy, which has no record)."""

    def method(self, *args, **kwargs):
        record = vars(self).get("_amp_record")
        if record is None:
            return getattr(type(self), name)(self, *args, **kwargs)
        return getattr(record, name)(*args, **kwargs)

    method.__name__ = method.__qualname__ = name
    return method


_REPLACEMENTS = {name: _delegate(name) for name in _PATCHED_METHODS}


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


def _replacement(optimizer, name, original):
    """The bound amp method for `optimizer.name`.

    A bound method, so that an LR scheduler made later can wrap it (it reads `step.__func__`);
    but when a scheduler made earlier already wrapped `step`, a function that keeps its mark, so
    that the scheduler does not warn that step was overridden.
    """
    function = _REPLACEMENTS[name]
    if not getattr(original, "_wrapped_by_lr_sched", False):
        return types.MethodType(function, optimizer)

    @functools.wraps(function)
    def step(*args, **kwargs):
        return function(optimizer, *args, **kwargs)

    step._wrapped_by_lr_sched = True
    return step


def instrument(optimizer, params_with_masters, names, ledger):
    """Set `optimizer` up for amp: FP32 masters for `params_with_masters` (ids), patched methods.

    Must run before the model is cast, so the masters are the exact FP32 weights.
    """
    record = OptimizerRecord(optimizer, names)
    # Runs last on undo, after the model has its FP32 weights back.
    ledger.add_undo(
        "optimizer state in the parameters' dtype", lambda: match_state_to_params(optimizer)
    )
    if params_with_masters:
        ledger.add_undo("optimizer steps its model parameters again", record.give_back_model_params)
        for group in optimizer.param_groups:
            for index, param in enumerate(group["params"]):
                if id(param) in params_with_masters:
                    master = _new_master(param)
                    param.grad = None
                    group["params"][index] = master
                    if param in optimizer.state:
                        optimizer.state[master] = optimizer.state.pop(param)
                    record.add_master(param, master)
        distributed.follow_masters(optimizer, record.master_pairs, ledger)
    for name in _PATCHED_METHODS:
        record.originals[name] = getattr(optimizer, name)
        ledger.patch(
            optimizer, name, lambda original, name=name: _replacement(optimizer, name, original)
        )
    vars(optimizer)["_amp_record"] = record
    ledger.add_undo("forget the optimizer", lambda: vars(optimizer).pop("_amp_record", None))
    return record

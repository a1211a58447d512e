"""O0/O2/O3 model handling: weight casting, FP32 batch norm, forward input/output casts, FP32 state dicts.

Inputs and outputs are cast by forward hooks rather than by replacing `forward`, so replicas made
by DataParallel and copies made by `copy.deepcopy` cast too (apex's patched `forward` was bound to
the original module, NVIDIA/apex#227, #269, #503).
"""

import functools

import torch

from .._state import amp_state
from ..casting import fp32_modules
from ..casting.casts import LOW_PRECISION, cast_tree
from .masters import new_master
from .shadows import (
    FP32StateDict,
    LoadIntoShadows,
    MarkLoaded,
    ModelShadows,
    Shadow,
    SyncBeforeForward,
)

_BATCH_NORM = torch.nn.modules.batchnorm._BatchNorm
_PARALLEL_WRAPPERS = (torch.nn.DataParallel, torch.nn.parallel.DistributedDataParallel)


def check_model(model, index, properties=None):
    """Raise apex's errors for a model amp cannot take (worded for `properties`' opt level);
    modifies nothing."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            "amp.initialize: models must be a torch.nn.Module or a list of them; "
            f"models[{index}] is a {type(model).__name__}."
        )
    if isinstance(model, _PARALLEL_WRAPPERS):
        raise RuntimeError(
            f"Incoming model is an instance of {type(model).__module__}.{type(model).__name__}. "
            "Parallel wrappers should only be applied to the model(s) AFTER \nthe model(s) have "
            "been returned from amp.initialize."
        )
    for kind, named in (("param", model.named_parameters()), ("buffer", model.named_buffers())):
        for name, tensor in named:
            if tensor.dtype in LOW_PRECISION:
                raise RuntimeError(
                    f"Found {kind} {name} with type {tensor.dtype}, expected torch.float32.\n"
                    "When using amp.initialize, you do not need to call .half() or "
                    ".to(torch.bfloat16) on your model\nbefore passing it, no matter what "
                    f"optimization level you choose: {_what_the_level_does(properties)}."
                )


def _what_the_level_does(properties):
    if properties is None:
        return "O2 and O3 cast it for you"
    level, cast = properties.opt_level, properties.cast_model_type
    if cast in LOW_PRECISION:
        return f"{level} casts it to {cast} for you"
    if properties.patch_torch_functions:
        return f"{level} keeps it in FP32 and runs the listed ops in low precision"
    return f"{level} trains it in FP32"


def check_hookable(model, index, opt_level):
    """Refuse a model holding TorchScript modules where amp casts it or hooks its forward (O0, O2,
    O3, or `cast_model_outputs`): they take no hooks and hide their tensors. Modifies nothing."""
    for name, module in model.named_modules():
        if isinstance(module, torch.jit.ScriptModule):
            where = f"models[{index}]" + (f" (its submodule {name!r})" if name else "")
            raise RuntimeError(
                f"amp.initialize: {where} is a TorchScript module ({type(module).__name__}); "
                f"opt_level={opt_level!r} casts the model's weights and hooks its forward, which "
                "TorchScript modules do not allow. Pass the Python module to amp.initialize and "
                "use torch.compile rather than torch.jit.script (or script after training)."
            )


def parameters_to_cast(model, keep_batchnorm_fp32):
    """The FP32 parameters that casting `model` to low precision will change."""
    found = {}
    for module in _modules_to_cast(model, keep_batchnorm_fp32):
        for param in module._parameters.values():
            if param is not None and param.dtype is torch.float32:
                found[id(param)] = param
    return list(found.values())


def _modules_to_cast(model, keep_batchnorm_fp32):
    for module in model.modules():
        if fp32_modules.keeps(module):  # amp.initialize(..., fp32_modules=[...])
            continue
        if not (keep_batchnorm_fp32 and isinstance(module, _BATCH_NORM)):
            yield module


def cast_model(model, dtype, keep_batchnorm_fp32, keep_fp32_params, ledger):
    """Cast the FP32 parameters and buffers of `model` to `dtype` (batch norm kept FP32 if asked).

    Parameters keep their identity (their `.data` is swapped). Each cast buffer, and each cast
    parameter when `keep_fp32_params` (O2), gets an FP32 shadow (shadows.py): the parameter's
    master weight if an optimizer steps it, else an FP32 copy, so that frozen parameters keep
    their FP32 values too. Undo puts the FP32 values back from the shadows (O3 parameters, which
    have none, come back upcast).
    """
    params = parameters_to_cast(model, keep_batchnorm_fp32)
    model_shadows = ModelShadows()
    by_module = {module: {} for module in model.modules()}
    fp32_of = dict(amp_state.masters)  # id(parameter) -> its FP32 copy
    # One Shadow per parameter: a weight tied within the model, or shared with a model cast
    # before this one (already low precision then), is served by the same shadow everywhere.
    shadow_of = dict(amp_state.shadows) if keep_fp32_params else {}
    for module in _modules_to_cast(model, keep_batchnorm_fp32):
        for name, param in module._parameters.items():
            if param is None or not keep_fp32_params:
                continue
            shadow = shadow_of.get(id(param))
            if shadow is None and param.dtype is torch.float32:
                fp32 = fp32_of.get(id(param))
                if fp32 is None:
                    fp32 = new_master(param)
                shadow = shadow_of[id(param)] = Shadow(module, name, True, fp32)
            if shadow is not None:
                by_module[module][name] = shadow
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.dtype is torch.float32:
                by_module[module][name] = Shadow(module, name, False, buffer)
    unique = {id(shadow): shadow for by_name in by_module.values() for shadow in by_name.values()}
    model_shadows.shadows.extend(unique.values())
    follow = FollowMoves(model, model_shadows, by_module)

    def undo():
        follow.everywhere()  # a parameter moved since (parametrize) gets its FP32 value too
        model_shadows.sync()
        fp32_of = {id(s.current()): s.fp32 for s in model_shadows.shadows if s.is_param}
        with torch.no_grad():
            for param in params:
                amp_state.shadows.pop(id(param), None)
                if param.dtype is not torch.float32:
                    fp32 = fp32_of.get(id(param))
                    param.data = fp32.data if fp32 is not None else param.data.float()
                if param.grad is not None and param.grad.dtype is not torch.float32:
                    param.grad = param.grad.float()
            for shadow in model_shadows.shadows:
                if not shadow.is_param:
                    current = shadow.current()
                    if current is not None and current.dtype in LOW_PRECISION:
                        shadow.module._buffers[shadow.name] = shadow.fp32
        _flatten_rnns(model)

    ledger.add_undo(f"FP32 weights back into {type(model).__name__}", undo)
    with torch.no_grad():
        for param in params:
            param.data = param.data.to(dtype)
            if param.grad is not None:
                param.grad = param.grad.to(dtype)
        for module, by_name in by_module.items():
            for name, shadow in by_name.items():
                if not shadow.is_param:
                    module._buffers[name] = shadow.fp32.to(dtype)
    for shadow in model_shadows.shadows:
        shadow.mark()
        if shadow.is_param:
            amp_state.shadows[id(shadow.current())] = shadow
    _flatten_rnns(model)
    _register_state_dict_hooks(model, follow, ledger)


def _flatten_rnns(model):
    # cuDNN wants an RNN's weights in one contiguous buffer; recompact after a dtype change.
    for module in model.modules():
        if isinstance(module, torch.nn.RNNBase):
            module.flatten_parameters()


class CastInputs:
    """Forward pre-hook casting floating inputs (a class, so that a model pickles with it)."""

    def __init__(self, dtype):
        self.dtype = dtype

    def __call__(self, module, args, kwargs):
        return cast_tree(args, self.dtype), (cast_tree(kwargs, self.dtype) if kwargs else kwargs)


class CastOutputs:
    """Forward hook casting floating outputs."""

    def __init__(self, dtype):
        self.dtype = dtype

    def __call__(self, module, args, output):
        return cast_tree(output, self.dtype)


def cast_forward(model, input_dtype, output_dtype, ledger):
    """Cast floating inputs of `model(...)` to `input_dtype` (None: leave) and outputs to `output_dtype`."""
    if input_dtype is not None:
        # Appended last so it runs just before forward: the user's pre-hooks see their inputs.
        handle = model.register_forward_pre_hook(CastInputs(input_dtype), with_kwargs=True)
        ledger.add_hook(handle, "input cast hook")
    # Prepended so it runs first after forward: the user's forward hooks see cast outputs.
    handle = model.register_forward_hook(CastOutputs(output_dtype), prepend=True)
    ledger.add_hook(handle, "output cast hook")


def _register_state_dict_hooks(model, follow, ledger):
    """Make `state_dict()` FP32 (and live) at every level and `load_state_dict` fill the shadows."""
    hook = SyncBeforeForward(follow.model_shadows, follow.by_module)
    ledger.add_hook(model.register_forward_pre_hook(hook, prepend=True), "shadow sync hook")
    for module in model.modules():
        for handle in _hook_module(module, follow):
            ledger.add_hook(handle, "FP32 state dict hook")


def _hook_module(module, follow):
    """Register the state-dict hooks of one module; return their handles."""
    by_name = follow.by_module[module]
    if hasattr(module, "register_load_state_dict_pre_hook"):
        load_pre_hook = module.register_load_state_dict_pre_hook
    else:  # torch < 2.5
        load_pre_hook = functools.partial(
            module._register_load_state_dict_pre_hook, with_module=True
        )
    if hasattr(module, "register_state_dict_post_hook"):
        post_hook = module.register_state_dict_post_hook
    else:  # torch < 2.5
        post_hook = module._register_state_dict_hook
    return [
        module.register_state_dict_pre_hook(follow),  # first: moves are followed
        post_hook(FP32StateDict(follow.model_shadows, by_name)),
        load_pre_hook(follow),
        load_pre_hook(LoadIntoShadows(by_name)),
        module.register_load_state_dict_post_hook(MarkLoaded(by_name)),
    ]


class FollowMoves:
    """State-dict and load pre-hook: shadows follow parameters that moved after initialize.

    `torch.nn.utils.parametrize` moves a parameter to `<module>.parametrizations.<name>.original`
    (and `remove_parametrizations` back), `torch.nn.utils.prune` to `<module>.<name>_orig`; the
    parameter object stays the same. Before a module's state dict is saved or loaded, a shadowed
    parameter that left one of its names is looked up in the model, and one that arrived under a
    name is recognised, and its shadow re-anchored there (a module made after initialize gets
    amp's state-dict hooks): the state dict holds the FP32 master under the new key and a load
    writes the master. A parameter found nowhere (deleted, or replaced by an assignment) keeps
    its shadow where it was. A module whose parameters sit where they were costs a few lookups.
    """

    def __init__(self, model, model_shadows, by_module):
        self.model = model
        self.model_shadows = model_shadows
        self.by_module = by_module  # module -> {name: Shadow}, shared with the other hooks
        # id(parameter) -> its shadow (O2; O3 keeps none, and has nothing to follow)
        self.shadow_of = {id(s.current()): s for s in model_shadows.shadows if s.is_param}

    def __call__(self, module, *args):
        by_name = self.by_module.get(module)
        if not self.shadow_of or by_name is None:
            return
        parameters = module._parameters
        for name, shadow in list(by_name.items()):
            if shadow.is_param and parameters.get(name) is None:
                self._moved_away(by_name, name, shadow)
        for name, param in parameters.items():
            if param is not None and name not in by_name:
                shadow = self.shadow_of.get(id(param))
                if shadow is not None and shadow.low is param:
                    by_name[name] = shadow  # arrived here (moved back, or from elsewhere)
                    self._relocate(shadow, module, name)

    def _moved_away(self, by_name, name, shadow):
        for new_module in self.model.modules():
            for new_name, param in new_module._parameters.items():
                served = self.by_module.get(new_module, {}).get(new_name) is shadow
                if param is shadow.low and not served:
                    del by_name[name]
                    if new_module not in self.by_module:
                        self.by_module[new_module] = {}
                        handles = _hook_module(new_module, self)
                        if any(model is self.model for model in amp_state.models):
                            for handle in handles:
                                amp_state.ledger.add_hook(handle, "FP32 state dict hook")
                    self.by_module[new_module][new_name] = shadow
                    self._relocate(shadow, new_module, new_name)
                    return

    @staticmethod
    def _relocate(shadow, module, name):
        """Make the shadow read its parameter at `module.name` if its own place lost it."""
        if shadow.module._parameters.get(shadow.name) is not shadow.low:
            shadow.module, shadow.name = module, name

    def everywhere(self):
        """Every shadow reads its parameter where it is now (at undo: no hooks are added)."""
        for module in self.model.modules():
            for name, param in module._parameters.items():
                shadow = self.shadow_of.get(id(param))
                if shadow is not None and shadow.low is param:
                    self._relocate(shadow, module, name)


def follow_parameter(param, module, name):
    """The parameter watch found `param` at `module.name` (a move, checked at each step): its
    shadow reads it there, so that outside writes to it reach its master."""
    shadow = amp_state.shadows.get(id(param))
    if shadow is not None and shadow.module._parameters.get(shadow.name) is not param:
        shadow.module, shadow.name = module, name

"""O0/O2/O3 model handling: weight casting, FP32 batch norm, forward input/output casts
(casting/cast_tree.py's hooks), FP32 state dicts (model_state.py's hooks).

Inputs and outputs are cast by forward hooks rather than by replacing `forward`, so replicas made
by DataParallel and copies made by `copy.deepcopy` cast too (apex's patched `forward` was bound to
the original module, NVIDIA/apex#227, #269, #503).
"""

import functools

import torch

from .._state import amp_state
from ..casting import fp32_modules
from ..casting.cast_tree import CastInputs, CastOutputs
from ..casting.casts import LOW_PRECISION
from ..distributed import set_data
from . import shards
from .buffers import BufferTable, held_exactly
from .model_state import FP32StateDict, LoadIntoCopies, MarkLoaded, ModelCopies, SyncBeforeForward
from .rows import FrozenRows

__all__ = [
    "check_model",
    "check_hookable",
    "parameters_to_cast",
    "cast_model",
    "frozen_rows",
    "release_exact",
    "cast_forward",
]

_BATCH_NORM = torch.nn.modules.batchnorm._BatchNorm
_PARALLEL_WRAPPERS = (torch.nn.DataParallel, torch.nn.parallel.DistributedDataParallel)


def check_model(model, index, properties):
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


def cast_model(model, dtype, keep_batchnorm_fp32, form, ledger):
    """Cast the FP32 parameters and buffers of `model` to `dtype` (batch norm kept FP32 if asked).

    Parameters keep their identity (their `.data` is swapped). With a master `form` (O2,
    rows.MasterForm) each cast parameter keeps its FP32 value in a row: its optimizer's (made
    already: the weight is that row's), else this initialize's frozen rows (frozen_rows), so that
    frozen parameters keep their FP32 values too. Each cast buffer keeps its FP32 original in the
    model's buffer table (buffers.py; release_exact releases the exact ones once initialize
    succeeded). Undo puts the FP32 values back (O3 parameters, which have none, come back
    upcast). Returns the model's ModelCopies (model_state.py).
    """
    # amp_state.cast_params: found before the optimizers' rows made some of them low precision
    cast_ids = amp_state.cast_params
    places = {}  # id(param) -> (param, its module, its name there): its first place
    for module in _modules_to_cast(model, keep_batchnorm_fp32):
        for name, p in module._parameters.items():
            if p is not None and id(p) in cast_ids:
                places.setdefault(id(p), (p, module, name))
    params = [param for param, _, _ in places.values()]
    shards.check_groups(model, cast_ids, dtype)
    buffers, lows = BufferTable(), []
    for module in _modules_to_cast(model, keep_batchnorm_fp32):
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.dtype is torch.float32:
                lows.append(buffer.to(dtype))  # cast once: for the exact check and the model
                buffers.add(module, name, buffer, exact=held_exactly(buffer, lows[-1]))
    copies = ModelCopies(params, buffers)

    def undo():
        copies.sync()
        with torch.no_grad():
            for param, module, name in places.values():
                current = module._parameters.get(name)
                if _converted(current, param):  # the model's own parameter gets the value
                    rows, row = copies.find(param)
                    if rows is not None:
                        value = torch.empty_like(current.data, dtype=torch.float32)
                        set_data(current, value.copy_(rows.value_with(row, current.detach())))
                    continue
                rows, row = copies.find(param)
                if rows is not None:  # in the parameter's own layout (FP32 too: model.float())
                    value = torch.empty_like(param.data, dtype=torch.float32)
                    set_data(param, value.copy_(rows.value(row)))
                elif param.dtype is not torch.float32:
                    set_data(param, param.data.float())
                if param.grad is not None and param.grad.dtype is not torch.float32:
                    param.grad = param.grad.float()
            for row, (module, name) in enumerate(buffers.places):
                current = buffers.current(row)
                if current is not None and current.dtype in LOW_PRECISION:
                    module._buffers[name] = buffers.full(row)
        shards.resync(model)
        _flatten_rnns(model)

    ledger.add_undo(f"FP32 weights back into {type(model).__name__}", undo)
    with torch.no_grad():
        for param in params:
            rows = amp_state.owners.get(id(param))
            if param.dtype is not torch.float32:
                pass  # its optimizer's row made its weight already
            elif rows is not None or form is None:  # an FP32 master's copy, or O3's weight
                set_data(param, param.data.to(dtype))
            else:
                low, rest = form.encode(param.detach().float())
                set_data(param, low)
                frozen = frozen_rows(form)
                frozen.add(param, rest)
                amp_state.owners[id(param)] = frozen
            if param.grad is not None:
                param.grad = param.grad.to(dtype)
            if rows is not None:
                rows.mark_row(rows.index[id(param)])
        for (module, name), low in zip(buffers.places, lows):
            module._buffers[name] = low
    buffers.mark_places()
    shards.resync(model)
    _flatten_rnns(model)
    _register_state_dict_hooks(model, copies, ledger)
    return copies


def _converted(current, param):
    """Whether a conversion of the model made `current` in `param`'s place (model.to("meta"),
    torch's swap of parameters on conversion): a new object of the same class, dtype and shape
    (not a wrapper's: fully_shard applied after amp.initialize puts a DTensor there)."""
    return (
        current is not None
        and current is not param
        and type(current) is type(param)
        and current.dtype is param.dtype
        and current.shape == param.shape
    )


def frozen_rows(form):
    """The rows of this initialize's cast parameters that no optimizer steps (made once)."""
    rows = amp_state.rows
    if not rows or not isinstance(rows[-1], FrozenRows):
        rows.append(FrozenRows(form))
    return rows[-1]


def release_exact(cast):
    """Buffers the low precision holds exactly are held once, in it (BufferTable.release_exact):
    called with the ModelCopies of every cast model once initialize has succeeded (its snapshot,
    which holds the buffers to put back on a failure, gone; a buffer may be shared between
    models)."""
    for copies in cast:
        copies.buffers.release_exact()


def _flatten_rnns(model):
    # cuDNN wants an RNN's weights in one contiguous buffer; recompact after a dtype change.
    for module in model.modules():
        if isinstance(module, torch.nn.RNNBase):
            module.flatten_parameters()


def cast_forward(model, input_dtype, output_dtype, ledger):
    """Cast floating inputs of `model(...)` to `input_dtype` (None: leave) and outputs to
    `output_dtype`."""
    if input_dtype is not None:
        # Appended last so it runs just before forward: the user's pre-hooks see their inputs.
        handle = model.register_forward_pre_hook(CastInputs(input_dtype), with_kwargs=True)
        ledger.add_hook(handle, "input cast hook")
    # Prepended so it runs first after forward: the user's forward hooks see cast outputs.
    handle = model.register_forward_hook(CastOutputs(output_dtype), prepend=True)
    ledger.add_hook(handle, "output cast hook")


def _register_state_dict_hooks(model, copies, ledger):
    """Make `state_dict()` FP32 (and live) at every level and `load_state_dict` fill the FP32
    values: hooks on every module, each also serving the submodules made later
    (model_state.py)."""
    hook = SyncBeforeForward(copies)
    ledger.add_hook(model.register_forward_pre_hook(hook, prepend=True), "FP32 sync hook")
    for module in model.modules():
        copies.hooked.add(module)
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
        for handle in (
            post_hook(FP32StateDict(copies)),
            load_pre_hook(LoadIntoCopies(copies)),
            module.register_load_state_dict_post_hook(MarkLoaded(copies)),
        ):
            ledger.add_hook(handle, "FP32 state dict hook")

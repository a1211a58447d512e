"""O0/O2/O3 model handling: weight casting, FP32 batch norm, forward input/output casts, FP32 state dicts.

Inputs and outputs are cast by forward hooks rather than by replacing `forward`, so replicas made
by DataParallel and copies made by `copy.deepcopy` cast too (apex's patched `forward` was bound to
the original module, NVIDIA/apex#227, #269, #503).
"""

import itertools

import torch

from ._state import amp_state
from .casts import LOW_PRECISION, cast_tree

_BATCH_NORM = torch.nn.modules.batchnorm._BatchNorm
_PARALLEL_WRAPPERS = (torch.nn.DataParallel, torch.nn.parallel.DistributedDataParallel)


def check_model(model, index):
    """Raise apex's errors for a model amp cannot take; modifies nothing."""
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
                    "optimization level you choose: O2 and O3 cast it for you."
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
        if not (keep_batchnorm_fp32 and isinstance(module, _BATCH_NORM)):
            yield module


def cast_model(model, dtype, keep_batchnorm_fp32, ledger):
    """Cast the FP32 parameters and buffers of `model` to `dtype` (batch norm kept FP32 if asked).

    Parameters keep their identity (their `.data` is swapped). Undo puts FP32 values back: the
    master weights where the optimizer has them, else the low-precision values upcast (O3 keeps
    no FP32 copy of its parameters). Buffers are small and often constants (positional tables),
    so their FP32 originals are kept and come back exactly unless the buffer changed meanwhile.
    """
    params = parameters_to_cast(model, keep_batchnorm_fp32)
    buffers = []  # (module, name, FP32 original, cast buffer, its version after the cast)
    for module in _modules_to_cast(model, keep_batchnorm_fp32):
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.dtype is torch.float32:
                buffers.append([module, name, buffer, None, None])

    def undo():
        with torch.no_grad():
            for param in params:
                master = amp_state.masters.get(id(param))
                if param.dtype is not torch.float32:
                    param.data = master.data if master is not None else param.data.float()
                if param.grad is not None and param.grad.dtype is not torch.float32:
                    param.grad = param.grad.float()
            for module, name, original, cast, version in buffers:
                current = module._buffers.get(name)
                if current is cast and current._version == version:
                    module._buffers[name] = original
                elif current is not None and current.dtype in LOW_PRECISION:
                    module._buffers[name] = current.float()
        _flatten_rnns(model)

    ledger.add_undo(f"FP32 weights back into {type(model).__name__}", undo)
    with torch.no_grad():
        for param in params:
            param.data = param.data.to(dtype)
            if param.grad is not None:
                param.grad = param.grad.to(dtype)
        for entry in buffers:
            module, name, original = entry[:3]
            cast = module._buffers[name] = original.to(dtype)
            entry[3:] = [cast, cast._version]
    _flatten_rnns(model)


def _flatten_rnns(model):
    # cuDNN wants an RNN's weights in one contiguous buffer; recompact after a dtype change.
    for module in model.modules():
        if isinstance(module, torch.nn.RNNBase):
            module.flatten_parameters()


def cast_forward(model, input_dtype, output_dtype, ledger):
    """Cast floating inputs of `model(...)` to `input_dtype` (None: leave) and outputs to `output_dtype`."""
    if input_dtype is not None:

        def cast_inputs(module, args, kwargs):
            return cast_tree(args, input_dtype), cast_tree(kwargs, input_dtype)

        # Appended last so it runs just before forward: the user's pre-hooks see their inputs.
        handle = model.register_forward_pre_hook(cast_inputs, with_kwargs=True)
        ledger.add_hook(handle, "input cast hook")

    def cast_outputs(module, args, output):
        return cast_tree(output, output_dtype)

    # Prepended so it runs first after forward: the user's forward hooks see cast outputs.
    handle = model.register_forward_hook(cast_outputs, prepend=True)
    ledger.add_hook(handle, "output cast hook")


def _fp32_state_dict(module, state_dict, prefix, local_metadata):
    """State-dict hook: this module's own low-precision entries in FP32, from the masters if any."""
    for name, tensor in itertools.chain(module._parameters.items(), module._buffers.items()):
        key = prefix + name
        value = state_dict.get(key)
        if value is None or value is tensor or value.dtype not in LOW_PRECISION:
            continue  # absent, kept as a live Parameter (keep_vars=True), or already FP32
        master = amp_state.masters.get(id(tensor))
        state_dict[key] = master.detach() if master is not None else value.float()


def _load_into_masters(module, state_dict, prefix, *args):
    """Load-state-dict pre-hook: full-precision values go into the masters, not only the model."""
    with torch.no_grad():
        for name, param in module._parameters.items():
            master = amp_state.masters.get(id(param)) if param is not None else None
            value = state_dict.get(prefix + name)
            if (
                master is not None
                and isinstance(value, torch.Tensor)
                and value.shape == master.shape
            ):
                master.copy_(value)


def _loaded(module, incompatible_keys):
    """Load-state-dict post-hook: what was just loaded is amp's own write, not an outside one."""
    for param in module._parameters.values():
        if param is not None and id(param) in amp_state.master_versions:
            amp_state.master_versions[id(param)] = param._version


def register_state_dict_hooks(model, ledger):
    """Make `state_dict()` FP32 at every level and `load_state_dict` refresh the masters."""
    for module in model.modules():
        if hasattr(module, "register_state_dict_post_hook"):
            handle = module.register_state_dict_post_hook(_fp32_state_dict)
        else:  # torch < 2.5
            handle = module._register_state_dict_hook(_fp32_state_dict)
        ledger.add_hook(handle, "FP32 state dict hook")
        if hasattr(module, "register_load_state_dict_pre_hook"):
            handle = module.register_load_state_dict_pre_hook(_load_into_masters)
        else:  # torch < 2.5
            handle = module._register_load_state_dict_pre_hook(_load_into_masters, with_module=True)
        ledger.add_hook(handle, "master weight load hook")
        ledger.add_hook(module.register_load_state_dict_post_hook(_loaded), "master version hook")

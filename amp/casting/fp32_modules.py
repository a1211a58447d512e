"""amp.initialize(..., fp32_modules=[...]): modules that run in FP32 at every opt level.

The argument names modules by class (``torch.nn.LayerNorm``) or by fnmatch patterns of their
qualified names in the model (``"blocks.*.attn.softmax"``, ``"head"``); a match keeps its whole
subtree. At O1 amp casts nothing inside them and their floating inputs arrive in FP32. At O2/O3
their parameters and buffers are not cast (like batch norm's: no master weights, FP32 in
checkpoints, nothing to undo), their inputs are cast to FP32 and their outputs back to the
model's dtype, so the modules around them see what they would without the option.

A class or pattern that matches no module is an error, not a warning: a typo would otherwise
train silently in low precision, which is what the user asked amp to prevent.
"""

import fnmatch

import torch

from .._state import amp_state
from .regions import enter_scope, exit_scope
from .cast_tree import cast_tree

__all__ = ["resolve", "keeps", "FP32Inputs", "RestoreCasting", "install"]

_HOW = (
    "Pass a list of torch.nn.Module subclasses (e.g. torch.nn.LayerNorm) or fnmatch patterns of "
    "qualified names as model.named_modules() gives them (e.g. 'blocks.*.attn')."
)


def resolve(spec, models):
    """The modules `spec` keeps in FP32 (a set, whole subtrees), or a clear error; changes
    nothing. `spec` None or empty: none."""
    if spec is None:
        return set()
    if isinstance(spec, (str, type)) or not isinstance(spec, (list, tuple)):
        raise TypeError(
            f"amp.initialize: fp32_modules must be a list or tuple; got {type(spec).__name__} "
            f"{spec!r}. {_HOW}"
        )
    for index, item in enumerate(spec):
        is_module_class = isinstance(item, type) and issubclass(item, torch.nn.Module)
        if not (isinstance(item, str) or is_module_class):
            raise TypeError(
                f"amp.initialize: fp32_modules[{index}] is {item!r} ({type(item).__name__}), "
                f"which names no module. {_HOW}"
            )
    kept = set()
    for index, item in enumerate(spec):
        matched = set()
        for model in models:
            for name, module in model.named_modules():
                if isinstance(item, str) and fnmatch.fnmatchcase(name, item):
                    matched.add(module)
                elif isinstance(item, type) and isinstance(module, item):
                    matched.add(module)
        if not matched:
            what = f"pattern {item!r}" if isinstance(item, str) else f"class {item.__name__}"
            names = [name for model in models for name, _ in model.named_modules() if name]
            raise ValueError(
                f"amp.initialize: fp32_modules[{index}], {what}, matches no module of the "
                f"models, so nothing would stay in FP32. The models' modules are: "
                f"{', '.join(names[:20]) or '(none below the model itself)'}"
                f"{' ...' if len(names) > 20 else ''}. {_HOW}"
            )
        for module in matched:
            kept.update(module.modules())
    return kept


def keeps(module):
    """Whether `module` stays FP32 (O2/O3 leave its parameters and buffers alone)."""
    return module in amp_state.fp32_modules


class FP32Inputs:
    """Forward pre-hook: floating inputs to FP32 and, until the module returns, no casting.

    Holds nothing, so a model with it still copies and pickles; the open scopes live in the
    thread's state."""

    def __call__(self, module, args, kwargs):
        amp_state.thread.fp32_scopes.append(enter_scope(None))
        return cast_tree(args, torch.float32), cast_tree(kwargs, torch.float32)


class RestoreCasting:
    """Forward hook (also after an exception): casting as before; outputs to `dtype` if given."""

    def __init__(self, dtype):
        self.dtype = dtype

    def __call__(self, module, args, output):
        scopes = amp_state.thread.fp32_scopes
        if scopes:
            exit_scope(scopes.pop())
        if self.dtype is None:
            return output
        output = cast_tree(output, self.dtype)
        if amp_state.origin_watch is not None and amp_state.origin_watch.armed:
            # An FP32 output beyond the model dtype's range turns inf here: name this module.
            amp_state.origin_watch.note_cast(module, output)
        return output


def install(models, model_dtype, ledger):
    """Hooks on the outermost kept modules (undone by `ledger`). `model_dtype`: the dtype O2/O3
    cast the model to (outputs go back to it), or None at O0/O1 (outputs stay FP32)."""
    if model_dtype is not None:
        _refuse_tied(models, model_dtype)
    for model in models:
        stack = [(model, True)]
        while stack:
            module, is_root = stack.pop()
            if module not in amp_state.fp32_modules:
                stack.extend((child, False) for child in module.children())
                continue
            # A model kept whole returns through its own output cast (cast_model_outputs).
            dtype = None if is_root else model_dtype
            pre = module.register_forward_pre_hook(FP32Inputs(), with_kwargs=True)
            ledger.add_hook(pre, "fp32_modules input hook")
            post = module.register_forward_hook(RestoreCasting(dtype), always_call=True)
            ledger.add_hook(post, "fp32_modules output hook")


def _refuse_tied(models, dtype):
    """O2/O3 cast a parameter once for every module that holds it: one a kept module shares
    with a cast module (tied weights) would be left in `dtype`, silently or failing later."""
    holders = {}
    for model in models:
        for prefix, module in model.named_modules(remove_duplicate=False):
            for name, param in module.named_parameters(recurse=False):
                qualified = f"{prefix}.{name}" if prefix else name
                holders.setdefault(param, []).append((qualified, module in amp_state.fp32_modules))
    for param, names in holders.items():
        kept = [name for name, is_kept in names if is_kept]
        cast = [name for name, is_kept in names if not is_kept]
        if kept and cast and param.dtype == dtype:
            raise ValueError(
                f"amp.initialize: fp32_modules keeps {kept[0]!r} in FP32, but the same parameter "
                f"is {cast[0]!r} of a module cast to {dtype} (tied weights), so it cannot stay "
                "FP32. Keep every module that holds it (add the module of "
                f"{cast[0]!r} to fp32_modules), or use opt_level='O1'."
            )

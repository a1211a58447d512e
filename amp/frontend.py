"""initialize / deinitialize / master_params / last_overflow: argument handling. (state_dict and
load_state_dict live in scaling/checkpoint.py; apex's `amp.frontend` offered them here too.)"""

import logging
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from . import kernel_advice
from . import properties as properties_module
from .patching import PatchLedger
from ._state import INHERIT, amp_state, logger
from .casting import fp32_modules as fp32_modules_module
from .casting import regions as regions_module
from .casting import native_autocast
from .casting.casts import policy_for
from .scaling.checkpoint import load_state_dict, state_dict
from .scaling.scaler import LossScaler
from .weights import engines, paths
from .weights import model as model_module
from .weights import instrument as instrument_module
from .weights import optimizer as optimizer_module
from .diagnostics import overflow
from .weights.snapshot import Snapshot

__all__ = [
    "initialize",
    "deinitialize",
    "state_dict",
    "load_state_dict",
    "last_overflow",
    "master_params",
]

_VERBOSITY_LEVELS = {0: logging.WARNING, 1: logging.INFO, 2: logging.DEBUG}


def _as_list(value, kind):
    """(list, was_list) with apex's rules: a list stays a list, one object becomes [object]."""
    if isinstance(value, list):
        return value, True
    if isinstance(value, tuple):
        raise TypeError(
            f"{kind} must be either a single {kind[:-1]} or a list of {kind}, not a tuple."
        )
    return [value], False


def _check_positive(name, value, allow_none):
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(
            f"{name} must be a positive number{' or None' if allow_none else ''}; got {value!r}."
        )
    return float(value)


def _check_arguments(verbosity, num_losses, cast_model_outputs):
    properties_module.check_verbosity(verbosity, "verbosity")
    if isinstance(num_losses, bool) or not isinstance(num_losses, int) or num_losses < 1:
        raise ValueError(f"num_losses must be a positive int; got {num_losses!r}.")
    if cast_model_outputs is not None and (
        not isinstance(cast_model_outputs, torch.dtype) or not cast_model_outputs.is_floating_point
    ):
        raise ValueError(
            f"cast_model_outputs must be a floating torch.dtype or None; got {cast_model_outputs!r}."
        )


def _check_models_and_optimizers(models, optimizers, properties):
    for index, model in enumerate(models):
        model_module.check_model(model, index, properties)
    if len({id(m) for m in models}) != len(models):
        raise ValueError("amp.initialize: the same model appears twice in models.")
    if len({id(o) for o in optimizers}) != len(optimizers):
        raise RuntimeError("A given optimizer should only be passed through amp.initialize once.")
    owner = {}
    for index, optimizer in enumerate(optimizers):
        instrument_module.check_optimizer(optimizer, index)
        if properties.compact:  # only the fused path keeps it: refused here with the reason
            for number, group in enumerate(optimizer.param_groups):
                where = f"optimizers[{index}].param_groups[{number}]"
                paths.choose(optimizer, group, properties, where)
        if not properties.master_weights:
            continue  # each optimizer steps the model's parameters: they may share some
        for group in optimizer.param_groups:
            for param in group["params"]:
                if owner.setdefault(id(param), index) != index:
                    raise ValueError(
                        "amp.initialize: a parameter appears in two optimizers "
                        f"(optimizers[{owner[id(param)]}] and optimizers[{index}]). With master "
                        "weights a parameter has one FP32 master, which one optimizer steps; "
                        "each would make its own, and the model would follow whichever stepped "
                        "last. Give each parameter one optimizer (param groups for different "
                        "settings), or train at O1, where optimizers step the model's "
                        "parameters and may share them."
                    )


def _log_properties(base, properties):
    logger.info(
        "Selected optimization level %s",
        properties_module.OPT_LEVELS[base.opt_level].describe(base.dtype),
    )
    logger.info(
        "Defaults for this optimization level are:\n%s", properties_module.format_options(base)
    )
    logger.info("Processing user overrides (additional kwargs that are not None)...")
    logger.info(
        "After processing overrides, optimization options are:\n%s",
        properties_module.format_options(properties),
    )


def _set_verbosity(verbosity, ledger):
    """Route amp's progress messages by `verbosity`; show them on stderr if nothing else would."""
    previous_level = logger.level
    logger.setLevel(_VERBOSITY_LEVELS[verbosity])
    ledger.add_undo("logger level", lambda: logger.setLevel(previous_level))
    root_handles = logging.getLogger().handlers
    own = [h for h in logger.handlers if not isinstance(h, logging.NullHandler)]
    if verbosity > 0 and not root_handles and not own:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
        ledger.add_undo("stderr handler", lambda: logger.removeHandler(handler))


def initialize(
    models: torch.nn.Module | Sequence[torch.nn.Module],
    optimizers: Any = None,
    enabled: bool = True,
    opt_level: str = "O1",
    cast_model_type: torch.dtype | None = None,
    patch_torch_functions: bool | None = None,
    keep_batchnorm_fp32: bool | str | None = None,
    master_weights: bool | None = None,
    loss_scale: float | str | None = None,
    cast_model_outputs: torch.dtype | None = None,
    num_losses: int = 1,
    verbosity: int = 1,
    min_loss_scale: float | None = None,
    max_loss_scale: float = 2.0**24,
    dtype: torch.dtype | None = None,
    fp32_modules: Sequence[type | str] | None = None,
    float8: str | None = None,
    optimizer_state: str = "fp32",
) -> Any:
    """Set models and optimizers up for mixed precision training at `opt_level`.

    O0 trains in FP32; O1 casts around torch functions from the tables in `amp/lists`; O2 casts
    the model to `dtype` (batch norm stays FP32) and steps FP32 master weights; O3 trains
    everything in `dtype`. Options that are not None override the opt level's defaults, with
    apex's validation. Nothing is modified when an error is raised; `amp.deinitialize()` undoes
    everything.

    Args:
        models: an ``nn.Module`` or a list of them, not yet wrapped in (Distributed)DataParallel.
        optimizers: a ``torch.optim.Optimizer`` (or an object wrapping one, like apex's LARC:
            see amp/apex_interop/optimizer_wrappers.py), a list of them, or None.
        enabled (bool, default=True): False returns the arguments untouched and makes every
            other amp call a no-op.
        opt_level (str, default="O1"): "O0", "O1", "O2" or "O3" (the letter O).
        cast_model_type, patch_torch_functions, keep_batchnorm_fp32, master_weights, loss_scale:
            overrides of the opt level's properties (see docs/opt-levels.md). ``master_weights=
            "compact"`` (O2, bf16): each master is the bf16 weight and an 8-bit correction, no
            FP32 copy, stepped by amp's fused step (torch.optim.AdamW, Adam and SGD).
        cast_model_outputs (torch.dtype, optional): the dtype O0/O2/O3 models return (FP32).
        num_losses (int, default=1): how many loss scalers (``scale_loss(loss_id=...)``).
        verbosity (int, default=1): 0 silences amp's messages, 2 adds detail.
        min_loss_scale, max_loss_scale (float): bounds of the dynamic loss scale.
        dtype (torch.dtype, default=None): the low-precision type, torch.float16 (None) or
            torch.bfloat16.
        fp32_modules (list, optional): module classes or fnmatch patterns of qualified names
            (``"blocks.*.attn"``) to run in FP32: no casting inside them at O1; FP32 parameters,
            FP32 inputs and outputs cast back at O2/O3. A pattern matching nothing is an error.
        float8 (str, optional): "tensorwise" or "rowwise" (torchao.float8's recipes) at O1, O2
            or O3: every ``F.linear`` call whose in and out features and tokens are multiples of
            16 runs its forward, grad-input and grad-weight matmuls in FP8 with dynamic scales,
            output in the level's dtype; everything else as the level says. ``fp32_modules``
            and registering F.linear (``amp.register_float_function``) exclude layers. None: off.
        optimizer_state (str, default="fp32"): how O2's fused step keeps the optimizer's moments
            (AdamW/Adam's two, SGD's momentum): "fp32" (torch's own), "bf16", or "int8" (8 bits,
            block-scaled; the second moment companded).

    Returns:
        The models and optimizers in the shapes they were passed (apex's rules).

    Example::

        model, optimizer = amp.initialize(model, optimizer, opt_level="O2")
    """
    if amp_state.initialized and amp_state.enabled:
        raise RuntimeError(
            "amp.initialize was already called and amp is active. Call amp.deinitialize() first, "
            "or pass every model and optimizer in one amp.initialize call."
        )
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be True or False; got {enabled!r}.")
    _check_arguments(verbosity, num_losses, cast_model_outputs)
    properties_module.check_float8(float8, None)  # the value; the opt level is checked below
    if not enabled:
        amp_state.reset()
        amp_state.initialized = True
        amp_state.verbosity = verbosity
        return models if optimizers is None else (models, optimizers)

    if amp_state.initialized:
        amp_state.reset()  # forget an earlier initialize(enabled=False); it holds nothing
    model_list, models_was_list = _as_list(models, "models")
    optimizer_list, optimizers_was_list = (
        ([], False) if optimizers is None else _as_list(optimizers, "optimizers")
    )
    overrides = {
        name: value
        for name, value in dict(
            cast_model_type=cast_model_type,
            patch_torch_functions=patch_torch_functions,
            keep_batchnorm_fp32=keep_batchnorm_fp32,
            master_weights=master_weights,
            loss_scale=loss_scale,
        ).items()
        if value is not None
    }
    base, properties = properties_module.resolve(
        opt_level, dtype, float8, optimizer_state, **overrides
    )
    min_loss_scale = _check_positive("min_loss_scale", min_loss_scale, allow_none=True)
    max_loss_scale = _check_positive("max_loss_scale", max_loss_scale, allow_none=True)
    if (
        min_loss_scale is not None
        and max_loss_scale is not None
        and min_loss_scale > max_loss_scale
    ):
        raise ValueError(
            f"min_loss_scale={min_loss_scale} is above max_loss_scale={max_loss_scale}."
        )
    patching = properties.patch_torch_functions or properties.float8 is not None
    if patching and (
        native_autocast.any_enabled() or amp_state.thread.own_policy is not INHERIT
    ):
        raise RuntimeError(
            f"amp.initialize(opt_level={properties.opt_level!r}"
            f"{', float8=...' if properties.float8 else ''}) was called inside an autocast region "
            "(torch.autocast, amp.autocast or amp.disable_casts, or a torch.autocast region "
            "opened before amp was first used): O1 sets torch's autocast state of this thread, "
            "which the region puts back when it exits. Call amp.initialize outside any region."
        )
    _check_models_and_optimizers(model_list, optimizer_list, properties)
    if properties.cast_model_type or cast_model_outputs is not None:
        for index, model in enumerate(model_list):
            model_module.check_hookable(model, index, properties.opt_level)
    kept_fp32 = fp32_modules_module.resolve(fp32_modules, model_list)
    engines.check_engines(model_list, optimizer_list, properties)

    snapshot = Snapshot(model_list, optimizer_list)
    patches_installed = amp_state.torch_patches.installed
    ledger = PatchLedger()
    try:
        _set_verbosity(verbosity, ledger)
        amp_state.verbosity = verbosity
        _log_properties(base, properties)
        amp_state.fp32_modules = kept_fp32
        cast = _apply(properties, model_list, optimizer_list, cast_model_outputs, ledger)
        fp32_modules_module.install(model_list, properties.cast_model_type or None, ledger)
        amp_state.loss_scalers = [
            LossScaler(properties.loss_scale, min_loss_scale, max_loss_scale)
            for _ in range(num_losses)
        ]
        engines.anchor(amp_state.optimizers, model_list)
    except BaseException:
        _roll_back(ledger, snapshot, patches_installed)
        raise
    del snapshot  # it holds the FP32 buffers: released only once nothing else does
    model_module.release_exact(cast)
    kernel_advice.warn_if_slow(properties, model_list)
    amp_state.initialized = True
    amp_state.enabled = True
    amp_state.properties = properties
    amp_state.models = model_list
    amp_state.ledger = ledger

    model_result = model_list if models_was_list else model_list[0]
    if optimizers is None:
        return model_result
    return model_result, (optimizer_list if optimizers_was_list else optimizer_list[0])


def _roll_back(ledger, snapshot, patches_installed):
    """Undo a failed initialize: models, optimizers and torch exactly as they were."""
    try:
        ledger.restore()
    except Exception as error:  # the snapshot puts the objects back regardless
        warnings.warn(
            f"amp.initialize failed, and undoing it raised {error!r}", RuntimeWarning, stacklevel=3
        )
    finally:
        snapshot.restore()
        amp_state.reset()
        if not patches_installed:
            amp_state.torch_patches.drop()


def _apply(properties, models, optimizers, cast_model_outputs, ledger):
    cast_dtype = properties.cast_model_type or None  # False and None: leave the model as it is
    keep_bn = bool(properties.keep_batchnorm_fp32)
    if cast_dtype is not None and cast_dtype is not torch.float32:
        for model in models:
            amp_state.cast_params.update(
                id(p) for p in model_module.parameters_to_cast(model, keep_bn)
            )
    amp_state.optimizers = [
        instrument_module.instrument(optimizer, index, amp_state.cast_params, properties, ledger)
        for index, optimizer in enumerate(optimizers)
    ]
    form = paths.master_form(properties)
    if form is not None:
        engines.follow_ddp_broadcast(ledger)
    cast = []  # the ModelCopies of the cast models
    for model in models:
        if cast_dtype is not None and cast_dtype is not torch.float32:
            cast.append(model_module.cast_model(model, cast_dtype, keep_bn, form, ledger))
        if cast_dtype is not None or cast_model_outputs is not None:
            model_module.cast_forward(
                model, cast_dtype, cast_model_outputs or torch.float32, ledger
            )
    for record in amp_state.optimizers:
        if record.owner is None:  # state made before the model cast follows its parameters
            instrument_module.match_state_to_params(record.optimizer)
    float8 = properties.float8
    if properties.patch_torch_functions or float8 is not None:
        # O2/O3 with float8 patch too, under a policy that casts nothing: only the FLOAT8_FUNCS
        # (F.linear) do anything, in FP8; every other patched call runs as given.
        if float8 is not None:
            amp_state.torch_patches.use_float8()
        amp_state.torch_patches.acquire()
        ledger.add_undo("torch patches", amp_state.torch_patches.release)
        dtype = properties.dtype if properties.patch_torch_functions else None
        amp_state.default_policy = policy_for(dtype, dtype, float8=float8)
        ledger.add_undo("O1 policy", lambda: setattr(amp_state, "default_policy", None))
        # O1 casts in this thread through torch's own autocast state (other threads start off, as
        # under torch.autocast); deinitialize puts the state back.
        ledger.add_undo(
            "torch's autocast state", regions_module.begin_thread_policy(amp_state.default_policy)
        )
    return cast


def deinitialize() -> None:
    """Undo `amp.initialize` completely.

    Every patched torch attribute is the original object again, model hooks are removed,
    optimizers are plain optimizers again, and O2 models get their FP32 weights back from the
    masters. Afterwards `amp.initialize` may be called again. Without `initialize` it removes the
    patches that `amp.autocast` regions left installed (an open region keeps them until it exits).
    """
    with amp_state.lock:
        ledger = amp_state.ledger
        amp_state.cast_cache.clear()
        try:
            if ledger is not None:
                ledger.restore()
        finally:
            amp_state.reset()
            amp_state.torch_patches.drop()


def last_overflow() -> overflow.OverflowReport | None:
    """The OverflowReport of the last skipped step, or None if no step has been skipped.

    A skip the host has not learned of yet (its flag still on its way from the device) is
    learned and reported first.
    """
    optimizer_module.learn_skips()
    return overflow.last_overflow()


def master_params(optimizer: Any) -> Iterator[torch.Tensor]:
    """Yield the parameters `optimizer` steps: the FP32 masters under O2 (for gradient clipping).

    Example::

        torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), max_norm=1.0)
    """
    if not hasattr(optimizer, "param_groups"):
        raise TypeError(f"amp.master_params expects an optimizer; got {type(optimizer).__name__}.")
    record = getattr(optimizer, "__dict__", {}).get("_amp_record")
    if record is not None:  # the masters as FP32 values, with their FP32 gradients
        return iter(record.master_params())
    return (param for group in optimizer.param_groups for param in group["params"])

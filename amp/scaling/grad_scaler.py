"""amp.GradScaler: torch.amp.GradScaler, with amp's kernels, on any device, ranks that agree.

A subclass of `torch.amp.GradScaler` that overrides only what amp changes; given the same inputs
it follows the same scale trajectory and produces the same parameters. The changes:

- the device comes from the tensors scaled: `GradScaler()` works on CPU instead of disabling
  itself, and torch's form `GradScaler("cuda", ...)` is accepted as well as amp's
  `GradScaler(init_scale, ...)`;
- gradients are unscaled and checked by amp's multi-tensor kernels (amp/kernels), FSDP2's
  DTensor gradients through their local shards, and under torch.distributed the found-inf flags
  are the MAX over all ranks (as torch's ShardedGradScaler does), so every rank steps or skips
  together;
- a skipped step is reported (`amp.last_overflow()`, the skip message) and the next iteration is
  watched for where the inf/NaN started (diagnostics/origin.py);
- `update(new_scale)` takes an int too, and the errors torch raises as AssertionError are also
  ValueError / RuntimeError.
"""

import inspect
from typing import Any, Dict, Optional, Union, overload

import torch
from torch.amp.grad_scaler import OptState

from .. import distributed, kernels
from .._state import amp_state
from ..diagnostics import overflow

__all__ = ["GradScaler", "ScalerStateError", "ScalerValueError"]


class ScalerValueError(ValueError, AssertionError):
    """A bad value (torch raises AssertionError here; this is both)."""


class ScalerStateError(RuntimeError, AssertionError):
    """A call out of order (torch raises AssertionError here; this is both)."""


_DEFAULTS = dict(
    init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000, enabled=True
)
# torch's form, the one inspect.signature shows; amp's form has no `device` and starts at
# init_scale (API.md): `GradScaler(128.0)` is GradScaler(init_scale=128.0).
_TORCH_FORM = inspect.Signature(
    [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    + [
        inspect.Parameter(
            name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=default, annotation=annotation
        )
        for name, default, annotation in [
            ("device", None, Optional[str]),
            ("init_scale", 2.0**16, float),
            ("growth_factor", 2.0, float),
            ("backoff_factor", 0.5, float),
            ("growth_interval", 2000, int),
            ("enabled", True, bool),
        ]
    ],
    return_annotation=None,
)
_AMP_FORM = _TORCH_FORM.replace(
    parameters=[p for p in _TORCH_FORM.parameters.values() if p.name != "device"]
    + [inspect.Parameter("device", inspect.Parameter.KEYWORD_ONLY, default=None)]
)


class GradScaler(torch.amp.GradScaler):
    """Dynamic loss scaling for `loss.backward()` training loops, as `torch.amp.GradScaler`.

    Args:
        device (str, optional, default=None): accepted for torch's form
            ``GradScaler("cuda", ...)`` and checked; the scaler works on the device of the
            tensors it scales.
        init_scale (float, default=2.**16): the initial scale.
        growth_factor (float, default=2.0): multiplies the scale after `growth_interval`
            iterations without inf/NaN gradients.
        backoff_factor (float, default=0.5): multiplies the scale after an iteration with them.
        growth_interval (int, default=2000): clean iterations between growths.
        enabled (bool, default=True): False makes every method a pass-through.

    amp's form ``GradScaler(init_scale, growth_factor, ...)`` (torch.cuda.amp's) is accepted too.

    Where it synchronises with the device: `step` reads the found-inf flags once (not with an
    optimizer that takes them on the device, such as torch's fused Adam/AdamW/SGD), and
    `get_scale`, `state_dict` and pickling read the scale. `scale`, `unscale_` and `update` do
    not.

    Example::

        scaler = amp.GradScaler()
        for inputs, targets in data:
            optimizer.zero_grad()
            with amp.autocast():
                loss = loss_fn(model(inputs), targets)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
    """

    @overload
    def __init__(
        self,
        device: Optional[str] = None,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
    ) -> None: ...

    @overload
    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        *,
        device: Optional[str] = None,
    ) -> None: ...

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        torch_form = (args and isinstance(args[0], (str, torch.device))) or not args
        bound = (_TORCH_FORM if torch_form else _AMP_FORM).bind(None, *args, **kwargs).arguments
        options = {name: bound.get(name, default) for name, default in _DEFAULTS.items()}
        device = bound.get("device")
        if device is not None:
            device = torch.device(device).type  # raises for a device string torch does not know
        enabled = options["enabled"]
        if not isinstance(enabled, bool):
            raise TypeError(f"GradScaler(enabled=...) must be a bool; got {enabled!r}.")
        if enabled:
            _check_options(**options)
        # torch's __init__ with a device it never disables on: the device is taken from the
        # first tensor scaled (_lazy_init_scale_growth_tracker).
        super().__init__("cpu", **options)
        self._device = device

    def _check_scale_growth_tracker(self, funcname: str) -> tuple:
        if self._scale is None or self._growth_tracker is None:
            raise ScalerStateError(
                f"Attempted {funcname} but _scale is None.  This may indicate your script did "
                "not use scaler.scale(loss or outputs) earlier in the iteration."
            )
        return self._scale, self._growth_tracker

    def _lazy_init_scale_growth_tracker(self, dev: torch.device) -> None:
        super()._lazy_init_scale_growth_tracker(dev)
        self._device = dev.type

    def scale(self, outputs: Any) -> Any:
        """Multiply a tensor, or an iterable of tensors (nested), by the scale factor.

        No sync. The first tensor scaled decides the scaler's device. In the iteration after a
        skipped step amp watches the outputs for inf/NaN (amp.last_overflow().origin).
        """
        if self._enabled and amp_state.origin_watch.armed:
            amp_state.origin_watch.note_loss(outputs)
        return super().scale(outputs)

    def _unscale_grads_(
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor,
        allow_fp16: bool,
    ) -> Dict[torch.device, torch.Tensor]:
        """Unscale the optimizer's gradients with amp's kernels; return {device: found_inf}.

        Distributed, the flags are the MAX over all ranks: every rank steps or skips together
        and keeps the same scale (one small collective per call).
        """
        if _o2_record(optimizer) is not None:  # its gradients are amp.scale_loss's to unscale
            raise ScalerStateError(_no_inf_checks(optimizer))
        per_device = {}
        with torch.no_grad():
            for group in optimizer.param_groups:
                for param in group["params"]:
                    if param.grad is None:
                        continue
                    grad = param.grad
                    if not allow_fp16 and grad.dtype == torch.float16:
                        raise ValueError(
                            "Attempting to unscale FP16 gradients. GradScaler unscales "
                            "gradients in place, which loses precision in FP16; keep FP32 "
                            "parameters (autocast) or use amp.initialize(opt_level='O2') for "
                            "FP32 master weights."
                        )
                    if grad.is_sparse:
                        # Duplicate indices of scaled FP16 values can overflow when summed, so
                        # check the coalesced values.
                        if grad.dtype is torch.float16:
                            param.grad = grad = grad.coalesce()
                        grad = grad._values()
                    if type(grad) is not torch.Tensor:  # FSDP2's DTensors: this rank's shard
                        grad = distributed.local(grad)
                    per_device.setdefault(grad.device, []).append(grad)
            found_per_device = {}
            for device, grads in per_device.items():
                flag = found_inf if found_inf.device == device else found_inf.to(device, copy=True)
                kernels.unscale_(grads, inv_scale.to(device), flag)
                found_per_device[device] = flag
            distributed.agree_on_flags(found_per_device, found_inf)
        return found_per_device

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Optional[Any]:
        """Unscale (unless `unscale_` ran) and call ``optimizer.step(*args, **kwargs)``, unless
        the gradients hold inf/NaN; return what it returns, or None for a skipped step.

        Reading the found-inf flags here is the one host sync of an iteration; an optimizer
        that takes them on the device (`_step_supports_amp_scaling`: torch's fused Adam, AdamW
        and SGD) skips there instead, and nothing is read. Call it after every backward of the
        iteration and before `update()`; a closure is not supported.
        """
        if self._enabled and "closure" not in kwargs and self._scale is not None:
            state = self._per_optimizer_states[id(optimizer)]
            fused = getattr(optimizer, "_step_supports_amp_scaling", False)
            if state["stage"] is OptState.READY and not fused:
                self.unscale_(optimizer)
            if state["stage"] is OptState.UNSCALED and not state["found_inf_per_device"]:
                raise ScalerStateError(_no_inf_checks(optimizer))
        return super().step(optimizer, *args, **kwargs)

    def _maybe_opt_step(
        self, optimizer: torch.optim.Optimizer, optimizer_state: Dict[str, Any], *args, **kwargs
    ) -> Optional[Any]:
        if not sum(flag.item() for flag in optimizer_state["found_inf_per_device"].values()):
            return optimizer.step(*args, **kwargs)
        # Skipped: which gradients held inf/NaN, for amp.last_overflow() (the host knows now).
        optimizer_state["skipped"] = overflow.grad_scaler_nonfinite_names(optimizer)
        return None

    def update(self, new_scale: Union[float, int, torch.Tensor, None] = None) -> None:
        """Back off or grow the scale from this iteration's inf checks, or set it to `new_scale`.

        No sync. Call it once per iteration, after `step` for every optimizer. After a skipped
        step it reports the skip (`amp.last_overflow()`, the skip message at verbosity 1) and
        watches the next iteration for where the inf/NaN started.
        """
        if not self._enabled:
            return
        scale, _ = self._check_scale_growth_tracker("update")
        if new_scale is not None:
            if isinstance(new_scale, int) and not isinstance(new_scale, bool):
                new_scale = float(new_scale)
            if not isinstance(new_scale, float) and (
                not isinstance(new_scale, torch.Tensor)
                or new_scale.device.type != scale.device.type
                or new_scale.numel() != 1
                or new_scale.requires_grad
            ):
                raise ScalerValueError(
                    "new_scale should be a float or a 1-element torch.cuda.FloatTensor or "
                    "torch.FloatTensor with requires_grad=False."
                )
            super().update(new_scale)
            return
        states = self._per_optimizer_states.values()
        if not any(state["found_inf_per_device"] for state in states):
            raise ScalerStateError("No inf checks were recorded prior to update.")
        skipped = [state["skipped"] for state in states if "skipped" in state]
        super().update()
        overflow.grad_scaler_update(self, skipped)

    def __getstate__(self) -> Dict[str, Any]:
        if self._enabled and self._per_optimizer_states:
            raise ScalerStateError(
                "A GradScaler instance may only be pickled at the beginning of an iteration, or "
                "at the end after scaler.update()."
            )
        return super().__getstate__()


def _check_options(init_scale, growth_factor, backoff_factor, growth_interval, enabled):
    if growth_factor <= 1.0:
        raise ScalerValueError("The growth factor must be > 1.0.")
    if backoff_factor >= 1.0:
        raise ScalerValueError("The backoff factor must be < 1.0.")
    if not (
        isinstance(init_scale, (int, float))
        and not isinstance(init_scale, bool)
        and init_scale > 0
        and init_scale < float("inf")
    ):
        raise ScalerValueError(f"init_scale must be a finite positive number; got {init_scale!r}.")
    if isinstance(growth_interval, bool) or not isinstance(growth_interval, int):
        raise ScalerValueError(f"growth_interval must be a positive int; got {growth_interval!r}.")
    if growth_interval < 1:
        raise ScalerValueError(f"growth_interval must be a positive int; got {growth_interval!r}.")


def _o2_record(optimizer):
    """The amp record of an optimizer amp.initialize set up with master weights, or None."""
    record = getattr(optimizer, "__dict__", {}).get("_amp_record")
    return record if record is not None and record.owner is not None else None


def _no_inf_checks(optimizer):
    if _o2_record(optimizer) is not None:
        return (
            "No inf checks were recorded for this optimizer: amp.initialize set it up with FP32 "
            "master weights (O2), whose gradients only amp.scale_loss fills. Use `with "
            "amp.scale_loss(loss, optimizer)` and optimizer.step() at O2, or amp.GradScaler "
            "with amp.autocast and no amp.initialize."
        )
    return "No inf checks were recorded for this optimizer."


GradScaler.__init__.__signature__ = _TORCH_FORM

"""GradScaler: torch.amp.GradScaler's API and behaviour, on amp's kernels, on any device.

Given the same inputs it follows the same scale trajectory and produces the same parameters as
`torch.amp.GradScaler`. Differences, all deliberate: the device comes from the tensors scaled
(`GradScaler()` works on CPU instead of disabling itself), `update(new_scale)` accepts an int,
the errors torch raises as AssertionError are also ValueError / RuntimeError, and under
torch.distributed the found-inf flags are reduced across ranks (as torch's ShardedGradScaler
does), with FSDP2's DTensor gradients unscaled through their local shards.
"""

import enum
import inspect
import math
import warnings
from collections import abc, defaultdict

import torch

from .. import distributed, kernels
from .._state import amp_state
from ..diagnostics import overflow


class ScalerValueError(ValueError, AssertionError):
    """A bad value (torch raises AssertionError here; this is both)."""


class ScalerStateError(RuntimeError, AssertionError):
    """A call out of order (torch raises AssertionError here; this is both)."""


class OptState(enum.Enum):
    READY = 0
    UNSCALED = 1
    STEPPED = 2


def _refresh_per_optimizer_state():
    return {"stage": OptState.READY, "found_inf_per_device": {}}


_MISSING_SCALE = (
    "Attempted {} but _scale is None.  This may indicate your script did not use "
    "scaler.scale(loss or outputs) earlier in the iteration."
)


class GradScaler:
    """Dynamic loss scaling for `loss.backward()` training loops, as `torch.amp.GradScaler`.

    Args:
        init_scale (float, default=2.**16): the initial scale.
        growth_factor (float, default=2.0): multiplies the scale after `growth_interval`
            iterations without inf/NaN gradients.
        backoff_factor (float, default=0.5): multiplies the scale after an iteration with them.
        growth_interval (int, default=2000): clean iterations between growths.
        enabled (bool, default=True): False makes every method a pass-through.

    torch.amp's form ``GradScaler("cuda", init_scale, ...)`` is accepted; the device name is only
    checked, since the scaler works on the device of the tensors it scales.

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

    def __init__(self, *args, **kwargs):
        device = kwargs.pop("device", None)
        if args and isinstance(args[0], (str, torch.device)):
            device, args = args[0], args[1:]
        if device is not None:
            torch.device(device)  # raises for a device string torch does not know
        self._device = None if device is None else torch.device(device).type
        self._configure(*args, **kwargs)

    def _configure(
        self,
        init_scale=2.0**16,
        growth_factor=2.0,
        backoff_factor=0.5,
        growth_interval=2000,
        enabled=True,
    ):
        if not isinstance(enabled, bool):
            raise TypeError(f"GradScaler(enabled=...) must be a bool; got {enabled!r}.")
        self._enabled = enabled
        if not enabled:
            return
        if growth_factor <= 1.0:
            raise ScalerValueError("The growth factor must be > 1.0.")
        if backoff_factor >= 1.0:
            raise ScalerValueError("The backoff factor must be < 1.0.")
        if not (
            isinstance(init_scale, (int, float)) and math.isfinite(init_scale) and init_scale > 0
        ):
            raise ScalerValueError(
                f"init_scale must be a finite positive number; got {init_scale!r}."
            )
        if (
            isinstance(growth_interval, bool)
            or not isinstance(growth_interval, int)
            or growth_interval < 1
        ):
            raise ScalerValueError(
                f"growth_interval must be a positive int; got {growth_interval!r}."
            )
        self._init_scale = init_scale
        self._scale = None
        self._growth_factor = growth_factor
        self._backoff_factor = backoff_factor
        self._growth_interval = growth_interval
        self._init_growth_tracker = 0
        self._growth_tracker = None
        self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)

    # -- scale and tracker ---------------------------------------------------------------------

    def _lazy_init_scale_growth_tracker(self, device):
        if self._growth_tracker is not None:
            raise ScalerStateError("_growth_tracker initialized before _scale")
        self._scale = torch.full((), self._init_scale, dtype=torch.float32, device=device)
        self._growth_tracker = torch.full(
            (), self._init_growth_tracker, dtype=torch.int32, device=device
        )

    def _check_scale_growth_tracker(self, funcname):
        if self._scale is None or self._growth_tracker is None:
            raise ScalerStateError(_MISSING_SCALE.format(funcname))
        return self._scale, self._growth_tracker

    def scale(self, outputs):
        """Multiply a tensor, or an iterable of tensors (nested), by the scale factor."""
        if not self._enabled:
            return outputs
        if amp_state.origin_watch.armed:  # the iteration after a skipped step is watched
            amp_state.origin_watch.note_loss(outputs)
        if isinstance(outputs, torch.Tensor):
            if self._scale is None:
                self._lazy_init_scale_growth_tracker(outputs.device)
            return outputs * self._scale.to(device=outputs.device, non_blocking=True)
        copies = {}

        def apply_scale(value):
            if isinstance(value, torch.Tensor):
                if self._scale is None:
                    self._lazy_init_scale_growth_tracker(value.device)
                if value.device not in copies:
                    copies[value.device] = self._scale.to(device=value.device, non_blocking=True)
                return value * copies[value.device]
            if isinstance(value, abc.Iterable):
                scaled = map(apply_scale, value)
                return type(value)(scaled) if isinstance(value, (list, tuple)) else scaled
            raise ValueError("outputs must be a Tensor or an iterable of Tensors")

        return apply_scale(outputs)

    # -- unscale and step ------------------------------------------------------------------------

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        """Unscale the optimizer's gradients; return {device: found_inf tensor}.

        Distributed, the flags are the MAX over all ranks: every rank steps or skips together
        and keeps the same scale (one small collective per call).
        """
        per_device = defaultdict(list)
        with torch.no_grad():
            for group in optimizer.param_groups:
                for param in group["params"]:
                    if param.grad is None:
                        continue
                    if not allow_fp16 and param.grad.dtype == torch.float16:
                        raise ValueError(
                            "Attempting to unscale FP16 gradients. GradScaler unscales "
                            "gradients in place, which loses precision in FP16; keep FP32 "
                            "parameters (autocast) or use amp.initialize(opt_level='O2') for "
                            "FP32 master weights."
                        )
                    grad = param.grad
                    if grad.is_sparse:
                        # Duplicate indices of scaled FP16 values can overflow when summed, so
                        # check the coalesced values.
                        if grad.dtype is torch.float16:
                            param.grad = grad = grad.coalesce()
                        grad = grad._values()
                    if type(grad) is not torch.Tensor:  # FSDP2's DTensors: this rank's shard
                        grad = distributed.local(grad)
                    per_device[grad.device].append(grad)
            found_per_device = {}
            for device, grads in per_device.items():
                flag = found_inf if found_inf.device == device else found_inf.to(device, copy=True)
                kernels.unscale_(grads, inv_scale.to(device), flag)
                found_per_device[device] = flag
            distributed.agree_on_flags(found_per_device, found_inf)
        return found_per_device

    def unscale_(self, optimizer):
        """Divide the optimizer's gradients by the scale (once per optimizer per update())."""
        if not self._enabled:
            return
        self._check_scale_growth_tracker("unscale_")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.UNSCALED:
            raise RuntimeError(
                "unscale_() has already been called on this optimizer since the last update()."
            )
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        # The reciprocal in float64, then float32: exact for powers of two, closest otherwise.
        inv_scale = self._scale.double().reciprocal().float()
        found_inf = torch.full((), 0.0, dtype=torch.float32, device=self._scale.device)
        state["found_inf_per_device"] = self._unscale_grads_(optimizer, inv_scale, found_inf, False)
        state["stage"] = OptState.UNSCALED

    def _check_inf_per_device(self, optimizer):
        scale, _ = self._check_scale_growth_tracker("_check_inf_per_device")
        dummy_inv_scale = torch.full((), 1.0, dtype=torch.float32, device=scale.device)
        found_inf = torch.full((), 0.0, dtype=torch.float32, device=scale.device)
        state = self._per_optimizer_states[id(optimizer)]
        state["found_inf_per_device"] = self._unscale_grads_(
            optimizer, dummy_inv_scale, found_inf, True
        )
        return state["found_inf_per_device"]

    def _found_inf_per_device(self, optimizer):
        return self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]

    def step(self, optimizer, *args, **kwargs):
        """Unscale (unless unscale_ ran) and step, unless the gradients hold inf/NaN.

        Returns what ``optimizer.step`` returns, or None for a skipped step. Reading the overflow
        flag is the one host sync of an iteration.
        """
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        self._check_scale_growth_tracker("step")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        if getattr(optimizer, "_step_supports_amp_scaling", False):
            return self._fused_step(optimizer, state, args, kwargs)
        if state["stage"] is OptState.READY:
            self.unscale_(optimizer)
        if not state["found_inf_per_device"]:
            record = getattr(optimizer, "__dict__", {}).get("_amp_record")
            if record is not None and record.master_pairs:
                raise ScalerStateError(
                    "No inf checks were recorded for this optimizer: amp.initialize set it up "
                    "with FP32 master weights (O2), whose gradients only amp.scale_loss fills. "
                    "Use `with amp.scale_loss(loss, optimizer)` and optimizer.step() at O2, or "
                    "amp.GradScaler with amp.autocast and no amp.initialize."
                )
            raise ScalerStateError("No inf checks were recorded for this optimizer.")
        result = None
        if not sum(flag.item() for flag in state["found_inf_per_device"].values()):
            result = optimizer.step(*args, **kwargs)
        else:
            state["skipped"] = overflow.grad_scaler_nonfinite_names(optimizer)  # for amp.last_overflow()
        state["stage"] = OptState.STEPPED
        return result

    def _fused_step(self, optimizer, state, args, kwargs):
        # Optimizers with `_step_supports_amp_scaling` (fused Adam/AdamW/SGD) unscale and skip
        # on the device from `grad_scale` and `found_inf`: no host sync.
        passes_scaler = "grad_scaler" in inspect.signature(optimizer.step).parameters
        if passes_scaler:
            warnings.warn(
                "GradScaler is going to stop passing itself as a keyword argument to the passed "
                "optimizer. In the near future GradScaler registers `grad_scale: Tensor` and "
                "`found_inf: Tensor` to the passed optimizer and let the optimizer use them "
                "directly.",
                FutureWarning,
                stacklevel=3,
            )
            kwargs = dict(kwargs, grad_scaler=self)
        else:
            if state["stage"] is OptState.READY:
                self._check_inf_per_device(optimizer)
            scale = self._scale
            found_inf = sum(
                flag.to(scale.device, non_blocking=True)
                for flag in state["found_inf_per_device"].values()
            )
            optimizer.grad_scale = (
                getattr(optimizer, "grad_scale", None)
                if state["stage"] is OptState.UNSCALED
                else scale * getattr(optimizer, "grad_scale", 1)
            )
            optimizer.found_inf = found_inf
        result = optimizer.step(*args, **kwargs)
        state["stage"] = OptState.STEPPED
        if not passes_scaler:
            del optimizer.grad_scale
            del optimizer.found_inf
        return result

    def update(self, new_scale=None):
        """Back off or grow the scale from this iteration's inf checks, or set it to `new_scale`."""
        if not self._enabled:
            return
        scale, growth_tracker = self._check_scale_growth_tracker("update")
        if new_scale is not None:
            if isinstance(new_scale, (int, float)) and not isinstance(new_scale, bool):
                scale.fill_(float(new_scale))
            else:
                reason = (
                    "new_scale should be a float or a 1-element torch.cuda.FloatTensor or "
                    "torch.FloatTensor with requires_grad=False."
                )
                if (
                    not isinstance(new_scale, torch.Tensor)
                    or new_scale.device.type != scale.device.type
                    or new_scale.numel() != 1
                    or new_scale.requires_grad
                ):
                    raise ScalerValueError(reason)
                scale.copy_(new_scale)
        else:
            found_infs = [
                flag.to(device=scale.device, non_blocking=True)
                for state in self._per_optimizer_states.values()
                for flag in state["found_inf_per_device"].values()
            ]
            if not found_infs:
                raise ScalerStateError("No inf checks were recorded prior to update.")
            found_inf = found_infs[0]
            for other in found_infs[1:]:
                found_inf = found_inf + other
            torch._amp_update_scale_(
                scale,
                growth_tracker,
                found_inf,
                self._growth_factor,
                self._backoff_factor,
                self._growth_interval,
            )
            skipped = [state.get("skipped") for state in self._per_optimizer_states.values()]
            overflow.grad_scaler_update(self, [names for names in skipped if names is not None])
        self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)

    # -- getters, setters, state -----------------------------------------------------------------

    def _get_scale_async(self):
        return self._scale

    def get_scale(self):
        """The scale as a Python float (1.0 when disabled); a host sync on CUDA."""
        if not self._enabled:
            return 1.0
        return self._init_scale if self._scale is None else self._scale.item()

    def get_growth_factor(self):
        return self._growth_factor

    def set_growth_factor(self, new_factor):
        self._growth_factor = new_factor

    def get_backoff_factor(self):
        return self._backoff_factor

    def set_backoff_factor(self, new_factor):
        self._backoff_factor = new_factor

    def get_growth_interval(self):
        return self._growth_interval

    def set_growth_interval(self, new_interval):
        self._growth_interval = new_interval

    def _get_growth_tracker(self):
        if not self._enabled:
            return 0
        if self._growth_tracker is None:
            return self._init_growth_tracker
        return self._growth_tracker.item()

    def is_enabled(self):
        return self._enabled

    def state_dict(self):
        """{"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"}."""
        if not self._enabled:
            return {}
        return {
            "scale": self.get_scale(),
            "growth_factor": self._growth_factor,
            "backoff_factor": self._backoff_factor,
            "growth_interval": self._growth_interval,
            "_growth_tracker": self._get_growth_tracker(),
        }

    def load_state_dict(self, state_dict):
        if not self._enabled:
            return
        if len(state_dict) == 0:
            raise RuntimeError(
                "The source state dict is empty, possibly because it was saved from a disabled "
                "instance of GradScaler."
            )
        missing = {
            "scale",
            "growth_factor",
            "backoff_factor",
            "growth_interval",
            "_growth_tracker",
        } - set(state_dict)
        if missing:
            raise KeyError(f"GradScaler.load_state_dict: missing {sorted(missing)}")
        self._init_scale = state_dict["scale"]
        self._growth_factor = state_dict["growth_factor"]
        self._backoff_factor = state_dict["backoff_factor"]
        self._growth_interval = state_dict["growth_interval"]
        self._init_growth_tracker = state_dict["_growth_tracker"]
        if self._scale is not None:
            self._scale.fill_(state_dict["scale"])
        if self._growth_tracker is not None:
            self._growth_tracker.fill_(state_dict["_growth_tracker"])

    def __getstate__(self):
        state = self.__dict__.copy()
        if self._enabled:
            if self._per_optimizer_states:
                raise ScalerStateError(
                    "A GradScaler instance may only be pickled at the beginning of an iteration, "
                    "or at the end after scaler.update()."
                )
            # Tensors are re-created on the device of the next scale() input.
            state["_init_scale"] = self.get_scale()
            state["_init_growth_tracker"] = self._get_growth_tracker()
            state["_scale"] = None
            state["_growth_tracker"] = None
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)

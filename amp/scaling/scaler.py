"""LossScaler: static or dynamic loss scaling (apex's rule), its bounds, reads, writes and state
dicts; the dynamic scale lives on the device (device_scale.py, its base, says how)."""

from ..weights.optimizer import holds_scaled
from .device_scale import DeviceScale
from .values import SCALE_FLOOR, check_count, check_loss_scale

__all__ = ["DEFAULT_INIT_SCALE", "DEFAULT_GROWTH_INTERVAL", "LossScaler"]

DEFAULT_INIT_SCALE = 2.0**16
DEFAULT_GROWTH_INTERVAL = 2000  # apex's scale_window


class LossScaler(DeviceScale):
    """One loss scale: static (a fixed float) or dynamic (apex's rule).

    Dynamic: start at min(init_scale, max_loss_scale); on an overflow halve (never below
    min_loss_scale) and restart the count; after `growth_interval` consecutive clean updates
    double (never above max_loss_scale); a non-finite loss changes neither. The state lives on
    the device of the first loss scaled (losses are divided by its inverse scale, gradients
    multiplied); `loss_scale()` waits for the copies of it not yet arrived.
    """

    def __init__(
        self,
        loss_scale,
        min_loss_scale=None,
        max_loss_scale=2.0**24,
        init_scale=DEFAULT_INIT_SCALE,
        growth_interval=DEFAULT_GROWTH_INTERVAL,
    ):
        dynamic = loss_scale == "dynamic"
        self.min_loss_scale = min_loss_scale
        self.max_loss_scale = max_loss_scale
        self._floor = max(min_loss_scale or 0.0, SCALE_FLOOR)  # where a back-off stops
        if dynamic:
            start = init_scale if max_loss_scale is None else min(max_loss_scale, init_scale)
            if min_loss_scale is not None:
                start = max(min_loss_scale, start)
        else:
            start = float(loss_scale)
        super().__init__(dynamic, start, growth_interval, self._floor, max_loss_scale)
        self.is_identity = not dynamic and start == 1.0  # nothing to scale, nothing to check
        # Backward passes a static scaler unscaled: what apex's `_unskipped` counted for it, kept
        # only for amp._amp_state (amp.state_dict() reports 0, see apex_interop/apex_state.py).
        self.static_passes = 0

    @property
    def growth_interval(self):
        return self._host.growth_interval

    @growth_interval.setter
    def growth_interval(self, value):
        self._host.read(wait=True)  # the updates made with the old interval are read first
        self._host.growth_interval = value

    def count_pass(self):
        """Note a backward pass this scaler scaled and unscaled (static scalers only count)."""
        if not self.dynamic:
            self.static_passes += 1

    def set_loss_scale(self, value, what="the loss scale"):
        """Make `value` the scale the next `scale_loss` uses (validated; on error nothing changes)."""
        value = check_loss_scale(value, what)
        low, high = self.min_loss_scale, self.max_loss_scale
        if self.dynamic and not ((low is None or low <= value) and (high is None or value <= high)):
            raise ValueError(
                f"{what} must lie within min_loss_scale={low} and max_loss_scale={high}, the "
                f"bounds of this dynamic scaler (amp.initialize sets them); got {value!r}."
            )
        self.load_state_dict({"loss_scale": value, "unskipped": self.unskipped()})

    def set_unskipped(self, value, what="the count of clean steps"):
        """Make `value` the count apex's `_unskipped` reports: the growth counter of a dynamic
        scaler, the passes of a static one (validated; on error nothing changes)."""
        value = check_count(value, what, self)
        if self.dynamic:
            self.load_state_dict({"loss_scale": self.loss_scale(), "unskipped": value})
        else:
            self.load_state_dict({"loss_scale": self.loss_scale(), "unskipped": 0})
            self.static_passes = value

    def check_can_change(self, what):
        """Raise if gradients scaled by this scaler wait to be unscaled: they would be unscaled
        with the new scale. Changes nothing."""
        if holds_scaled(self):
            raise RuntimeError(
                f"{what}: the loss scale cannot change while gradients scaled by it wait to be "
                "unscaled (inside amp.scale_loss, or between blocks with delay_unscale=True); they "
                "would be unscaled with the new scale. Change it after the block that unscales "
                "them, or after optimizer.step()."
            )

    def loss_scale(self):
        """The current scale as a float, once every update's results have reached the host (it
        waits for those still on their way)."""
        if not self.dynamic:
            return self._init_scale
        self._host.read(wait=True)
        return self._host.scale

    def unskipped(self):
        """Clean updates since the scale last changed (0 for static scalers)."""
        if self.dynamic:
            self._host.read(wait=True)
        return self._host.unskipped

    def state_dict(self):
        # "dynamic" records the scaler's kind, so a load into the other kind is refused; apex's
        # dicts (and amp's before it) lack it and load as before.
        return {
            "loss_scale": self.loss_scale(),
            "unskipped": self.unskipped(),
            "dynamic": self.dynamic,
        }

    def load_state_dict(self, state):
        """Load an entry validated by `check_state` against this scaler (cannot fail)."""
        scale, unskipped = state["loss_scale"], state["unskipped"]
        self._host.reset(scale, unskipped)
        if self.dynamic:
            self._static_inv = {}
            if self._state is not None:  # a new state: the old one may still be held
                self._device_state(self._state.device)
        else:
            self._init_scale = scale
            self.is_identity = scale == 1.0
            self._static_inv = {}

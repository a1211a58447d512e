"""LossScaler: static or dynamic loss scaling, with the scale and its updates kept on the device."""

import math

import torch

from .._state import amp_state

DEFAULT_INIT_SCALE = 2.0**16
DEFAULT_GROWTH_INTERVAL = 2000  # apex's scale_window
# The smallest normal float32. A dynamic scale never goes below it: 1 / scale stays finite, so a
# scale that kept halving cannot reach 0 and turn clean gradients into 0 * inf = NaN.
SCALE_FLOOR = 2.0**-126
_FLOAT32_MAX = torch.finfo(torch.float32).max
_reciprocal = torch.reciprocal  # bound at import, before amp's O1 tables could patch it
_INT32_MAX = 2**31 - 1


class LossScaler:
    """One loss scale: static (a fixed float) or dynamic (apex's rule).

    Dynamic: start at min(init_scale, max_loss_scale); on an overflow halve (never below
    min_loss_scale) and restart the count; after `growth_interval` consecutive clean updates
    double (never above max_loss_scale). The scale and the count live in tensors on the device
    of the first loss scaled, and `update` runs there, so scaling never waits for the GPU.
    """

    def __init__(
        self,
        loss_scale,
        min_loss_scale=None,
        max_loss_scale=2.0**24,
        init_scale=DEFAULT_INIT_SCALE,
        growth_interval=DEFAULT_GROWTH_INTERVAL,
    ):
        self.dynamic = loss_scale == "dynamic"
        self.min_loss_scale = min_loss_scale
        self.max_loss_scale = max_loss_scale
        self._floor = max(min_loss_scale or 0.0, SCALE_FLOOR)  # where a back-off stops
        self.growth_interval = growth_interval
        if self.dynamic:
            start = init_scale if max_loss_scale is None else min(max_loss_scale, init_scale)
            if min_loss_scale is not None:
                start = max(min_loss_scale, start)
        else:
            start = float(loss_scale)
        self._init_scale = start
        self._init_unskipped = 0
        self._scale = None  # float32 0-dim tensor, created on first use (dynamic only)
        # 1 / scale, kept next to it: one op per update, none per unscale. A new tensor at every
        # change, never written in place: a block keeps the one its loss was scaled with.
        self._inv = None
        self._unskipped = None  # int32 0-dim tensor: clean updates since the last change
        self._static_inv = {}  # device -> 1 / scale for static scalers
        # Backward passes a static scaler unscaled: what apex's `_unskipped` counted for it, kept
        # only for amp._amp_state (amp.state_dict() reports 0, see apex_interop/apex_state.py).
        self.static_passes = 0

    @property
    def is_identity(self):
        """True for a static scale of 1.0: nothing to scale, nothing to check."""
        return not self.dynamic and self._init_scale == 1.0

    def _tensors(self, device):
        if self._scale is None:
            self._scale = torch.full((), self._init_scale, dtype=torch.float32, device=device)
            # The reciprocal on the host in float64, then float32 (as torch's GradScaler does).
            self._inv = torch.full((), 1.0 / self._init_scale, dtype=torch.float32, device=device)
            self._unskipped = torch.full((), self._init_unskipped, dtype=torch.int32, device=device)
        return self._scale

    def scale(self, loss):
        """loss.float() * scale."""
        if not self.dynamic:
            return loss.float() * self._init_scale
        device = loss.device
        scale = self._scale if self._scale is not None else self._tensors(device)
        if scale.device != device:
            scale = scale.to(device, non_blocking=True)
        return loss.float() * scale

    def inv_scale(self, device):
        """1 / scale as a float32 1-element tensor on `device`."""
        if not self.dynamic:
            inv = self._static_inv.get(device)
            if inv is None:
                inv = torch.full((), 1.0 / self._init_scale, dtype=torch.float32, device=device)
                self._static_inv[device] = inv
            return inv
        if self._scale is None:
            self._tensors(device)
        inv = self._inv
        return inv if inv.device == device else inv.to(device, non_blocking=True)

    def update(self, flag):
        """Back off or grow according to `flag` (an OverflowFlag), on the device; no sync."""
        if not self.dynamic:
            return
        flag = flag.tensor
        scale = self._scale if self._scale is not None else self._tensors(flag.device)
        found_inf = (
            flag if flag.device == scale.device else flag.to(scale.device, non_blocking=True)
        )
        torch._amp_update_scale_(scale, self._unskipped, found_inf, 2.0, 0.5, self.growth_interval)
        scale.clamp_(min=self._floor, max=self.max_loss_scale)
        # Dynamic scales are powers of two times the start, so float32's reciprocal is exact;
        # for any other value it is the correctly rounded one. torch.reciprocal's original (amp
        # patches nothing it calls here): its own arithmetic stays out of the user's casts and
        # traces.
        self._inv = _reciprocal(scale)

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
        if any(record.stash.holds(self) for record in amp_state.optimizers):
            raise RuntimeError(
                f"{what}: the loss scale cannot change while gradients scaled by it wait to be "
                "unscaled (inside amp.scale_loss, or between blocks with delay_unscale=True); they "
                "would be unscaled with the new scale. Change it after the block that unscales "
                "them, or after optimizer.step()."
            )

    def loss_scale(self):
        """The current scale as a float (reads the device: a sync on CUDA)."""
        return self._init_scale if self._scale is None else self._scale.item()

    def unskipped(self):
        """Clean updates since the scale last changed (0 for static scalers)."""
        return self._init_unskipped if self._unskipped is None else int(self._unskipped.item())

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
        self._init_scale = state["loss_scale"]
        self._init_unskipped = state["unskipped"]
        self._static_inv = {}
        if self._scale is not None:
            self._scale.fill_(self._init_scale)
            self._inv = torch.full_like(self._inv, 1.0 / self._init_scale)
            self._unskipped.fill_(self._init_unskipped)


def _number(value, what):
    """A Python number from `value` (a number, a NumPy scalar or a one-element tensor), or a
    clear error."""
    if type(value).__module__ == "numpy" and hasattr(value, "item"):
        value = value.item()
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(
                f"{what} must be a finite positive number, not a tensor of shape "
                f"{tuple(value.shape)}; expected a number (or a one-element tensor)."
            )
        value = value.item()
    return value


def check_loss_scale(value, what):
    """`value` as a float if it is a loss scale a float32 holds as a normal number (the range
    every scale amp keeps lies in); else a ValueError naming `what`. Changes nothing."""
    value = _number(value, what)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{what} must be a finite positive number; got {value!r}.")
    if isinstance(value, int) and abs(value) > _FLOAT32_MAX:  # float(10**400) would overflow
        raise ValueError(
            f"{what} must be a finite positive number that float32 holds: got an int of "
            f"{value.bit_length()} bits{', negative' if value < 0 else ''}, beyond float32's "
            f"largest value {_FLOAT32_MAX!r}."
        )
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{what} must be a finite positive number; got {value!r}.")
    if not SCALE_FLOOR <= value <= _FLOAT32_MAX:
        raise ValueError(
            f"{what} must be a finite positive number that float32 holds: {value!r} does not fit "
            f"a float32 loss scale (from {SCALE_FLOOR!r} to {_FLOAT32_MAX!r})."
        )
    return float(value)


def check_count(value, what, scaler=None):
    """`value` as an int if it is a count of clean steps `scaler` can hold, else a ValueError
    naming `what`; changes nothing. A dynamic scaler's count stays below its growth interval (it
    restarts there; one above would never grow the scale and would run past int32); any count
    fits int32."""
    count = _number(value, what)
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ValueError(f"{what} must be a non-negative int; got {value!r}.")
    if count > _INT32_MAX:
        raise ValueError(
            f"{what} = {count} does not fit the int32 count of clean steps (at most "
            f"{_INT32_MAX}); a count that large cannot come from training."
        )
    if scaler is not None and scaler.dynamic and count >= scaler.growth_interval:
        raise ValueError(
            f"{what} = {count}: a dynamic loss scaler counts clean steps up to its growth "
            f"interval ({scaler.growth_interval}), where it doubles the scale and restarts from "
            f"0; expected 0 to {scaler.growth_interval - 1}."
        )
    return count


def check_state(key, state, scaler=None):
    """The entry `state` ({"loss_scale", "unskipped"}) as it will be stored, or a clear error.

    Every value must fit the float32 / int32 tensors it is written into, so that loading cannot
    fail half-way. Given the `scaler` it is for, a static scaler accepts only its own scale: a
    static scale is configuration, and a checkpoint's other value (a dynamic run's 65536 into
    O3's 1.0) would be applied unchecked.
    """
    if not isinstance(state, dict):
        raise TypeError(
            f"amp.load_state_dict: entry {key!r} must be a dict with keys 'loss_scale' and "
            f"'unskipped'; got {type(state).__name__}."
        )
    missing = {"loss_scale", "unskipped"} - set(state)
    if missing:
        raise ValueError(f"amp.load_state_dict: entry {key!r} lacks {sorted(missing)}.")
    scale = check_loss_scale(state["loss_scale"], f"amp.load_state_dict: {key!r}['loss_scale']")
    unskipped = check_count(state["unskipped"], f"amp.load_state_dict: {key!r}['unskipped']")
    dynamic = state.get("dynamic")
    if dynamic is not None and not isinstance(dynamic, bool):
        raise ValueError(
            f"amp.load_state_dict: {key!r}['dynamic'] must be True or False; got {dynamic!r}."
        )
    if scaler is not None and dynamic and not scaler.dynamic:
        raise ValueError(
            f"amp.load_state_dict: {key!r} comes from a dynamic loss scaler, but this run's is "
            "static: its scale would be taken for this run's, unchecked. Initialize with "
            "loss_scale='dynamic' to continue from it, or leave the amp state out of the load."
        )
    scale = torch.tensor(scale, dtype=torch.float32).item()  # what the scaler will hold
    # A static run resumed with loss_scale="dynamic" (as apex did): the dynamic scale starts at
    # the checkpoint's, within this scaler's bounds, and counts clean steps from zero. apex's
    # dicts carry no kind; a count past the growth interval shows a static one (it counted every
    # pass), while a dynamic scaler restarts its count there.
    from_static = (
        scaler is not None
        and scaler.dynamic
        and (dynamic is False or (dynamic is None and unskipped >= scaler.growth_interval))
    )
    if from_static:
        low, high = scaler.min_loss_scale, scaler.max_loss_scale
        if not ((low is None or low <= scale) and (high is None or scale <= high)):
            raise ValueError(
                f"amp.load_state_dict: {key!r} holds the static loss scale {scale}, outside "
                f"min_loss_scale={low} and max_loss_scale={high} of this dynamic scaler. Pass "
                "bounds that include it to amp.initialize, or leave the amp state out of the load."
            )
        unskipped = 0
    elif scaler is not None:
        check_count(unskipped, f"amp.load_state_dict: {key!r}['unskipped']", scaler)
    if scaler is not None and not scaler.dynamic and scale != scaler._init_scale:
        raise ValueError(
            f"amp.load_state_dict: {key!r} has loss scale {scale}, but this run uses the static "
            f"loss scale {scaler._init_scale}, which a checkpoint never replaces ("
            + (
                "the checkpoint comes from a static run with another scale"
                if dynamic is False
                else "the checkpoint does not say whether its scaler was static or dynamic"
            )
            + "). To continue with the checkpoint's scale, call "
            f"amp.initialize(..., loss_scale='dynamic') or loss_scale={scale}; or leave the amp "
            "state out of the load."
        )
    return {"loss_scale": scale, "unskipped": int(unskipped), "from_static": from_static}

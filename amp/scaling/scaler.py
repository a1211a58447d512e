"""LossScaler: static or dynamic loss scaling, with the scale and its updates kept on the device."""

import math

import torch

from .._state import amp_state
from .checks import FLOAT32_MAX, INV, STATE_LENGTH, Check, HostScale, float32, new_state

__all__ = [
    "DEFAULT_INIT_SCALE",
    "DEFAULT_GROWTH_INTERVAL",
    "SCALE_FLOOR",
    "LossScaler",
    "check_loss_scale",
    "check_count",
    "check_state",
]

DEFAULT_INIT_SCALE = 2.0**16
DEFAULT_GROWTH_INTERVAL = 2000  # apex's scale_window
# The smallest normal float32. A dynamic scale never goes below it: 1 / scale stays finite, so a
# scale that kept halving cannot reach 0 and turn clean gradients into 0 * inf = NaN.
SCALE_FLOOR = 2.0**-126
_INT32_MAX = 2**31 - 1


class LossScaler:
    """One loss scale: static (a fixed float) or dynamic (apex's rule).

    Dynamic: start at min(init_scale, max_loss_scale); on an overflow halve (never below
    min_loss_scale) and restart the count; after `growth_interval` consecutive clean updates
    double (never above max_loss_scale). A non-finite loss changes neither the scale nor the
    count (checks.py says why).

    The device holds a small state on the device of the first loss scaled (checks.py): the
    inverse scale (losses are divided by it, gradients multiplied), the count, and a block's
    flags, so that an update is a few ops on the device and nothing waits for it. Each checked
    block's update runs on a state of its own, made from the last (open_check), so the inverse
    scale a loss was scaled with is never written again. The host learns the scale and count from
    each block's copy once it has arrived (checks.HostScale); `loss_scale()` waits for the copies
    not yet arrived.
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
        if self.dynamic:
            start = init_scale if max_loss_scale is None else min(max_loss_scale, init_scale)
            if min_loss_scale is not None:
                start = max(min_loss_scale, start)
        else:
            start = float(loss_scale)
        self._init_scale = start
        self.is_identity = not self.dynamic and start == 1.0  # nothing to scale, nothing to check
        # Where an update clamps the inverse scale: 1/max_loss_scale (without one, 2**-127, whose
        # inverse float32 still holds) and 1/floor.
        self._inv_bounds = (
            float32(1.0 / max_loss_scale) if max_loss_scale is not None else 2.0**-127,
            float32(1.0 / self._floor),
        )
        self._host = HostScale(start, 0, growth_interval, self._floor, max_loss_scale)
        # The device state (checks.py) the next block starts from, made on first use, and a view
        # of its inverse scale (what losses are scaled by)
        self._state = self._inv = None
        self._keep = None  # on the state's device: the int32 mask that copies scale and count
        self._hosts = []  # host memory for the copies of the state, reused in turn
        self._host_checks = []  # the check whose copy each holds
        self._next_host = -1
        self._static_inv = {}  # device -> 1 / scale for static scalers
        self._scratch = {}  # device -> a flag nobody reads (static scalers never skip)
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

    def _device_state(self, device):
        host = self._host
        state = self._state = new_state(host.inv, host.unskipped, device)
        self._inv = state.view(torch.float32)[INV]
        keep = torch.tensor([1, 1] + [0] * (STATE_LENGTH - 2), dtype=torch.int32)
        self._keep = keep.to(device)
        return state

    def scale(self, loss):
        """loss.float() * scale (dynamic: divided by the inverse, the same for a power of two)."""
        if not self.dynamic:
            return loss.float() * self._init_scale
        inv = self._inv if self._state is not None else self.inv_scale(loss.device)
        if inv.device != loss.device:
            inv = inv.to(loss.device, non_blocking=True)
        return loss.float() / inv

    def inv_scale(self, device):
        """1 / scale as a float32 0-dim tensor on `device`. A dynamic scaler's is a view of the
        state the next block starts from, never written once a block has used it."""
        if not self.dynamic:
            inv = self._static_inv.get(device)
            if inv is None:
                inv = torch.full((), 1.0 / self._init_scale, dtype=torch.float32, device=device)
                self._static_inv[device] = inv
            return inv
        if self._state is None:
            self._device_state(device)
        inv = self._inv
        return inv if inv.device == device else inv.to(device, non_blocking=True)

    def scratch_flag(self, device):
        """A float32 flag for unscaling whose overflow nobody reads (static scalers)."""
        flag = self._scratch.get(device)
        if flag is None:
            flag = self._scratch[device] = torch.zeros((), dtype=torch.float32, device=device)
        return flag

    def open_check(self, loss_id, device):
        """A Check for the block about to unscale, on a state of its own: the last state's scale
        and count, its flags cleared (one op). Its update then changes nothing an earlier block
        or a step still to come holds."""
        state = self._state if self._state is not None else self._device_state(device)
        state = self._state = torch.mul(state, self._keep)
        check = Check(loss_id, self._host, state)
        self._inv = check.inv
        return check

    def update(self, check, loss):
        """Back off or grow by what `check`'s block found, on the device; no sync. A non-finite
        `loss` keeps scale and count (checks.py): the overflow it caused is not counted
        (effective) and the count the update adds is taken back first. Every rank agrees on the
        flags first. Then the copy of the state to the host."""
        check.note_loss(loss)
        check.agree()
        inv, known = check.inv, self._host
        torch.gt(check.found, check.bad, out=check.effective)
        check.tracker.sub_(check.bad)
        # The scale's rule on its inverse: a back-off doubles it, a growth halves it.
        torch._amp_update_scale_(
            inv, check.tracker, check.effective, 0.5, 2.0, known.growth_interval
        )
        if known.may_reach_a_bound():  # else the clamp could change nothing: left out
            inv.clamp_(*self._inv_bounds)
        # Host memory for the copy: a few buffers reused in turn, the oldest once read.
        hosts = self._hosts
        if len(hosts) < _HOST_COPIES:
            host = torch.empty(STATE_LENGTH, dtype=torch.int32, pin_memory=inv.is_cuda)
            host = (host, host.view(torch.float32))
            hosts.append(host)
            self._host_checks.append(check)
        else:
            slot = self._next_host = (self._next_host + 1) % _HOST_COPIES
            host = hosts[slot]
            if not self._host_checks[slot].learned:
                known.read(wait=True)  # a copy that old: read before it is overwritten
            self._host_checks[slot] = check
        check.post(host)

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
        """The current scale as a float: the host's mirror, once every update's results have
        reached the host (it waits for those still on their way)."""
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


_HOST_COPIES = 4  # copies of a scaler's state on their way to the host at most


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
    if isinstance(value, int) and abs(value) > FLOAT32_MAX:  # float(10**400) would overflow
        raise ValueError(
            f"{what} must be a finite positive number that float32 holds: got an int of "
            f"{value.bit_length()} bits{', negative' if value < 0 else ''}, beyond float32's "
            f"largest value {FLOAT32_MAX!r}."
        )
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{what} must be a finite positive number; got {value!r}.")
    if not SCALE_FLOOR <= value <= FLOAT32_MAX:
        raise ValueError(
            f"{what} must be a finite positive number that float32 holds: {value!r} does not fit "
            f"a float32 loss scale (from {SCALE_FLOOR!r} to {FLOAT32_MAX!r})."
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
    scale = float32(scale)  # what the scaler will hold
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

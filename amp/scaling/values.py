"""What a loss scale and a count of clean steps may be: the checks every value a scaler takes
passes before anything changes (amp.initialize's loss_scale, amp.load_state_dict, apex's
`_loss_scale` and `_unskipped` setters), and the float32 rounding they are held in."""

import math

import torch

__all__ = [
    "SCALE_FLOOR",
    "FLOAT32_MAX",
    "float32",
    "check_loss_scale",
    "check_count",
    "check_state",
]

# The smallest normal float32. A dynamic scale never goes below it: 1 / scale stays finite, so a
# scale that kept halving cannot reach 0 and turn clean gradients into 0 * inf = NaN.
SCALE_FLOOR = 2.0**-126
FLOAT32_MAX = torch.finfo(torch.float32).max
INT32_MAX = 2**31 - 1


def float32(value):
    """`value` rounded to float32 (nearest even), as a Python float."""
    return torch.tensor(value, dtype=torch.float32).item()


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
    if count > INT32_MAX:
        raise ValueError(
            f"{what} = {count} does not fit the int32 count of clean steps (at most "
            f"{INT32_MAX}); a count that large cannot come from training."
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

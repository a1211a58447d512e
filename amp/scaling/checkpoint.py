"""amp.state_dict / amp.load_state_dict: the loss scalers' state in apex's checkpoint format."""

import collections
import re
import warnings
from collections.abc import Mapping
from typing import Any

from .._state import amp_state, logger
from ..weights.optimizer import learn_skips
from .values import check_state

__all__ = ["state_dict", "load_state_dict"]

_SCALER_KEY = re.compile(r"loss_scaler(\d+)\Z")


def _check_initialized(caller):
    if not amp_state.initialized:
        raise RuntimeError(f"{caller} needs amp.initialize(...) to have been called first.")


def state_dict(destination: dict[str, Any] | None = None) -> dict[str, Any]:
    """The loss scalers' state: {"loss_scaler0": {"loss_scale": float, "unskipped": int}, ...}.

    Plain Python values only (readable with ``torch.load(..., weights_only=True)``); apex's format.
    """
    _check_initialized("amp.state_dict()")
    learn_skips()  # the skips not learned yet are reported first
    if destination is None:
        destination = collections.OrderedDict()
    for index, scaler in enumerate(amp_state.loss_scalers):
        destination[f"loss_scaler{index}"] = scaler.state_dict()
    return destination


def load_state_dict(state_dict: Mapping[str, Any]) -> None:
    """Load what `amp.state_dict()` (or apex's) saved. A malformed dict raises and loads nothing."""
    _check_initialized("amp.load_state_dict()")
    if not amp_state.enabled:
        return
    if not isinstance(state_dict, collections.abc.Mapping):
        raise TypeError(
            f"amp.load_state_dict expects the dict amp.state_dict() returned; got "
            f"{type(state_dict).__name__}."
        )
    unexpected = [
        key for key in state_dict if not (isinstance(key, str) and _SCALER_KEY.match(key))
    ]
    if unexpected:
        raise RuntimeError(
            "Error(s) in loading state_dict. Unexpected key(s) in state_dict: "
            + ", ".join(f'"{key}"' for key in unexpected)
            + ". "
        )
    scalers = amp_state.loss_scalers
    indices = {key: int(_SCALER_KEY.match(key).group(1)) for key in state_dict}
    named = {}
    for key, index in indices.items():
        if named.setdefault(index, key) != key:
            raise RuntimeError(
                f"Error(s) in loading state_dict. Keys {named[index]!r} and {key!r} both name "
                f"loss scaler {index}; one of them would silently win. amp.state_dict() writes "
                f"'loss_scaler{index}': keep that one."
            )
    # Validate every entry, then write: a load either happens completely or changes nothing.
    entries = {
        index: check_state(key, state_dict[key], scalers[index] if index < len(scalers) else None)
        for key, index in indices.items()
    }
    for index in entries:
        if index < len(scalers):
            scalers[index].check_can_change("amp.load_state_dict")
    if len(entries) != len(scalers):
        warnings.warn(
            f"state_dict contains {len(entries)} entries, while {len(scalers)} loss_scalers are used",
            stacklevel=2,
        )
    for index, entry in sorted(entries.items()):
        if index >= len(scalers):
            warnings.warn(
                f"Skipping loss_scaler[{index}], since num_losses was set to {len(scalers)}",
                stacklevel=2,
            )
            continue
        scalers[index].load_state_dict(entry)
        if entry["from_static"]:
            logger.info(
                "amp.load_state_dict: loss_scaler%d comes from a static loss scale; this run's "
                "dynamic loss scaler starts from it (%s).",
                index,
                entry["loss_scale"],
            )

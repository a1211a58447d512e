"""torch's own autocast state (its thread-local C++ flags), read through the functions amp found
at import, before it patches the Python names that report amp's state instead."""

import torch

from .casts import DEVICE_TYPES

__all__ = ["is_enabled", "any_enabled", "switch_off", "restore"]

is_enabled = torch.is_autocast_enabled
any_enabled = torch._C._is_any_autocast_enabled
_set_enabled = torch.set_autocast_enabled


def switch_off(device_type):
    """Turn torch's own autocast off on `device_type` (None: cpu and cuda) where it is on; return
    the devices switched, for `restore`."""
    devices = DEVICE_TYPES if device_type is None else (device_type,)
    switched = tuple(device for device in devices if is_enabled(device))
    for device in switched:
        _set_enabled(device, False)
    return switched


def restore(switched):
    for device in switched:
        _set_enabled(device, True)

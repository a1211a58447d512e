"""amp: automatic mixed precision for PyTorch, with apex.amp's API and torch.amp's, undoable."""

from . import torch_patches as _torch_patches  # noqa: F401  (sets up the shared patch set)
from .apex_compat import apex_amp_state as _amp_state  # noqa: F401  (apex compatibility)
from .autocast import autocast, custom_bwd, custom_fwd, disable_casts
from .diagnostics import last_overflow, trace
from .frontend import deinitialize, initialize, load_state_dict, master_params, state_dict
from .grad_scaler import GradScaler
from .handle import scale_loss
from .registration import (
    float_function,
    half_function,
    promote_function,
    register_float_function,
    register_half_function,
    register_promote_function,
)

__version__ = "0.1.0"

__all__ = [
    # front end (apex.amp)
    "initialize",
    "deinitialize",
    "scale_loss",
    "disable_casts",
    "master_params",
    "state_dict",
    "load_state_dict",
    # registration
    "half_function",
    "float_function",
    "promote_function",
    "register_half_function",
    "register_float_function",
    "register_promote_function",
    # torch.amp-style API
    "autocast",
    "custom_fwd",
    "custom_bwd",
    "GradScaler",
    # diagnostics
    "trace",
    "last_overflow",
]
# Not public: amp.kernels (stable interface, used by amp itself), LossScaler, PatchLedger.
# amp._amp_state is apex's internal state object for scripts that use it (amp/apex_compat.py).

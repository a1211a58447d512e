"""amp: automatic mixed precision for PyTorch, with apex.amp's API and torch.amp's, undoable."""

from .casting import torch_patches as _torch_patches  # noqa: F401  (sets up the shared patch set)
from .casting.autocast import autocast, custom_bwd, custom_fwd, disable_casts
from .casting.registration import (
    float_function,
    half_function,
    promote_function,
    register_float_function,
    register_half_function,
    register_promote_function,
)
from .casting.trace import trace
from .compat.apex_state import apex_amp_state as _amp_state  # noqa: F401  (apex compatibility)
from .compat.real_apex import warn_if_real_apex_amp as _warn_if_real_apex_amp
from .diagnostics.audit import audit
from .frontend import deinitialize, initialize, load_state_dict, master_params, state_dict
from .scaling.grad_scaler import GradScaler
from .scaling.handle import scale_loss
from .scaling.nonfinite_loss import NonFiniteLossWarning
from .scaling.overflow import last_overflow

__version__ = "0.1.0"

_warn_if_real_apex_amp()  # never shadowed silently by an apex that has its own apex.amp

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
    "NonFiniteLossWarning",
    "audit",
]
# Not public: amp.kernels (stable interface, used by amp itself), LossScaler, PatchLedger.
# amp._amp_state is apex's internal state object for scripts that use it (amp/compat/apex_state.py).

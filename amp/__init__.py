"""amp: automatic mixed precision for PyTorch, with apex.amp's API and torch.amp's, undoable."""

from . import _state
from .apex_interop.apex_state import apex_amp_state as _amp_state  # noqa: F401  (apex compatibility)
from .apex_interop.real_apex import warn_if_real_apex_amp as _warn_if_real_apex_amp
from .casting import casts as _casts
from .casting import native_autocast as _native_autocast
from .casting import torch_patches as _torch_patches
from .casting.autocast import autocast, custom_bwd, custom_fwd, disable_casts
from .casting.registration import (
    float_function,
    half_function,
    promote_function,
    register_float_function,
    register_half_function,
    register_promote_function,
)
from .diagnostics import origin as _origin
from .auditing.audit import audit
from .diagnostics.nonfinite_loss import NonFiniteLossWarning
from .diagnostics.trace import trace
from .frontend import (
    deinitialize,
    initialize,
    last_overflow,
    load_state_dict,
    master_params,
    state_dict,
)
from .scaling.grad_scaler import GradScaler
from .scaling.handle import scale_loss

__version__ = "0.1.0"

# The one place amp's global state is made: the objects of the layers, given to the state.
_state.amp_state.build(
    cast_cache=_casts.WeightCastCache(),
    torch_patches=_torch_patches.TorchPatches(),
    origin_watch=_origin.OriginWatch(),
    policy_written=_native_autocast.policy_written,
)

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
# amp._amp_state is apex's internal state object for scripts that use it (amp/apex_interop/apex_state.py).

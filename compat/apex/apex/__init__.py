"""apex's import names, backed by amp: for code written for NVIDIA apex that you cannot edit.

This is not NVIDIA's apex. `apex.amp` is the `amp` module itself (one state: `apex.amp is amp`);
the other subpackages map apex's names to torch with apex's semantics, or raise a clear error
naming the replacement where they do not. amp's docs/migrating-from-apex.md ("Code you cannot
edit") lists every name and argument.
"""

import amp

if not (hasattr(amp, "initialize") and hasattr(amp, "_amp_state")):
    raise ImportError(
        f"apex (amp's compatibility package) needs the mixed-precision library `amp`, but the "
        f"`amp` found at {getattr(amp, '__file__', '?')} is a different package (the name `amp` "
        "on PyPI belongs to an unrelated library). Install amp from its repository "
        "(`pip install .` in it) and import again."
    )

from . import _amp_alias, _shadowing  # noqa: E402
from ._ignored import ApexCompatWarning  # noqa: E402

_amp_alias.install()

from . import fp16_utils, multi_tensor_apply, normalization, optimizers, parallel  # noqa: E402

_shadowing.warn_about_other_apex(__path__)

__all__ = [
    "ApexCompatWarning",
    "amp",
    "fp16_utils",
    "multi_tensor_apply",
    "normalization",
    "optimizers",
    "parallel",
]

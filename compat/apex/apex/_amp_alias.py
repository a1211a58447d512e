"""`apex.amp` is the `amp` module, and `apex.amp.<module>` imports that apex code used resolve to
amp's objects.

apex code imports `from apex.amp._amp_state import _amp_state`, `from apex.amp.frontend import
state_dict`, `from apex.amp.handle import scale_loss`, `from apex.amp.amp import half_function`.
Each of these modules is registered in sys.modules as a small module holding amp's own objects,
so the import system never loads a second copy of amp's files under another name (which would
split its state). Any other `apex.amp.<name>` raises ModuleNotFoundError saying what exists.
"""

import importlib.abc
import sys
import types

import amp

# apex.amp's submodule -> the names apex code imports from it (all of them are amp's).
SUBMODULES = {
    "_amp_state": ("_amp_state", "master_params"),
    "frontend": ("initialize", "state_dict", "load_state_dict"),
    "handle": ("scale_loss", "disable_casts"),
    "amp": (
        "half_function",
        "float_function",
        "promote_function",
        "register_half_function",
        "register_float_function",
        "register_promote_function",
    ),
}


class _RefuseOtherSubmodules(importlib.abc.MetaPathFinder):
    """Stops `import apex.amp.X` from reaching amp's __path__ (a second copy of amp's modules)."""

    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith("apex.amp."):
            return None
        raise ModuleNotFoundError(
            f"No module named {fullname!r}: in amp's apex compatibility package `apex.amp` is "
            f"the `amp` module, and the apex.amp modules provided are "
            f"{', '.join('apex.amp.' + name for name in SUBMODULES)}. Import the name from "
            "`apex.amp` (or `amp`) itself.",
            name=fullname,
        )


def install():
    """Register `apex.amp` and its submodules; idempotent."""
    sys.modules["apex.amp"] = amp
    for name, attributes in SUBMODULES.items():
        module = types.ModuleType(f"apex.amp.{name}", f"apex.amp.{name}, served by amp.")
        for attribute in attributes:
            setattr(module, attribute, getattr(amp, attribute))
        sys.modules[module.__name__] = module
    if not any(isinstance(finder, _RefuseOtherSubmodules) for finder in sys.meta_path):
        sys.meta_path.insert(0, _RefuseOtherSubmodules())

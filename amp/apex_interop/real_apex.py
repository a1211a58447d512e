"""Which `apex` an `import apex` would give: amp's compatibility package (compat/apex), another
apex (NVIDIA's), or none; and a warning at `import amp` when it is an apex with its own
apex.amp, whose state is not amp's (`from apex import amp` there gives that amp, not this one).

Looked up with importlib.util.find_spec, which locates a top-level package without running it.
amp's compatibility package is recognised by its module `_amp_alias.py` (NVIDIA's apex has none;
the compatibility package has no `amp/` folder).
"""

import importlib.metadata
import importlib.util
import os
import warnings

__all__ = ["COMPAT_MARKER", "apex_location", "is_compat", "describe", "warn_if_real_apex_amp"]

COMPAT_MARKER = "_amp_alias.py"  # compat/apex/apex/_amp_alias.py


def apex_location():
    """The folder of the package `import apex` would import, or None."""
    try:
        spec = importlib.util.find_spec("apex")
    except (ImportError, ValueError):  # a broken sys.path entry, or apex.__spec__ unset
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return os.path.realpath(list(spec.submodule_search_locations)[0])


def is_compat(location):
    return os.path.isfile(os.path.join(location, COMPAT_MARKER))


def _installed_version():
    try:
        return importlib.metadata.version("apex")
    except importlib.metadata.PackageNotFoundError:
        return "no installed metadata"


def describe():
    """One line for `python -m amp`."""
    location = apex_location()
    if location is None:
        return "apex compatibility package: not installed (pip install ./compat/apex)"
    if is_compat(location):
        return (
            f"apex compatibility package: installed (apex {_installed_version()} at {location}; "
            "apex.amp is amp)"
        )
    own_amp = " with its own apex.amp" if os.path.isdir(os.path.join(location, "amp")) else ""
    return (
        f"apex compatibility package: not installed; `import apex` gives another apex "
        f"({_installed_version()}) at {location}{own_amp}"
    )


def warn_if_real_apex_amp():
    """Warn, at `import amp`, when `import apex` would give an apex with its own apex.amp."""
    location = apex_location()
    if location is None or is_compat(location):
        return
    if not os.path.isdir(os.path.join(location, "amp")):
        return
    warnings.warn(
        f"an apex with its own apex.amp is importable ({location}): `from apex import amp` "
        "gives that apex's amp, which is not this amp and does not share its state. Import amp "
        "(`import amp`) in your own code; for code you cannot edit, replace that apex with "
        "amp's compatibility package: `pip uninstall apex`, then `pip install ./compat/apex` "
        "from amp's repository.",
        UserWarning,
        stacklevel=3,
    )

"""Never shadow a real apex silently: warn when another `apex` package is on sys.path too."""

import os
import sys
import warnings


def other_apex_locations(own_path):
    """Directories of other `apex` packages on sys.path, besides this one."""
    own = {os.path.realpath(entry) for entry in own_path}
    found = []
    for entry in sys.path:
        candidate = os.path.join(entry or os.getcwd(), "apex")
        if os.path.isfile(os.path.join(candidate, "__init__.py")):
            real = os.path.realpath(candidate)
            if real not in own and real not in found:
                found.append(real)
    return found


def warn_about_other_apex(own_path):
    others = other_apex_locations(own_path)
    if others:
        warnings.warn(
            f"`import apex` imported amp's apex compatibility package ({own_path[0]}), which "
            f"shadows another apex package at {', '.join(others)}: its code (fused CUDA "
            "kernels, apex.contrib, ...) is not used. To use that apex instead, uninstall this "
            "one (`pip uninstall apex`) or put the other first on sys.path; to keep this one, "
            "remove the other from sys.path.",
            UserWarning,
            stacklevel=3,
        )

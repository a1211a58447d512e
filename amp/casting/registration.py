"""User extensions of the casting tables: decorators, and registration of functions by name."""

from collections.abc import Callable
from types import ModuleType
from typing import Any

from .._state import amp_state
from ..lists import FP32, LOWER_PRECISION, PROMOTE
from .wrappers import make_wrapper

__all__ = [
    "half_function",
    "float_function",
    "promote_function",
    "register_half_function",
    "register_float_function",
    "register_promote_function",
]


def _decorator(kind: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        if not callable(fn):
            raise TypeError(f"amp can only decorate a callable; got {fn!r}.")
        name = getattr(fn, "__qualname__", getattr(fn, "__name__", repr(fn)))
        return make_wrapper(fn, kind, name)

    return decorate


half_function = _decorator(LOWER_PRECISION)
half_function.__doc__ = """Decorator: the function runs in the low-precision dtype wherever amp casts
(O1, autocast regions), and untouched elsewhere.

Example::

    @amp.half_function
    def fused_gelu_linear(x, weight, bias): ...
"""
half_function.__name__ = "half_function"

float_function = _decorator(FP32)
float_function.__doc__ = """Decorator: the function runs in FP32 wherever amp casts."""
float_function.__name__ = "float_function"

promote_function = _decorator(PROMOTE)
promote_function.__doc__ = """Decorator: the function runs in the widest floating type of its
tensor arguments wherever amp casts."""
promote_function.__name__ = "promote_function"


def _register(module: ModuleType | type, name: str, kind: str) -> None:
    if not isinstance(name, str):
        raise TypeError(f"the function name must be a string; got {name!r}.")
    if not hasattr(module, name):
        raise ValueError(f"No function named {name} in module {module}.")
    with amp_state.lock:
        amp_state.user_registrations[(module, name)] = kind
        amp_state.torch_patches.refresh()


def register_half_function(module: ModuleType | type, name: str) -> None:
    """Patch `module.name` to run in the low-precision dtype wherever amp casts.

    Registrations take effect at once if amp's patches are installed, else when they next are;
    they outlive `amp.deinitialize()`. The latest registration of a name wins, and it overrides
    amp's own table for that name.

    Example::

        amp.register_half_function(my_extension, "fused_attention")
    """
    _register(module, name, LOWER_PRECISION)


def register_float_function(module: ModuleType | type, name: str) -> None:
    """Patch `module.name` to run in FP32 wherever amp casts (see register_half_function)."""
    _register(module, name, FP32)


def register_promote_function(module: ModuleType | type, name: str) -> None:
    """Patch `module.name` to run in the widest floating type of its tensor arguments."""
    _register(module, name, PROMOTE)

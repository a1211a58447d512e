"""TorchScript sees torch's own functions where amp's wrappers stand.

`torch.jit.script` resolves a call such as `F.linear(...)` by asking, of the object the name
holds: is it a builtin op (`_find_builtin`), a boolean-dispatch function
(`_try_get_dispatched_fn`), an overloaded function (`_get_overloads`), or one to compile from its
source (`try_compile_fn`)? An amp wrapper is none of these to torch, so scripting read the
wrapped builtin's source through `__wrapped__` and failed with inspect's TypeError, and the
failure left half-built types in torch.jit's caches ("Can't redefine method: forward" on the next
attempt, even after `amp.deinitialize()`).

While amp's patches are installed these questions are patched too, through the same ledger: for
an amp wrapper they answer what they answer for its original. Scripted code therefore calls
torch's ops without amp's casting (TorchScript cannot call Python wrappers), and torch.jit caches
only what it compiled from torch's functions, so scripting works the same after deinitialize.
"""

import functools
from typing import Callable

import torch.jit._builtins
import torch.jit._recursive
import torch.jit._script
from torch import _jit_internal

from ..patching import ORIGINAL_ATTRIBUTE, is_amp_replacement

__all__ = ["patches"]

# (module, name) of each question; C++ looks each up by module and name at every use, and
# torch.jit._recursive imported `_find_builtin` by name (for functions held by module attributes).
_RESOLVERS = (
    (torch.jit._builtins, "_find_builtin"),
    (torch.jit._recursive, "_find_builtin"),
    (_jit_internal, "_try_get_dispatched_fn"),
    (torch.jit._script, "_get_overloads"),
    (torch.jit._recursive, "try_compile_fn"),
)


def patches() -> list[tuple[object, str, Callable[[Callable], Callable]]]:
    """(module, name, make_replacement) for each of TorchScript's questions in this torch."""
    # torch.jit builds its builtin table on first use from torch's namespaces: built while amp's
    # wrappers stand there, it would hold the wrappers and lose torch's functions for good.
    torch.jit._builtins._get_builtin_table()
    return [
        (module, name, _seeing_originals) for module, name in _RESOLVERS if hasattr(module, name)
    ]


def _seeing_originals(resolver: Callable) -> Callable:
    @functools.wraps(resolver)
    def resolve(obj, *args, **kwargs):
        original = getattr(obj, ORIGINAL_ATTRIBUTE, None)
        if original is not None and is_amp_replacement(obj):
            obj = original
        return resolver(obj, *args, **kwargs)

    return resolve

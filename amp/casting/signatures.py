"""Wrappers written for a call signature: the FP32 ops that models call on every layer.

A generic wrapper takes `*args, **kwargs` and hands them on, which costs a tuple and a dict per
call; for `x.sum(dim=-1)` that is a fifth of the call. An FP32 op whose arguments amp reads by
name (SIGNATURES) gets a wrapper with the op's own parameters instead: it returns at once,
forwarding exactly the arguments the call gave, when none of its tensors is in low precision
(then amp casts nothing, and where torch's autocast decides it, it does the same). Only calls
with something to cast take the generic path (wrappers.make_deciding).

A parameter a call leaves out is left out of the forwarded call too, so torch sees the call as
given (its defaults and its errors).
"""

import functools

from ..lists import FP32, resolve_namespace
from ..lists.agreement import AMP_ALONE
from .casts import LOW_PRECISION
from .native_autocast import any_enabled
from .wrappers import _finish, make_deciding

__all__ = ["SIGNATURES", "wrapper_maker", "make_signature_wrapper"]

_UNARY = ((), (), ())
_REDUCTION = (("dim", "keepdim"), ("dtype",), ())
_SOFTMAX = (("dim", "dtype"), (), ())

# (namespace, name) -> (optional positional parameters after the first, keyword-only
# parameters, tensor parameters after the first): the first parameter is always a tensor.
SIGNATURES = {
    ("torch.Tensor", "softmax"): _SOFTMAX,
    ("torch.Tensor", "log_softmax"): _SOFTMAX,
    ("torch.Tensor", "sum"): _REDUCTION,
    ("torch.Tensor", "prod"): _REDUCTION,
    ("torch.Tensor", "logsumexp"): (("dim", "keepdim"), (), ()),
    ("torch.Tensor", "cumsum"): (("dim",), ("dtype",), ()),
    ("torch.Tensor", "cumprod"): (("dim",), ("dtype",), ()),
    ("torch.Tensor", "pow"): (("exponent",), (), ("exponent",)),
    **{
        ("torch.Tensor", name): _UNARY
        for name in (
            "exp",
            "expm1",
            "log",
            "log2",
            "log10",
            "log1p",
            "rsqrt",
            "reciprocal",
            "acos",
            "asin",
            "cosh",
            "sinh",
            "tan",
            "erfinv",
        )
    },
    ("torch", "layer_norm"): (
        ("normalized_shape", "weight", "bias", "eps", "cudnn_enable"),
        (),
        ("weight", "bias"),
    ),
}


class _Absent:
    def __repr__(self):
        return "<absent>"


_ABSENT = _Absent()


def _rebuild(names, values, keyword_names, keyword_values):
    """(args, kwargs) of a call that gave `values` for `names` (positional, in order) and
    `keyword_values` for `keyword_names`, leaving out the absent ones: positional up to the first
    absent one, by name after it."""
    args, kwargs = [], {}
    for name, value in zip(names, values):
        if value is _ABSENT:
            continue
        if kwargs or len(args) < names.index(name):
            kwargs[name] = value
        else:
            args.append(value)
    for name, value in zip(keyword_names, keyword_values):
        if value is not _ABSENT:
            kwargs[name] = value
    return tuple(args), kwargs


def _forwarding(first, optional, keyword_only):
    """Source lines returning `_original(...)` for the calls that give a prefix of the
    positional parameters and no keyword-only one (the rest fall to `_rebuild`)."""
    if not optional and not keyword_only:
        return [f"    return _original({first})"]
    indent = "        " if keyword_only else "    "
    lines = []
    if keyword_only:
        lines.append("    if " + " and ".join(f"{name} is _ABSENT" for name in keyword_only) + ":")
    for given in range(len(optional) + 1):
        present = [first, *optional[:given]]
        absent = optional[given:]
        test = " and ".join(
            [f"{name} is not _ABSENT" for name in optional[:given]]
            + [f"{name} is _ABSENT" for name in absent]
        )
        call = f"return _original({', '.join(present)})"
        lines.append(f"{indent}if {test}:\n{indent}    {call}" if test else f"{indent}{call}")
    names = (first, *optional)
    lines.append(
        f"    args, kwargs = _rebuild({names!r}, ({', '.join(names)},), "
        f"{tuple(keyword_only)!r}, ({', '.join(keyword_only)}{',' if keyword_only else ''}))"
    )
    lines.append("    return _original(*args, **kwargs)")
    return lines


def make_signature_wrapper(original, name, signature, deciders, first="self"):
    """An FP32 wrapper for `original` with `signature` (a SIGNATURES value) whose first parameter
    is called `first`; `deciders` as for wrappers.make_wrapper (none AMP_ALONE: a call with
    nothing to cast must be able to run as it is)."""
    optional, keyword_only, tensors = signature
    parameters = [first] + [f"{name}=_ABSENT" for name in optional]
    if keyword_only:
        parameters += ["*"] + [f"{name}=_ABSENT" for name in keyword_only]
    low = [f"{first}.dtype in _LOW"] + [
        f"({tensor} is not _ABSENT and {tensor} is not None and {tensor}.dtype in _LOW)"
        for tensor in tensors
    ]
    names = (first, *optional)
    source = [
        f"def amp_signature_wrapper({', '.join(parameters)}):",
        "    try:",
        f"        low = {' or '.join(low)}",
        "    except AttributeError:  # not a tensor: torch's own error, on the generic path",
        "        low = True",
        "    if low:",
        f"        args, kwargs = _rebuild({names!r}, ({', '.join(names)},), "
        f"{tuple(keyword_only)!r}, ({', '.join(keyword_only)}{',' if keyword_only else ''}))",
        "        if not _any_enabled():",
        "            return _original(*args, **kwargs)",
        "        return _decide(args, kwargs)",
        *_forwarding(first, optional, keyword_only),
    ]
    namespace = {
        "_ABSENT": _ABSENT,
        "_LOW": LOW_PRECISION,
        "_rebuild": _rebuild,
        "_original": original,
        "_any_enabled": any_enabled,
        "_decide": make_deciding(original, FP32, name, None, deciders),
    }
    # Named after this module, so that profilers and tracebacks place the wrapper in amp.
    code = compile("\n".join(source), f"{__file__}:<wrapper of {name}>", "exec")
    exec(code, namespace)  # noqa: S102 (source built above from SIGNATURES)
    return _finish(namespace["amp_signature_wrapper"], original, FP32)


def wrapper_maker(namespace, name, kind, deciders):
    """A maker `(original, name=...) -> wrapper` of a signature wrapper for `namespace.name`, or
    None where it has none (not in SIGNATURES, not FP32, or amp decides it alone somewhere)."""
    if kind != FP32 or AMP_ALONE in deciders.values():
        return None
    for (path, entry), signature in SIGNATURES.items():
        if entry == name and resolve_namespace(path) is namespace:
            first = "self" if path == "torch.Tensor" else "input"
            return functools.partial(
                make_signature_wrapper, signature=signature, deciders=deciders, first=first
            )
    return None


"""Where amp's tables and torch's own autocast (torch_policy.py) decide an op the same way.

amp's tables stay the one truth of what runs in which precision. Where, on a device type, torch's
autocast would do to an op exactly what amp's table (or a user registration) says, torch's C++
autocast does it and amp leaves the op unpatched for that device; everywhere else amp decides.
`decision` answers per device type: TORCH (torch decides, amp's wrapper passes the call on),
AMP (amp casts the arguments and calls the op: nothing torch autocasts runs inside it, or it is a
Python function, whose calls are each decided as their own entries say) or AMP_ALONE (amp casts
and runs the call with torch's autocast off: torch would otherwise cast the op, or ops inside
its kernel, another way).
"""

import functools
import types

import torch

from . import torch_policy
from .torch_policy import FP32_SET_OPT_DTYPE, LOWER_PRECISION_FP

__all__ = [
    "DEVICE_TYPES",
    "TORCH",
    "AMP",
    "AMP_ALONE",
    "ATEN_OPS",
    "INSIDE",
    "AUTOCAST_LEAVES",
    "aten_op",
    "decision",
    "decides_everywhere",
    "reason",
]

DEVICE_TYPES = ("cpu", "cuda")
TORCH = "torch"  # torch's autocast decides as amp's table does
AMP = "amp"  # amp casts; no op torch autocasts runs inside
AMP_ALONE = "amp alone"  # amp casts and runs the call with torch's autocast off

# The kinds of amp's tables (amp/lists/__init__.py), repeated to keep this module importable
# from there.
_LOWER_PRECISION, _FP32 = "lower_precision", "fp32"
_UNPATCHED = ("promoted_by_torch", "input_dtype")

# Python functions that only check their arguments and call one aten op (torch.functional), and
# Tensor's operators: the op they reach. Any other Python function is amp's to decide.
ATEN_OPS = {
    ("torch", "einsum"): "einsum",
    ("torch", "cdist"): "cdist",
    ("torch", "chain_matmul"): "chain_matmul",
    ("torch", "tensordot"): "tensordot",
    ("torch", "stft"): "stft",
    ("torch.Tensor", "__matmul__"): "matmul",
    ("torch.Tensor", "__rmatmul__"): "matmul",
    ("torch.Tensor", "__pow__"): "pow",
    ("torch.Tensor", "__rpow__"): "pow",
    ("torch.Tensor", "stft"): "stft",
}

# Ops whose kernels call, on a device, ops torch autocasts there while the op itself is not: a
# call reaches those casts. F.pad's reflection and replication kernels run in FP32 under torch's
# CPU autocast (for speed), where amp's table keeps F.pad in its input's dtype; the CPU kernel of
# torch._scaled_mm (FP8 matmuls) multiplies its dequantized operands with an mm that torch's CPU
# autocast would round to low precision.
_PADS = (
    "reflection_pad1d",
    "reflection_pad2d",
    "replication_pad1d",
    "replication_pad2d",
    "replication_pad3d",
)
INSIDE = {
    "pad": {"cpu": _PADS},
    "_scaled_mm": {"cpu": ("mm",)},
}

# aten ops whose kernels call no op that torch autocasts: where amp decides one of these, torch's
# autocast has nothing to do inside it, so a call with nothing to cast runs as it is (no
# exclusion of torch's autocast around it). Elementwise math, reductions, normalisations, losses
# and pooling kernels; tests/lists/test_agreement.py runs each under torch's CPU autocast
# against the same call without it.
AUTOCAST_LEAVES = frozenset(
    (
        "acos",
        "asin",
        "cosh",
        "erfinv",
        "exp",
        "expm1",
        "log",
        "log10",
        "log2",
        "log1p",
        "reciprocal",
        "rsqrt",
        "sinh",
        "tan",
        "pow",
        "softplus",
        "softmax",
        "log_softmax",
        "logsumexp",
        "sum",
        "prod",
        "cumsum",
        "cumprod",
        "var",
        "renorm",
        "layer_norm",
        "native_layer_norm",
        "group_norm",
        "rms_norm",
        "l1_loss",
        "mse_loss",
        "smooth_l1_loss",
        "huber_loss",
        "soft_margin_loss",
        "multi_margin_loss",
        "multilabel_margin_loss",
        "nll_loss",
        "nll_loss2d",
        "nll_loss_nd",
        "cross_entropy_loss",
        "kl_div",
        "poisson_nll_loss",
        "binary_cross_entropy_with_logits",
        "avg_pool3d",
        "max_pool3d_with_indices",
        "max_unpool2d",
        "max_unpool3d",
        "adaptive_avg_pool3d",
        "adaptive_max_pool3d",
        "fractional_max_pool2d",
        "fractional_max_pool3d",
        "upsample_nearest1d",
        "upsample_nearest2d",
        "upsample_nearest3d",
        "_upsample_nearest_exact1d",
        "_upsample_nearest_exact2d",
        "_upsample_nearest_exact3d",
        "upsample_linear1d",
        "upsample_bilinear2d",
        "_upsample_bilinear2d_aa",
        "upsample_trilinear3d",
        "upsample_bicubic2d",
        "_upsample_bicubic2d_aa",
        "cat",
        "stack",
    )
)

# The equivalences: amp's kind -> torch's kinds that do the same to every call.
# FP32: torch's fp32_set_opt_dtype runs an explicit dtype= as asked, as amp does; its plain fp32
# agrees only on ops without a dtype argument.
_SAME = {_LOWER_PRECISION: (LOWER_PRECISION_FP,), _FP32: (FP32_SET_OPT_DTYPE, torch_policy.FP32)}
# After amp's cast, a torch kind of the same direction changes nothing in the call.
_INERT_AFTER = {
    _FP32: (torch_policy.FP32, FP32_SET_OPT_DTYPE, torch_policy.FP32_APPEND_DTYPE),
    _LOWER_PRECISION: (LOWER_PRECISION_FP,),
    "promote": (torch_policy.PROMOTE,),
    "sequence_promote": (torch_policy.PROMOTE,),
}


def aten_op(namespace, name, obj):
    """The aten op that `namespace.name` (the object `obj`) is, or None where it is a Python
    function amp cannot see through (or no aten op at all, as Tensor.cpu)."""
    known = ATEN_OPS.get((namespace, name))
    if known is not None:
        return known
    if isinstance(obj, types.FunctionType) or not callable(obj):
        return None
    op = getattr(obj, "__name__", None)  # torch.linalg.solve's is "linalg_solve"
    return op if op is not None and _has_schema(op) else None


@functools.lru_cache(maxsize=None)
def _has_schema(op):
    return bool(torch._C._jit_get_schemas_for_operator(f"aten::{op}"))


@functools.lru_cache(maxsize=None)
def _takes_dtype(op):
    return any(
        argument.name == "dtype"
        for schema in torch._C._jit_get_schemas_for_operator(f"aten::{op}")
        for argument in schema.arguments
    )


def _torch_kind(op, device_type):
    """What torch's autocast does to a call of `op` on `device_type`: its kind for the op, or for
    an op the call reaches inside (INSIDE), or None."""
    if op is None:
        return None
    policy = torch_policy.POLICY[device_type]
    kind = policy.get(op)
    if kind is None:
        inside = INSIDE.get(op, {}).get(device_type, ())
        kind = next((policy[inner] for inner in inside if inner in policy), None)
    return kind


def _agrees(kind, op, device_type):
    torch_kind = _torch_kind(op, device_type)
    if kind in _UNPATCHED:
        return torch_kind is None
    if torch_kind not in _SAME.get(kind, ()):
        return False
    return torch_kind != torch_policy.FP32 or not _takes_dtype(op)


def decision(kind, op, device_type):
    """TORCH, AMP or AMP_ALONE for a call of aten op `op` (None: a Python function) that amp's
    table gives policy `kind`, on `device_type`."""
    if op is None:
        # amp casts the arguments; inside, each call is decided as its own entry says (as
        # apex's patched functions were), which torch's autocast off would prevent.
        return TORCH if kind in _UNPATCHED else AMP
    if _agrees(kind, op, device_type):
        return TORCH
    torch_kind = _torch_kind(op, device_type)
    if torch_kind is None:
        return AMP if op in AUTOCAST_LEAVES else AMP_ALONE
    if torch_kind in _INERT_AFTER.get(kind, ()) and not (
        torch_kind == torch_policy.FP32 and _takes_dtype(op)
    ):
        return AMP  # amp's cast leaves torch's nothing to do
    return AMP_ALONE


def decides_everywhere(kind, op):
    """Whether torch's autocast decides `op` as `kind` on every device type (amp need not patch
    it)."""
    return all(decision(kind, op, device) == TORCH for device in DEVICE_TYPES)


_KIND_WORDS = {
    _LOWER_PRECISION: "low precision",
    _FP32: "FP32",
    "promote": "the widest input type",
    "sequence_promote": "the widest type in its sequence",
    "banned": "refused in low precision",
    "input_dtype": "its input's dtype",
    "promoted_by_torch": "its input's dtype",
}
_TORCH_WORDS = {
    LOWER_PRECISION_FP: "low precision",
    torch_policy.FP32: "FP32, even with dtype=",
    FP32_SET_OPT_DTYPE: "FP32",
    torch_policy.FP32_APPEND_DTYPE: "FP32 (through its dtype= overload)",
    torch_policy.PROMOTE: "the widest input type (raising for float16 with bfloat16)",
    torch_policy.BANNED: "an error, whatever the inputs",
}


def reason(kind, op, device_type):
    """Why amp decides this op on `device_type` (its decision is not TORCH): one line."""
    ours = _KIND_WORDS.get(kind, kind)
    if op is None:
        return f"amp: {ours}; a Python function torch's autocast does not see as one op"
    torch_kind = _torch_kind(op, device_type)
    if torch_kind is None:
        return f"amp: {ours}; torch's autocast leaves it alone"
    theirs = _TORCH_WORDS[torch_kind]
    return f"amp: {ours}; torch's autocast: {theirs}"

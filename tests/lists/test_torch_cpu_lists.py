"""PyTorch's own CPU autocast op lists (shipped in the installed torch) run through amp.autocast.

Each entry of `torch.testing._internal.autocast_test_lists.AutocastCPUTestLists` must give the
dtype torch's CPU autocast tests expect, and the same values as torch's control (the arguments
cast to that dtype by hand, run with casting off), or be listed in DIFFERENCES with its reason.
The ops torch's lists call through `torch._C._nn` run both as torch's tests call them (the C
binding, which amp patches with its function's policy) and through their public
`torch.nn.functional` function, as models call them.
"""

import collections

import pytest
import torch
import torch.nn.functional as F
from torch.testing._internal.autocast_test_lists import AutocastCPUTestLists

import amp
from helpers import DTYPES

# Where amp's tables decide otherwise than torch's CPU autocast, on purpose.
DIFFERENCES = {
    "binary_cross_entropy": "amp refuses low-precision inputs with advice (use BCEWithLogitsLoss; "
    "apex's BANNED_FUNCS); torch's CPU autocast runs it in FP32",
    "reflection_pad1d": "F.pad keeps its input's dtype under amp (a pad needs no FP32); torch's "
    "CPU autocast upcasts this pad kernel for speed only",
}

# torch._C._nn ops reached through a public function that takes other arguments.
_PUBLIC = {
    "nll_loss2d": lambda input, target: F.nll_loss(input, target),
}
_C_NN = torch._C._nn


def _entries(dtype):
    """(list name, op, args, kwargs, expected output dtype, module) for every entry."""
    lists = AutocastCPUTestLists("cpu")
    fp16 = dtype is torch.float16
    for name, expected in (
        ("torch_16", dtype),
        ("nn_16", dtype),
        ("torch_fp32", torch.float32),
        ("nn_fp32", torch.float32),
    ):
        for entry in getattr(lists, name):
            op, args = entry[0], entry[1]
            kwargs = entry[2] if len(entry) > 2 else {}
            if fp16 and name.endswith("fp32"):  # the lists hold bfloat16 inputs for FP32 ops
                args = tuple(
                    a.half() if torch.is_tensor(a) and a.dtype is torch.bfloat16 else a
                    for a in args
                )
            if name.startswith("nn"):
                yield name, op, args, kwargs, expected, _C_NN
                yield name + "-public", op, args, kwargs, expected, F
            else:
                yield name, op, args, kwargs, expected, torch
    for name in (
        "torch_need_autocast_promote",
        "torch_expect_builtin_promote",
        "methods_expect_builtin_promote",
    ):
        for entry in getattr(lists, name):
            op, args = entry[0], entry[2] if fp16 else entry[1]
            expected = entry[3] if len(entry) > 3 else torch.float32
            module = None if name.startswith("methods") else torch
            yield name, op, args, {}, expected, module


def _cast(value, dtype):
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, (list, tuple)):
        return type(value)(_cast(item, dtype) for item in value)
    return value


def _equal(first, second):
    if isinstance(first, torch.Tensor):
        return torch.equal(first, second)
    if isinstance(first, collections.abc.Iterable):
        return all(_equal(a, b) for a, b in zip(first, second))
    return first == second


def _call(module, op, args, kwargs):
    if module is F and op in _PUBLIC:
        return _PUBLIC[op](*args, **kwargs)
    if module is not None and hasattr(module, op):
        return getattr(module, op)(*args, **kwargs)
    return getattr(args[0], op)(*args[1:], **kwargs)


def _params():
    for dtype in DTYPES:
        for name, op, args, kwargs, expected, module in _entries(dtype):
            yield pytest.param(dtype, op, args, kwargs, expected, module, id=f"{dtype}-{name}-{op}")


@pytest.mark.parametrize("dtype, op, args, kwargs, expected, module", list(_params()))
def test_torch_cpu_autocast_list_entry(dtype, op, args, kwargs, expected, module):
    if op in DIFFERENCES:
        pytest.skip(f"documented difference: {DIFFERENCES[op]}")
    with amp.autocast("cpu", dtype=dtype):
        assert torch.is_autocast_enabled("cpu")
        output = _call(module, op, args, kwargs)
        with torch.autocast("cpu", enabled=False):  # torch's control: cast by hand, casting off
            run_as = expected if expected.is_floating_point else torch.float32
            control = _call(module, op, _cast(args, run_as), kwargs)
    result = output[0] if isinstance(output, tuple) else output
    assert result.dtype is expected, f"{op} produced {result.dtype}, torch expects {expected}"
    assert _equal(output, control), f"{op} differs from torch's control"


def test_documented_differences_are_real():
    """Each listed difference still holds: if torch or amp changes, the list must change too."""
    x = torch.rand(8, 8, dtype=torch.bfloat16)
    with amp.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(NotImplementedError, match="BCEWithLogitsLoss"):
            F.binary_cross_entropy(x, x)
        assert F.pad(torch.randn(8, 8, 8, dtype=torch.bfloat16), (3, 3), mode="reflect").dtype is (
            torch.bfloat16
        )
    amp.deinitialize()  # torch.autocast is amp's region while amp's patches are installed
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert F.binary_cross_entropy(x, x).dtype is torch.float32
        padded = torch._C._nn.reflection_pad1d(torch.randn(8, 8, 8, dtype=torch.bfloat16), (3, 3))
        assert padded.dtype is torch.float32

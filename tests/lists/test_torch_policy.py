"""torch's autocast policy as data (amp/lists/torch_policy.py), against the installed torch: the
ops its dispatcher autocasts, overload by overload, and what it does to each kind (CPU on real
tensors, CUDA on FakeTensors with torch's CUDA autocast state set directly)."""

import contextlib

import pytest
import torch
import torch.nn.functional as F

from amp.lists import torch_policy
from amp.lists.torch_policy import PARTIAL, POLICY, UNCAST_OVERLOADS

_KEYS = {"cpu": "AutocastCPU", "cuda": "AutocastCUDA"}
DEVICES = pytest.mark.parametrize("device", ["cpu", "cuda"])


def _registered(device):
    """{op name (base): {overload names registered}} of the installed torch's dispatcher."""
    found = {}
    for name in torch._C._dispatch_get_all_op_names():
        if name.startswith("aten::") and torch._C._dispatch_has_kernel_for_dispatch_key(
            name, _KEYS[device]
        ):
            base, _, overload = name[len("aten::") :].partition(".")
            found.setdefault(base, set()).add(overload)
    return found


@DEVICES
def test_the_policy_names_the_ops_torch_autocasts(device):
    registered = set(_registered(device))
    assert set(POLICY[device]) | set(PARTIAL.get(device, {})) == registered
    assert not set(POLICY[device]) & set(PARTIAL.get(device, {}))


@DEVICES
def test_every_overload_torch_leaves_out_reaches_a_registered_one_or_changes_nothing(device):
    """An op is named by its base name: an overload left out of torch's autocast decomposes into
    a registered one (the cast happens there) or changes nothing (torch_policy.UNCAST_OVERLOADS)."""
    registered = _registered(device)
    unexplained = []
    for op in POLICY[device]:
        for schema in torch._C._jit_get_schemas_for_operator(f"aten::{op}"):
            overload = schema.overload_name
            if overload in registered[op] or any(arg.is_out for arg in schema.arguments):
                continue
            name = f"aten::{op}.{overload}" if overload else f"aten::{op}"
            try:
                composite = torch._C._dispatch_has_kernel_for_dispatch_key(
                    name, "CompositeImplicitAutograd"
                )
            except RuntimeError:  # a TorchScript-only form: no eager call reaches it
                continue
            if not composite and overload not in UNCAST_OVERLOADS:
                unexplained.append(name)
    assert unexplained == []


@contextlib.contextmanager
def _autocast(device, dtype):
    """torch's own autocast state on `device` (torch.autocast("cuda") turns itself off without
    a GPU; the state itself casts FakeTensors on "cuda")."""
    torch.set_autocast_enabled(device, True)
    before = torch.get_autocast_dtype(device)
    torch.set_autocast_dtype(device, dtype)
    try:
        yield
    finally:
        torch.set_autocast_dtype(device, before)
        torch.set_autocast_enabled(device, False)
        torch.clear_autocast_cache()


@contextlib.contextmanager
def _tensors(device):
    if device == "cpu":
        yield
        return
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        yield


def _kind_samples(device):
    """{torch's kind: (aten op, a call of it)} for one op of each kind torch uses on `device`."""
    make = lambda *shape: torch.randn(*shape, device=device)  # noqa: E731
    half = lambda *shape: make(*shape).half()  # noqa: E731
    samples = {
        torch_policy.LOWER_PRECISION_FP: ("mm", lambda: torch.mm(make(4, 4), make(4, 4))),
        torch_policy.FP32: ("cdist", lambda: torch.cdist(half(3, 4), half(2, 4))),
    }
    if device == "cpu":
        samples[torch_policy.PROMOTE] = ("cat", lambda: torch.cat([make(2), half(2)]))
    else:
        samples[torch_policy.FP32_SET_OPT_DTYPE] = ("softmax", lambda: torch.softmax(half(4), 0))
        samples[torch_policy.FP32_APPEND_DTYPE] = ("norm", lambda: torch.norm(half(4)))
        samples[torch_policy.PROMOTE] = (
            "addcmul",
            lambda: torch.addcmul(make(4), half(4), half(4)),
        )
    return samples


@DEVICES
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_each_kind_casts_as_named(device, dtype):
    with _tensors(device):
        for kind, (op, call) in _kind_samples(device).items():
            assert POLICY[device][op] == kind, op
            with _autocast(device, dtype):
                result = call()
            expected = dtype if kind == torch_policy.LOWER_PRECISION_FP else torch.float32
            assert result.dtype is expected, (kind, op)


def test_cuda_set_opt_dtype_runs_an_explicit_dtype_as_asked_and_cpu_fp32_does_not():
    """The difference amp's agreement rests on: torch's fp32_set_opt_dtype (CUDA's softmax, sum)
    keeps `dtype=` as amp does; its plain fp32 (CPU's prod) casts the input whatever dtype=
    says."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.randn(4, 4, device="cuda").half()
        with _autocast("cuda", torch.float16):
            assert torch.softmax(x, 0, dtype=torch.float16).dtype is torch.float16
            assert torch.sum(x, dtype=torch.float16).dtype is torch.float16
    x = torch.randn(4, 4).bfloat16()
    with _autocast("cpu", torch.bfloat16):
        asked = torch.prod(x, 0, dtype=torch.bfloat16)
    assert torch.equal(asked, torch.prod(x.float(), 0, dtype=torch.bfloat16))


def test_partial_registrations_leave_the_other_overload_uncast():
    weight, x = torch.randn(2, 2, 3, 3), torch.randn(1, 2, 5, 5)
    with _autocast("cpu", torch.bfloat16):
        out = torch._convolution(
            x, weight, None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1, False, False, False, False
        )
        assert F.conv2d(x, weight).dtype is torch.bfloat16  # conv2d is registered
    assert out.dtype is torch.float32

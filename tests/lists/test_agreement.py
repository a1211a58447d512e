"""Where amp's tables and torch's autocast decide alike (amp/lists/agreement.py): the decisions,
every entry's dtype on CUDA (FakeTensors: torch decides there for most), amp's decision winning
where a registration changes an op torch's autocast covers, and the ops amp decides without
excluding torch's autocast running nothing it casts."""

import warnings

import pytest
import torch
import torch.nn.functional as F

import amp
from amp import lists
from amp.casting.cast_tree import cast_tree
from amp.lists.agreement import AMP, AMP_ALONE, AUTOCAST_LEAVES, TORCH, aten_op, decision
from helpers import DTYPES
from helpers.op_samples import CUDA_ONLY, KEEP_DTYPES, sample

ENTRIES = [entry for entry in lists.entries() if entry.kind not in lists.UNPATCHED]


def _decisions(namespace, name):
    entry = next(e for e in lists.entries() if (e.namespace, e.name) == (namespace, name))
    return tuple(decision(entry.kind, _op(entry), device) for device in ("cpu", "cuda"))


@pytest.mark.parametrize(
    "namespace, name, expected",
    [
        ("torch.nn.functional", "linear", (TORCH, TORCH)),
        ("torch", "matmul", (TORCH, TORCH)),
        ("torch.Tensor", "__matmul__", (TORCH, TORCH)),
        ("torch.nn.functional", "conv2d", (TORCH, TORCH)),
        ("torch.nn.functional", "scaled_dot_product_attention", (TORCH, TORCH)),
        ("torch", "cdist", (TORCH, TORCH)),  # torch's FP32 on both
        ("torch.Tensor", "softmax", (AMP, TORCH)),  # CPU leaves it in low precision
        ("torch.Tensor", "sum", (AMP, TORCH)),
        ("torch", "layer_norm", (AMP, TORCH)),
        ("torch", "prod", (AMP_ALONE, TORCH)),  # CPU: FP32 even with dtype=; amp: as asked
        ("torch", "einsum", (AMP_ALONE, TORCH)),  # composite on CPU: its bmm and sums together
        ("torch", "cat", (AMP, AMP)),  # amp widens float16 with bfloat16; torch raises
        ("torch", "grid_sampler", (AMP_ALONE, AMP)),  # CPU: FP32; amp: the widest type
        ("torch", "view_as_complex", (AMP_ALONE, TORCH)),  # CPU would cast the view to a copy
        ("torch", "_scaled_mm", (AMP_ALONE, TORCH)),  # CPU: its inner mm
        ("torch", "std", (TORCH, TORCH)),  # its input's dtype, as torch leaves it
        ("torch.nn.functional", "binary_cross_entropy", (AMP, AMP)),  # a Python function
    ],
)
def test_decisions(namespace, name, expected):
    assert _decisions(namespace, name) == expected


def _call_of(entry, args, kwargs):
    """A call of the entry, looked up when made (amp patches it while it casts)."""
    if entry.namespace == "torch.Tensor":
        return lambda: getattr(args[0], entry.name)(*args[1:], **kwargs)
    namespace = lists.resolve_namespace(entry.namespace)
    return lambda: getattr(namespace, entry.name)(*args, **kwargs)


# The dtype each kind runs in, given inputs of `low` (FP32 for the first input where that tells
# the widest type).
_INPUT_DTYPE = {
    lists.LOWER_PRECISION: lambda low: lambda position: torch.float32,
    lists.FP32: lambda low: lambda position: low,
    lists.PROMOTE: lambda low: lambda position: torch.float32 if position == 0 else low,
    lists.SEQUENCE_PROMOTE: lambda low: lambda position: torch.float32 if position == 0 else low,
    lists.BANNED: lambda low: lambda position: low,
}


def _fake_maker(dtype_at):
    positions = iter(range(1000))

    def make(*shape, kind="any", tensor=None):
        if kind == "complex":
            return torch.randn(*shape, dtype=torch.complex64, device="cuda")
        if tensor is None:
            tensor = torch.rand(*shape, device="cuda") + (0.5 if kind == "positive" else 0.0)
        else:
            tensor = torch.empty(tensor.shape, dtype=tensor.dtype, device="cuda")
        return tensor.to(dtype_at(next(positions)))

    return make


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("entry", ENTRIES, ids=lambda entry: entry.qualified_name)
def test_every_entry_runs_in_its_table_dtype_on_cuda(entry, dtype):
    """On FakeTensors on "cuda", where torch's CUDA autocast decides most entries: the output
    dtype is the table's (tests/lists/test_tables.py checks values on the CPU)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    run_dtype = dtype if entry.kind == lists.LOWER_PRECISION else torch.float32
    with FakeTensorMode(allow_non_fake_inputs=True), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args, kwargs = sample(entry, _fake_maker(_INPUT_DTYPE[entry.kind](dtype)))
        call = _call_of(entry, args, kwargs)
        if entry.kind == lists.BANNED:
            with amp.autocast(dtype=dtype), pytest.raises((NotImplementedError, RuntimeError)):
                call()
            return
        if entry.name not in KEEP_DTYPES:
            control_args, control_kwargs = cast_tree(args, run_dtype), cast_tree(kwargs, run_dtype)
        else:
            control_args, control_kwargs = args, kwargs
        try:  # ops FakeTensors cannot run (data-dependent shapes, no meta kernel) are skipped
            _call_of(entry, control_args, control_kwargs)()
        except Exception as error:  # noqa: BLE001 (any failure of the control: not testable)
            pytest.skip(f"FakeTensors cannot run {entry.qualified_name}: {type(error).__name__}")
        with amp.autocast(dtype=dtype):
            result = call()
    amp.deinitialize()
    outputs = result if isinstance(result, (tuple, list)) else (result,)
    if entry.kind == lists.LOWER_PRECISION:
        outputs = outputs[:1]  # flash attention's logsumexp comes in FP32 by design
    for output in outputs:
        if isinstance(output, torch.Tensor) and output.is_floating_point():
            assert output.dtype is run_dtype, (entry.qualified_name, output.dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_registration_wins_over_torchs_autocast_where_it_covers_the_op(registrations, dtype):
    """mm, matmul and F.linear are torch's to cast in low precision (amp's table agrees, so amp
    leaves them unpatched); registered as FP32 functions, they run in FP32, bit for bit as the
    same calls on FP32 inputs, through every entry point (the C binding of F.linear, nn.Linear,
    the @ operator), also after the patches were installed. F.mse_loss, which torch's CPU
    autocast runs in FP32 (through its binding), registered as a low-precision function, runs in
    low precision."""
    torch.manual_seed(0)
    x, w, b = torch.randn(4, 8), torch.randn(6, 8), torch.randn(6)
    layer = torch.nn.Linear(8, 6)
    with amp.autocast(dtype=dtype):
        assert torch.mm(x, w.t()).dtype is dtype  # torch's decision, before the registrations
        amp.register_float_function(torch, "mm")
        amp.register_float_function(torch, "matmul")
        amp.register_float_function(torch.Tensor, "__matmul__")
        amp.register_float_function(torch.nn.functional, "linear")
        amp.register_half_function(torch.nn.functional, "mse_loss")
        results = [
            torch.mm(x.to(dtype), w.t()),
            torch.matmul(x, w.t().to(dtype)),
            x.to(dtype) @ w.t(),
            F.linear(x.to(dtype), w, b),
            torch._C._nn.linear(x.to(dtype), w, b),
            layer(x.to(dtype)),
            F.mse_loss(x, x.flip(0)),
        ]
    assert [r.dtype for r in results] == [torch.float32] * 6 + [dtype]
    low = x.to(dtype).float()
    expected = [
        torch.mm(low, w.t()),
        torch.matmul(x, w.t().to(dtype).float()),
        low @ w.t(),
        F.linear(low, w, b),
        F.linear(low, w, b),
        layer(low),
        F.mse_loss(x.to(dtype), x.flip(0).to(dtype)),
    ]
    assert all(torch.equal(r, e) for r, e in zip(results, expected))
    amp.deinitialize()


def test_a_registration_wins_on_cuda_too(registrations):
    """On FakeTensors on "cuda": softmax, torch's FP32 there, registered as a low-precision
    function runs in low precision; mm registered as FP32 runs in FP32."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    amp.register_half_function(torch.Tensor, "softmax")
    amp.register_float_function(torch, "mm")
    with FakeTensorMode():
        x = torch.randn(4, 4, device="cuda")
        with amp.autocast(dtype=torch.bfloat16):
            soft, product = x.softmax(-1), torch.mm(x.half(), x.half())
    amp.deinitialize()
    assert (soft.dtype, product.dtype) == (torch.bfloat16, torch.float32)


def _op(entry):
    namespace = lists.resolve_namespace(entry.namespace)
    return aten_op(entry.namespace, entry.name, getattr(namespace, entry.name, None))


LEAF_ENTRIES = [
    entry
    for entry in ENTRIES
    if _op(entry) in AUTOCAST_LEAVES and (entry.namespace, entry.name) not in CUDA_ONLY
]


@pytest.mark.parametrize("entry", LEAF_ENTRIES, ids=lambda entry: entry.qualified_name)
def test_an_autocast_leaf_runs_nothing_torchs_autocast_casts(entry):
    """amp decides a leaf op without turning torch's autocast off around it: so its kernel must
    call no op torch's autocast casts. On FP32 inputs its result under torch's own CPU autocast
    is bit for bit the result without it."""
    amp.deinitialize()  # torch.autocast is torch's own below
    generator = torch.Generator().manual_seed(0)

    def make(*shape, kind="any", tensor=None):
        if tensor is not None:
            return tensor.float()
        value = torch.randn(*shape, generator=generator)
        return value.abs() + 0.5 if kind == "positive" else value

    args, kwargs = sample(entry, make)
    call = _call_of(entry, args, kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = call()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            actual = call()
    for a, e in zip(
        actual if isinstance(actual, tuple) else (actual,),
        expected if isinstance(expected, tuple) else (expected,),
    ):
        torch.testing.assert_close(a, e, rtol=0, atol=0, equal_nan=True, msg=entry.qualified_name)

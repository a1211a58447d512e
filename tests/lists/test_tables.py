"""The op tables tested as data: every entry resolves, and runs in the dtype its table says."""

import itertools
import warnings

import pytest
import torch

import amp
from amp import lists
from amp.casting.cast_tree import cast_tree
from helpers import DTYPES, casting
from helpers.op_samples import (
    CUDA_ONLY,
    KEEP_DTYPES,
    LAPACK,
    NAMESPACE_SAMPLES,
    SAMPLES,
    sample,
)

ENTRIES = list(lists.entries())


def _id(entry):
    return f"{entry.namespace}.{entry.name}"


def test_every_entry_resolves_or_is_known_to_be_newer():
    missing = [(entry.namespace, entry.name) for entry in lists.missing()]
    unexplained = [key for key in missing if key not in lists.NEWER_THAN_TORCH_2_1]
    assert unexplained == [], f"table names this torch lacks: {unexplained}"
    # Today's torch has everything; this names what an older one would skip, visibly.
    assert (
        missing == []
        if torch.__version__ >= "2.4"
        else set(missing) <= set(lists.NEWER_THAN_TORCH_2_1)
    )


def test_tables_are_data_with_no_duplicates():
    seen = {}
    for entry in ENTRIES:
        key = (entry.namespace, entry.name)
        assert key not in seen, f"{key} is in both {seen[key]} and {entry.kind}"
        seen[key] = entry.kind
    for table in lists.TABLES:
        for list_name, _ in lists.LIST_KINDS:
            assert isinstance(getattr(table, list_name), tuple)


def test_in_place_variants_are_not_listed():
    for entry in ENTRIES:
        assert not (entry.name.endswith("_") and not entry.name.endswith("__")), entry
        assert not entry.name.startswith("__i"), entry


def test_every_op_torch_registers_for_autocast_is_covered():
    """The installed torch's dispatcher is the oracle: each op it autocasts is in a table or is
    explained in lists.NOT_IN_TABLES (so an upgrade that adds ops fails here)."""
    names = torch._C._dispatch_get_all_op_names()
    registered = {
        name.split("::")[1].split(".")[0]
        for name in names
        for key in ("AutocastCUDA", "AutocastCPU")
        if torch._C._dispatch_has_kernel_for_dispatch_key(name, key)
    }
    in_tables = {entry.name for entry in ENTRIES}
    uncovered = sorted(
        name
        for name in registered
        if name not in in_tables
        and name.replace("linalg_", "").replace("fft_", "") not in in_tables
        and name not in lists.NOT_IN_TABLES
    )
    assert uncovered == []


def test_entries_promoted_by_torch_are_not_patched():
    native = [
        (lists.resolve_namespace(e.namespace), e.name)
        for e in ENTRIES
        if e.kind == lists.PROMOTED_BY_TORCH
    ]
    assert len(native) == 34
    before = [vars(namespace).get(name) for namespace, name in native]
    with amp.autocast():
        during = [vars(namespace).get(name) for namespace, name in native]
        assert torch.cat.__amp_original__ is not None  # amp's sequence promotion is patched
    assert all(a is b for a, b in zip(before, during))


INPUT_DTYPE_ENTRIES = [entry for entry in ENTRIES if entry.kind == lists.INPUT_DTYPE]


def test_entries_that_keep_their_input_dtype_are_patched_only_where_torch_would_cast_them():
    """Entries that run in their input's dtype (the tables' comments say why each is safe
    there): where torch's autocast leaves them alone too they are never wrapped; view_as_complex,
    F.pad's binding and _scaled_mm are wrapped to run as given where torch's CPU autocast would
    cast them (agreement.py), and pass CUDA calls on."""
    assert {_id(entry) for entry in INPUT_DTYPE_ENTRIES} == {
        "torch.nn.functional.gelu",
        "torch.nn.functional.pad",
        "torch.std",
        "torch.Tensor.std",
        "torch.view_as_complex",
        "torch._scaled_mm",
    }
    left = [(torch.nn.functional, "gelu"), (torch, "std"), (torch.Tensor, "std")]
    left += [(torch._C._nn, "gelu"), (torch.nn.functional, "pad")]  # F.pad: its binding decides
    wrapped = [(torch, "view_as_complex"), (torch, "_scaled_mm"), (torch._C._nn, "pad")]
    wrapped += [(torch._C._nn, "reflection_pad1d"), (torch._C._nn, "replication_pad2d")]
    before = [vars(namespace).get(name) for namespace, name in left + wrapped]
    with amp.autocast(dtype=torch.bfloat16):
        during = [vars(namespace).get(name) for namespace, name in left + wrapped]
    assert all(a is b for a, b in zip(before[: len(left)], during[: len(left)]))
    assert all(a is not b for a, b in zip(before[len(left) :], during[len(left) :]))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_pads_and_views_run_as_given_where_torchs_cpu_autocast_would_cast_them(dtype):
    x = torch.randn(1, 2, 5).to(dtype)
    pairs = torch.randn(3, 2).half()
    with amp.autocast(dtype=dtype):
        padded = torch.nn.functional.pad(x, (2, 2), "reflect")
        direct = torch._C._nn.reflection_pad1d(x, (2, 2))
        complex_view = torch.view_as_complex(pairs)
    with torch.autocast("cpu", dtype=dtype):  # amp's patches stand: torch.autocast is amp's
        also = torch.nn.functional.pad(x, (1, 1), "replicate")
    amp.deinitialize()
    assert padded.dtype is direct.dtype is also.dtype is dtype
    assert torch.equal(padded, torch.nn.functional.pad(x, (2, 2), "reflect"))
    assert complex_view.dtype is torch.complex32  # a view of the half input, not an FP32 copy
    assert complex_view.data_ptr() == pairs.data_ptr()


@pytest.mark.parametrize("dtype", [torch.float32, *DTYPES], ids=str)
@pytest.mark.parametrize("region", ["autocast", "O1"])
def test_gelu_and_std_run_in_their_input_dtype(region, dtype):
    x = torch.randn(4, 8).to(dtype)
    with casting(region, torch.float16):
        results = [
            torch.nn.functional.gelu(x),
            torch.nn.functional.gelu(x, approximate="tanh"),
            torch._C._nn.gelu(x),
            torch.nn.GELU()(x),
            torch.std(x, dim=0),
            x.std(),
        ]
    amp.deinitialize()
    assert [result.dtype for result in results] == [dtype] * len(results)
    assert torch.equal(results[0], torch.nn.functional.gelu(x))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_register_float_function_gives_apexs_fp32_gelu_back(registrations, dtype):
    amp.register_float_function(torch.nn.functional, "gelu")
    x = torch.randn(4, 8, dtype=dtype)
    with amp.autocast(dtype=dtype):
        results = [
            torch.nn.functional.gelu(x, approximate="tanh"),
            torch._C._nn.gelu(x),  # the binding F.gelu is, patched with its policy
            torch.nn.GELU()(x),
        ]
    assert [result.dtype for result in results] == [torch.float32] * 3
    assert torch.equal(results[0], torch.nn.functional.gelu(x.float(), approximate="tanh"))


def test_every_entry_has_a_sample():
    for entry in ENTRIES:
        assert (entry.namespace, entry.name) in NAMESPACE_SAMPLES or entry.name in SAMPLES, _id(
            entry
        )


def _maker(dtype_at):
    generator = torch.Generator().manual_seed(0)
    positions = itertools.count()

    def make(*shape, kind="any", tensor=None):
        if kind == "complex":
            return torch.randn(*shape, dtype=torch.complex64, generator=generator)
        if tensor is None:
            tensor = torch.randn(*shape, generator=generator)
            if kind == "positive":
                tensor = tensor.abs() + 0.5
            elif kind == "unit":
                tensor = torch.tanh(tensor) * 0.9
            elif kind == "prob":
                tensor = torch.sigmoid(tensor)
            elif kind == "sign":
                tensor = torch.where(tensor > 0, 1.0, -1.0)
        return tensor.to(dtype_at(next(positions)))

    return make


def _call(entry, args, kwargs):
    if entry.namespace == "torch.Tensor":
        return getattr(args[0], entry.name)(*args[1:], **kwargs)
    return getattr(lists.resolve_namespace(entry.namespace), entry.name)(*args, **kwargs)


def _floating_outputs(value):
    if isinstance(value, torch.Tensor):
        return [value] if (value.is_floating_point() or value.is_complex()) else []
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in _floating_outputs(item)]
    return []


def _assert_same(actual, expected, exact=True):
    if isinstance(expected, torch.Tensor):
        assert actual.dtype == expected.dtype
        tolerance = dict(rtol=0, atol=0) if exact else dict(rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(actual, expected, equal_nan=True, **tolerance)
    elif isinstance(expected, (tuple, list)):
        assert len(actual) == len(expected)
        for a, e in zip(actual, expected):
            _assert_same(a, e, exact)
    else:
        assert actual == expected


_INPUT_DTYPE = {
    lists.LOWER_PRECISION: lambda low: lambda position: torch.float32,
    lists.FP32: lambda low: lambda position: low,
    lists.PROMOTE: lambda low: lambda position: torch.float32 if position == 0 else low,
    lists.SEQUENCE_PROMOTE: lambda low: lambda position: torch.float32 if position == 0 else low,
    lists.PROMOTED_BY_TORCH: lambda low: lambda position: torch.float32 if position == 0 else low,
    lists.INPUT_DTYPE: lambda low: lambda position: low,
    lists.BANNED: lambda low: lambda position: low,
}
# The kinds that run in the low-precision dtype given these inputs.
_RUNS_LOW = (lists.LOWER_PRECISION, lists.INPUT_DTYPE)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("entry", ENTRIES, ids=_id)
def test_entry_runs_in_its_table_dtype(entry, dtype):
    if (entry.namespace, entry.name) in CUDA_ONLY:
        pytest.skip("torch has no CPU kernel for this op")
    torch.manual_seed(0)
    args, kwargs = sample(entry, _maker(_INPUT_DTYPE[entry.kind](dtype)))
    run_dtype = dtype if entry.kind in _RUNS_LOW else torch.float32
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecation notes of torch.cholesky and friends
        if entry.kind == lists.BANNED:
            with amp.autocast(dtype=dtype):
                with pytest.raises(
                    NotImplementedError, match="binary_cross_entropy_with_logits|BCEWithLogitsLoss"
                ):
                    _call(entry, args, kwargs)
            return
        if entry.name not in KEEP_DTYPES:
            args_in, kwargs_in = cast_tree(args, run_dtype), cast_tree(kwargs, run_dtype)
        else:
            args_in, kwargs_in = args, kwargs
        try:
            expected = _call(entry, args_in, kwargs_in)
        except (RuntimeError, NotImplementedError) as error:
            if any(
                words in str(error)
                for words in ("not implemented for", "Unsupported", "is only supported for")
            ):
                pytest.skip(f"torch has no CPU {run_dtype} kernel: {error}")
            raise
        with amp.autocast(dtype=dtype):
            actual = _call(entry, args, kwargs)
    outputs = _floating_outputs(actual)
    for output in outputs:
        if output.is_floating_point():
            assert output.dtype is run_dtype, f"{_id(entry)} returned {output.dtype}"
    _assert_same(actual, expected, exact=entry.name not in LAPACK)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_agrees_with_torch_cpu_autocast(dtype):
    """Where torch's CPU autocast runs an op in low precision, amp does the same, bit for bit."""
    torch.manual_seed(0)
    x, w, b = torch.randn(4, 8), torch.randn(6, 8), torch.randn(6)
    image, kernel = torch.randn(1, 3, 8, 8), torch.randn(4, 3, 3, 3)
    a, c = torch.randn(2, 4, 5), torch.randn(2, 5, 3)
    cases = [
        lambda: torch.nn.functional.linear(x, w, b),
        lambda: torch.nn.functional.conv2d(image, kernel),
        lambda: torch.bmm(a, c),
        lambda: torch.mm(x, w.t()),
        lambda: torch.matmul(a, c),
        lambda: torch.addmm(b, x, w.t()),
        lambda: torch.nn.functional.mse_loss(x, x.flip(0)),
    ]
    for case in cases:
        with torch.autocast("cpu", dtype=dtype):
            expected = case()
        with amp.autocast(dtype=dtype, device_type="cpu"):
            actual = case()
        _assert_same(actual, expected)


DELEGATING = [entry for entry in ENTRIES if (entry.namespace, entry.name) in lists.delegates()]


def test_delegates_are_table_entries_with_a_delegate_of_the_same_policy():
    kinds = {(entry.namespace, entry.name): entry.kind for entry in ENTRIES}
    # A C binding takes the policy of the function it is the binding of.
    kinds.update({binding: kinds[source] for binding, source in lists.bindings().items()})
    assert len(DELEGATING) == len(lists.delegates()) == 22
    for entry in DELEGATING:
        assert kinds[lists.delegates()[(entry.namespace, entry.name)]] == entry.kind, _id(entry)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("entry", DELEGATING, ids=_id)
def test_delegating_function_is_left_alone_and_its_delegate_applies_the_policy(entry, dtype):
    """The installed torch's function passes its tensors to the patched delegate, so the
    policy applies exactly once (the table-dtype test above checks the result)."""
    function = getattr(lists.resolve_namespace(entry.namespace), entry.name)
    args, kwargs = sample(entry, _maker(_INPUT_DTYPE[entry.kind](dtype)))
    target_namespace, target = lists.delegates()[(entry.namespace, entry.name)]
    with amp.autocast(dtype=dtype):
        assert getattr(lists.resolve_namespace(entry.namespace), entry.name) is function
        with amp.trace() as trace:
            _call(entry, args, kwargs)
    assert [(record.op, record.policy) for record in trace] == [
        (f"{target_namespace}.{target}", entry.kind)
    ]
    assert trace.records[0].ran_in is torch.float32


def test_delegating_function_is_wrapped_when_its_delegate_has_another_policy(registrations):
    x = torch.randn(2, 4)
    amp.register_half_function(torch, "layer_norm")
    with amp.autocast(dtype=torch.bfloat16):
        with amp.trace() as trace:
            out = torch.nn.functional.layer_norm(x, (4,))
    # F.layer_norm keeps its table policy (FP32); the registration rules torch.layer_norm only.
    assert [(record.op, record.policy) for record in trace] == [
        ("torch.layer_norm", lists.LOWER_PRECISION),
        ("torch.nn.functional.layer_norm", lists.FP32),
    ]
    assert out.dtype is torch.bfloat16


def test_a_registered_delegating_function_is_wrapped(registrations):
    amp.register_float_function(torch.nn.functional, "layer_norm")
    with amp.autocast(dtype=torch.bfloat16):
        with amp.trace() as trace:
            torch.nn.functional.layer_norm(torch.randn(2, 4).bfloat16(), (4,))
    assert trace.ops() == ["torch.layer_norm", "torch.nn.functional.layer_norm"]

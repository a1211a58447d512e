import os
import re
import shutil
import subprocess

import numpy as np
import pytest
import torch

from amp import kernels
from amp.kernels import _layout, _sources, _torch_backend
from helpers import HAS_CUDA, fake_cupy
from helpers.profiling import profile_calls

FLOAT_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SIZES = [1, 3, 4, 2047, 2048, 65535, 65536, 65537, 200003]


BACKENDS = [
    pytest.param("torch", id="torch"),
    # The CuPy backend's host code on CPU memory, with a fake CuPy (tests/helpers/fake_cupy.py).
    pytest.param("emulated-cupy", id="emulated-cupy"),
    pytest.param("cupy", id="cupy", marks=pytest.mark.cuda),
]


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    """(module, device) for a backend; the CuPy one must really be in use."""
    if request.param == "torch":
        return _torch_backend, "cpu"
    if request.param == "emulated-cupy":
        module, _ = fake_cupy.install(monkeypatch)
        return module, "cpu"
    if not HAS_CUDA:
        pytest.skip("needs a CUDA device")
    if os.environ.get(kernels.DISABLE_ENV):
        pytest.skip(f"{kernels.DISABLE_ENV} is set")
    choice = kernels.cuda_backend()
    assert choice.name == "cupy", f"the CuPy backend is not in use: {choice.reason}"
    return choice.module, "cuda"


def reference_unscale(tensors, inv_scale, device):
    """torch's own kernel on copies: the oracle for unscale_."""
    copies = [t.clone() for t in tensors]
    found = torch.zeros((), device=device)
    for dtype in {t.dtype for t in copies}:
        group = [t for t in copies if t.dtype is dtype]
        try:
            torch._amp_foreach_non_finite_check_and_unscale_(group, found, inv_scale)
        except NotImplementedError:  # CUDA builds without a bfloat16 kernel: torch's CPU kernel
            on_cpu = [t.cpu() for t in group]
            cpu_found = found.cpu()
            torch._amp_foreach_non_finite_check_and_unscale_(on_cpu, cpu_found, inv_scale.cpu())
            for tensor, result in zip(group, on_cpu):
                tensor.copy_(result)
            found.copy_(cpu_found)
    return copies, found


def assert_bitwise(actual, expected):
    torch.testing.assert_close(actual, expected, rtol=0, atol=0, equal_nan=True)


def random_tensors(sizes, dtypes, device, seed=0):
    generator = torch.Generator().manual_seed(seed)
    tensors = []
    for index, size in enumerate(sizes):
        dtype = dtypes[index % len(dtypes)]
        values = torch.randn(size, generator=generator) * 1000
        tensors.append(values.to(dtype).to(device))
    return tensors


# -- unscale_ ------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("inv", [1.0, 2.0**-16, 1 / 3.0, 0.1])
def test_unscale_matches_torch_bitwise(backend, dtype, inv):
    module, device = backend
    tensors = random_tensors(SIZES, [dtype], device)
    inv_scale = torch.full((), inv, device=device)
    expected, expected_found = reference_unscale(tensors, inv_scale, device)
    found = torch.zeros((), device=device)
    module.unscale_(tensors, inv_scale, found)
    for actual, wanted in zip(tensors, expected):
        assert_bitwise(actual, wanted)
    assert found.item() == expected_found.item() == 0.0


@pytest.mark.parametrize("position", ["first", "last", "middle"])
@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
def test_unscale_flags_nonfinite_anywhere(backend, position, value):
    module, device = backend
    tensors = random_tensors([5, 70000, 131072 + 7], FLOAT_DTYPES, device)
    target = {"first": (0, 0), "last": (2, -1), "middle": (1, 65536)}[position]
    tensors[target[0]][target[1]] = value
    inv_scale = torch.full((), 0.5, device=device)
    expected, _ = reference_unscale(tensors, inv_scale, device)
    found = torch.zeros((), device=device)
    module.unscale_(tensors, inv_scale, found)
    assert found.item() == 1.0
    for actual, wanted in zip(tensors, expected):
        assert_bitwise(actual, wanted)  # every element is written, even the non-finite ones


def test_unscale_never_clears_the_flag(backend):
    module, device = backend
    found = torch.ones((), device=device)
    module.unscale_(
        random_tensors([10], [torch.float32], device), torch.full((), 1.0, device=device), found
    )
    assert found.item() == 1.0


def test_unscale_subnormals_are_not_flushed(backend):
    module, device = backend
    tiny = torch.tensor([1e-40, -3e-39, 1.4e-45, 1e-38] * 2, device=device)
    for inv in (1.0, 0.5, 3.0):
        inv_scale = torch.full((), inv, device=device)
        expected, _ = reference_unscale([tiny], inv_scale, device)
        actual = tiny.clone()
        module.unscale_([actual], inv_scale, torch.zeros((), device=device))
        assert_bitwise(actual, expected[0])
        assert actual[0].item() != 0.0 or inv == 0.0


def test_unscale_mixed_dtypes_many_tensors_and_empty(backend):
    module, device = backend
    sizes = [0, 7, 0, 1, 300] * 250  # 1250 tensors: several launches at 4 KB of parameters
    tensors = random_tensors(sizes, FLOAT_DTYPES, device, seed=3)
    tensors[-4][-1] = float("nan")
    inv_scale = torch.full((), 0.25, device=device)
    expected, _ = reference_unscale(tensors, inv_scale, device)
    found = torch.zeros((), device=device)
    module.unscale_(tensors, inv_scale, found)
    assert found.item() == 1.0
    for actual, wanted in zip(tensors, expected):
        assert_bitwise(actual, wanted)


def test_unscale_non_contiguous_and_offset_views(backend):
    module, device = backend
    base = random_tensors([4096], [torch.float32], device)[0]
    views = [base.view(64, 64).t(), base[1:1001], base[3:7], base.view(64, 64)[:, 5]]
    inv_scale = torch.full((), 0.5, device=device)
    expected = [v.clone() * 0.5 for v in views]
    # views share memory: apply to disjoint pieces one at a time
    for view, wanted in zip(views, expected):
        module.unscale_([view], inv_scale, torch.zeros((), device=device))
        assert_bitwise(view, wanted)
        view.mul_(2)


def test_empty_list_is_a_no_op(backend):
    module, device = backend
    found = torch.zeros((), device=device)
    kernels.unscale_([], torch.ones((), device=device), found)
    assert found.item() == 0.0


# -- copies with scale ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "source_dtype,destination_dtype",
    [
        (torch.float16, torch.float32),
        (torch.bfloat16, torch.float32),
        (torch.float32, torch.float32),
    ],
)
def test_unscale_to_is_copy_then_unscale(backend, source_dtype, destination_dtype):
    module, device = backend
    sources = random_tensors(SIZES, [source_dtype], device, seed=5)
    sources[4][17] = float("inf")
    destinations = [
        torch.full(s.shape, -7.0, dtype=destination_dtype, device=device) for s in sources
    ]
    inv_scale = torch.full((), 2.0**-10, device=device)
    found = torch.zeros((), device=device)
    module.unscale_to_(sources, destinations, inv_scale, found)
    expected, expected_found = reference_unscale(
        [s.to(destination_dtype) for s in sources], inv_scale, device
    )
    for actual, wanted in zip(destinations, expected):
        assert_bitwise(actual, wanted)
    assert found.item() == expected_found.item() == 1.0


@pytest.mark.parametrize("source_dtype", FLOAT_DTYPES)
def test_unscale_add_rounds_multiply_and_add_separately(backend, source_dtype):
    module, device = backend
    sources = random_tensors(SIZES, [source_dtype], device, seed=6)
    destinations = random_tensors(SIZES, [torch.float32], device, seed=7)
    before = [d.clone() for d in destinations]
    inv_scale = torch.full((), 1 / 3.0, device=device)
    found = torch.zeros((), device=device)
    module.unscale_add_(sources, destinations, inv_scale, found)
    for source, old, actual in zip(sources, before, destinations):
        assert_bitwise(actual, old + source.float() * inv_scale)
    assert found.item() == 0.0


LOW_PRECISION_PAIRS = [
    (torch.float32, torch.float16),
    (torch.float32, torch.bfloat16),
    (torch.float16, torch.float16),
    (torch.bfloat16, torch.bfloat16),
]


@pytest.mark.parametrize("function", ["unscale_to_", "unscale_add_"])
@pytest.mark.parametrize("source_dtype,destination_dtype", LOW_PRECISION_PAIRS)
def test_low_precision_destinations_round_once(backend, function, source_dtype, destination_dtype):
    # The multiply (and add) in float32, then one rounding into the destination, as the kernel.
    module, device = backend
    sources = random_tensors(SIZES, [source_dtype], device, seed=13)
    sources[3][1] = float("nan")
    destinations = random_tensors(SIZES, [destination_dtype], device, seed=14)
    inv_scale = torch.full((), 1 / 3.0, device=device)
    expected = [
        (d.float() if function == "unscale_add_" else 0.0) + s.float() * inv_scale
        for s, d in zip(sources, destinations)
    ]
    found = torch.zeros((), device=device)
    getattr(module, function)(sources, destinations, inv_scale, found)
    for actual, wanted in zip(destinations, expected):
        assert_bitwise(actual, wanted.to(destination_dtype))
    assert found.item() == 1.0


@pytest.mark.parametrize("function", ["unscale_to_", "unscale_add_"])
def test_a_source_beyond_float16_unscales_into_range(backend, function):
    # 70000 overflows float16, 70000 * 2**-10 = 68.359375 does not: 68.375, and no overflow.
    module, device = backend
    sources = [torch.tensor([70000.0, -70000.0], device=device)]
    destinations = [torch.zeros(2, dtype=torch.float16, device=device)]
    found = torch.zeros((), device=device)
    getattr(module, function)(sources, destinations, torch.full((), 2.0**-10, device=device), found)
    assert destinations[0].tolist() == [68.375, -68.375] and found.item() == 0.0


@pytest.mark.parametrize("destination_dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_copy_rounds_to_nearest_even(backend, destination_dtype):
    module, device = backend
    sources = random_tensors(SIZES, [torch.float32], device, seed=8)
    sources[0][0] = 1e6  # beyond fp16: inf, as torch's conversion gives
    sources[1][0] = float("nan")
    destinations = [torch.zeros(s.shape, dtype=destination_dtype, device=device) for s in sources]
    module.copy_(sources, destinations)
    for source, actual in zip(sources, destinations):
        assert_bitwise(actual, source.to(destination_dtype))


def test_l2_norm_matches_torch(backend):
    module, device = backend
    for dtype in FLOAT_DTYPES:
        tensors = random_tensors(SIZES + [0], [dtype], device, seed=9)
        expected = torch.linalg.vector_norm(torch.cat([t.float().flatten() for t in tensors]))
        actual = module.l2_norm(tensors)
        assert actual.dtype is torch.float32 and actual.device.type == device
        torch.testing.assert_close(
            actual, expected, rtol=1e-4, atol=0
        )  # float32 sums in another order


@pytest.mark.parametrize("scale", [1e-30, 1e25])
def test_torch_backend_norm_of_tiny_or_huge_gradients_is_summed_in_double(scale):
    # float32 squares of these vanish or overflow; large tensors are summed a piece at a time.
    tensors = [torch.randn(3 * 2**20 + 5) * scale, torch.randn(7) * scale]
    expected = torch.linalg.vector_norm(torch.cat([t.double() for t in tensors])).float()
    assert torch.linalg.vector_norm(tensors[0]).item() in (0.0, float("inf"))
    torch.testing.assert_close(_torch_backend.l2_norm(tensors), expected, rtol=1e-6, atol=0)


# -- the dispatching interface --------------------------------------------------------------------


def test_interface_checks_parallel_lists():
    with pytest.raises(ValueError, match="as many destinations as sources"):
        kernels.copy_([torch.ones(3)], [])
    with pytest.raises(ValueError, match="same shape and device"):
        kernels.copy_([torch.ones(3)], [torch.ones(4)])
    with pytest.raises(ValueError, match="at least one tensor"):
        kernels.l2_norm([])


def test_interface_unscale_is_torch_on_cpu():
    tensors = random_tensors([100, 5], [torch.float16, torch.float32], "cpu")
    tensors[1][2] = float("inf")
    inv_scale = torch.full((), 0.125)
    expected, expected_found = reference_unscale(tensors, inv_scale, "cpu")
    found = torch.zeros(())
    kernels.unscale_(tensors, inv_scale, found)
    assert found.item() == expected_found.item() == 1.0
    for actual, wanted in zip(tensors, expected):
        assert_bitwise(actual, wanted)


def test_cuda_backend_reason_without_cuda(monkeypatch):
    monkeypatch.setattr(kernels.amp_state, "cuda_kernels", None)
    monkeypatch.setenv(kernels.DISABLE_ENV, "1")
    choice = kernels.cuda_backend()
    assert choice.name == "torch" and kernels.DISABLE_ENV in choice.reason
    monkeypatch.setattr(kernels.amp_state, "cuda_kernels", None)


def test_import_does_not_import_cupy():
    code = "import amp, sys; assert 'cupy' not in sys.modules; print('ok')"
    result = subprocess.run([os.sys.executable, "-c", code], capture_output=True, text=True)
    assert result.stdout.strip() == "ok", result.stderr


# -- launch layout (pure numpy) -------------------------------------------------------------------


def _kernel_signatures():
    """{kernel: (Meta depth, parameters after the Meta)} read from the CUDA source's own text."""
    source = _sources.source()
    found = {}
    # (the launch bounds may ask for a number of blocks an SM too: the compact steps do)
    pattern = r"__global__ void __launch_bounds__\(amp::kBlock(?:, [\w<>:]+)?\)\s*\n(\w+)\(([^)]*)\)"
    kernels = re.findall(pattern, source)
    # every kernel taking a Meta is read: a declaration the pattern misses fails here, not silently
    with_meta = [name for name, parameters in kernels if "amp::Meta<" in parameters]
    assert len(with_meta) == len(re.findall(r"__global__ void[^;{]*amp::Meta<", source))
    for name, parameters in kernels:
        parameters = [p.strip() for p in parameters.split(",")]
        meta = re.search(r"amp::Meta<(\d)>", parameters[0])
        if meta is not None:
            assert all("*" in p or p.split()[0] in ("double", "long") for p in parameters[1:])
            found[name] = (int(meta.group(1)), len(parameters) - 1)
    return found


def test_the_layout_knows_every_kernels_parameters_as_the_source_declares_them():
    assert _kernel_signatures() == _layout.KERNEL_PARAMETERS


@pytest.mark.parametrize("budget", [_layout.PARAM_BYTES_SMALL, _layout.PARAM_BYTES_LARGE])
@pytest.mark.parametrize("kernel", sorted(_layout.KERNEL_PARAMETERS))
def test_every_kernels_parameters_fit_the_budget_with_a_full_meta(budget, kernel):
    """A full Meta and the kernel's other parameters (8 bytes each) within the driver's limit:
    amp_adam's nine took 4104 of 4096 bytes when 64 were reserved for three. The compact Adam's
    Meta<8> holds 52 tensors in 4 KB, 430 in 32 KB."""
    depth, others = _layout.KERNEL_PARAMETERS[kernel]
    count = _layout.max_tensors(depth, budget)
    assert _layout.meta_dtype(depth, count).itemsize + 8 * others <= budget
    assert count >= (50 if budget == _layout.PARAM_BYTES_SMALL else 400)


def test_plan_covers_every_element_exactly_once():
    rng = np.random.default_rng(0)
    numels = list(rng.integers(0, 3 * _layout.CHUNK, size=40)) + [
        0,
        1,
        _layout.CHUNK,
        _layout.CHUNK + 1,
    ]
    launches = _layout.plan([range(1000, 1000 + len(numels))], numels, capacity=7)
    seen = {}
    kept = [n for n in numels if n > 0]
    slot_offset = 0
    for launch in launches:
        count = int(launch.meta[0]["ntensors"])
        for slot, first, n in _layout.simulate(launch):
            tensor = slot_offset + slot
            assert n > 0
            seen.setdefault(tensor, []).append((first, n))
        slot_offset += count
    for tensor, pieces in seen.items():
        pieces.sort()
        assert pieces[0][0] == 0
        assert all(a[0] + a[1] == b[0] for a, b in zip(pieces, pieces[1:]))
        assert pieces[-1][0] + pieces[-1][1] == kept[tensor]
    assert len(seen) == len(kept)
    assert [launch.first_chunk for launch in launches] == list(
        np.cumsum([0] + [launch.chunks for launch in launches[:-1]])
    )


def test_plan_handles_more_than_2_to_the_31_elements():
    numel = 2**31 + 5
    (launch,) = _layout.plan([[4096]], [numel], capacity=8)
    last = _layout.simulate(launch)[-1]
    assert last[1] + last[2] == numel and launch.chunks == -(-numel // _layout.CHUNK)


# -- the CUDA source compiles ---------------------------------------------------------------------


def _nvcc_architectures():
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return []
    listed = subprocess.run(
        [nvcc, "--list-gpu-arch"], capture_output=True, text=True
    ).stdout.split()
    return [
        arch.replace("compute_", "sm_")
        for arch in listed
        if arch in ("compute_75", "compute_80", "compute_90")
    ]


# One kernel of each kind the step families build (their dozens of variants: the next test).
_STEP_SAMPLES = (
    "amp_adam<__nv_bfloat16, __nv_bfloat16>",
    "amp_sgd<float, float>",
    "amp_count_steps",
    "amp_compact_adam<__nv_bfloat16, amp::Compact, amp::Codes8>",
    "amp_compact_adam<__half, amp::Remainder, __nv_bfloat16>",
    "amp_compact_sgd<float, amp::Exact<__half>, amp::Codes8>",
    "amp_compact_count_steps",
)


def _nvcc(tmp_path, families, instantiate, *options):
    """nvcc over the families' source, compiling kernels `instantiate`; its CompletedProcess."""
    source = tmp_path / "kernels.cu"
    source.write_text(_sources.source(families, instantiate))
    return subprocess.run(
        ["nvcc", "-std=c++17", *options, str(source)], capture_output=True, text=True
    )


def _sampled():
    """Every kernel of the small families and _STEP_SAMPLES of the step families."""
    light = [f for f in _sources.FAMILIES if f not in _sources.STEP_FAMILIES]
    names = [name for family in light for name in _sources.FAMILIES[family].names]
    return tuple(_sources.FAMILIES), names + list(_STEP_SAMPLES)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
@pytest.mark.parametrize("budget", [_layout.PARAM_BYTES_SMALL, _layout.PARAM_BYTES_LARGE])
@pytest.mark.parametrize("formula", [(), _sources.GPU_OPTIONS], ids=["cpu-adam", "cuda-adam"])
def test_source_compiles_with_nvcc(tmp_path, budget, formula):
    """Every family, both AdamW formulas, to PTX for each architecture (the machine code of the
    build CuPy makes, every variant, is the next test's)."""
    architectures = _nvcc_architectures()
    assert architectures, "nvcc knows none of sm_75, sm_80, sm_90"
    for arch in architectures:
        virtual = arch.replace("sm_", "compute_")
        result = _nvcc(
            tmp_path, *_sampled(), f"-arch={virtual}", "-ptx", "-o", str(tmp_path / "k.ptx"),
            *_layout.compile_options(budget), *formula,
        )
        assert result.returncode == 0, result.stderr


# The compact family's 67 kernels take nvcc about 27 s on two cores: make test-all compiles them
# all; make test compiles a sample of its kernels with every family's source (the tests above).
_FAMILY_CASES = [
    pytest.param(family, marks=pytest.mark.slow) if family == "compact" else family
    for family in sorted(_sources.FAMILIES)
]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
@pytest.mark.parametrize("family", _FAMILY_CASES)
def test_each_family_compiles_alone_to_machine_code_as_cupy_builds_it(tmp_path, family):
    """A family's files alone (CuPy compiles each apart), every name it lists, its options,
    -ftz=true last, sm_90."""
    arch = _nvcc_architectures()[-1]
    result = _nvcc(
        tmp_path, (family,), True, f"-arch={arch}", "-cubin", "-o", str(tmp_path / "k.cubin"),
        *_layout.compile_options(_layout.PARAM_BYTES_LARGE), *_sources.GPU_OPTIONS, "-ftz=true",
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
def test_ptx_has_no_flushing_arithmetic_even_with_ftz(tmp_path):
    """CuPy appends -ftz=true; the kernels' arithmetic must still keep subnormals. (With torch's
    CUDA formula, powf's own arithmetic takes its flush-to-zero variant: it differs only where an
    operand or the result is subnormal, and 1 - beta**step rounds to 1 there either way.)"""
    ptx = tmp_path / "kernels.ptx"
    arch = _nvcc_architectures()[-1].replace("sm_", "compute_")
    result = _nvcc(
        tmp_path, *_sampled(), f"-arch={arch}", "-ptx", "-ftz=true", "-o", str(ptx),
        *_layout.compile_options(_layout.PARAM_BYTES_LARGE),
    )
    assert result.returncode == 0, result.stderr
    text = ptx.read_text()
    for op in ("mul", "add", "sub", "div", "sqrt", "fma"):  # the fused steps' arithmetic too
        assert f"{op}.rn.f32" in text and f"{op}.rn.ftz.f32" not in text, op
        # nor the compiler's own (a * b: mul.ftz.f32), which the 8-bit codes' fast paths once took
        assert f"\t{op}.ftz.f32" not in text, op
    assert ".local" not in text  # the Meta struct is read from parameter space, never copied


# -- the CuPy backend's host side, on the emulated CuPy ---------------------------------------------


def test_emulated_backend_launches_kernels_and_falls_back_for_the_rest(monkeypatch):
    module, launches = fake_cupy.install(monkeypatch)
    tensors = [torch.randn(100), torch.randn(10, 10).t(), torch.randn(7, dtype=torch.float64)]
    expected = [t * 0.5 for t in tensors]
    module.unscale_(tensors, torch.full((), 0.5), torch.zeros(()))
    assert [name for name, _, _ in launches.calls] == ["amp_unscale<float>"]
    for actual, wanted in zip(tensors, expected):
        assert_bitwise(actual, wanted)


def test_emulated_backend_splits_long_lists_at_4_kb_of_parameters(monkeypatch):
    monkeypatch.setenv("AMP_KERNEL_PARAM_BYTES", str(_layout.PARAM_BYTES_SMALL))
    module, launches = fake_cupy.install(monkeypatch)
    tensors = random_tensors([3, 0, 65537] * 200, [torch.float16], "cpu", seed=11)
    tensors[-1][-1] = float("inf")
    inv_scale = torch.full((), 0.5)
    expected, _ = reference_unscale(tensors, inv_scale, "cpu")
    found = torch.zeros(())
    module.unscale_(tensors, inv_scale, found)
    capacity = _layout.max_tensors(1, _layout.PARAM_BYTES_SMALL)
    assert len(launches.calls) == -(-400 // capacity)  # empty tensors take no slot
    assert found.item() == 1.0
    for actual, wanted in zip(tensors, expected):
        assert_bitwise(actual, wanted)


# -- only on a GPU ------------------------------------------------------------------------------------


@pytest.fixture
def cupy_backend():
    if not HAS_CUDA:
        pytest.skip("needs a CUDA device")
    choice = kernels.cuda_backend()
    assert choice.name == "cupy", f"the CuPy backend is not in use: {choice.reason}"
    return choice.module


@pytest.mark.cuda
def test_cuda_no_host_synchronisation(cupy_backend):
    tensors = random_tensors([1000, 70000], [torch.float16, torch.float32], "cuda")
    masters = [torch.empty(t.shape, device="cuda") for t in tensors]
    found = torch.zeros((), device="cuda")
    inv = torch.full((), 0.5, device="cuda")
    kernels.unscale_(tensors, inv, found)  # compile and load outside the checked region
    kernels.unscale_to_(tensors, masters, inv, found)
    kernels.copy_(masters, tensors)
    kernels.l2_norm(masters)
    torch.cuda.set_sync_debug_mode("error")
    try:
        kernels.unscale_(tensors, inv, found)
        kernels.unscale_to_(tensors, masters, inv, found)
        kernels.unscale_add_(tensors, masters, inv, found)
        kernels.copy_(masters, tensors)
        kernels.l2_norm(masters)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.cuda
def test_cuda_kernels_run_on_the_current_stream(cupy_backend):
    stream = torch.cuda.Stream()
    source = torch.randn(1 << 22, device="cuda")
    with torch.cuda.stream(stream):
        produced = source * 4.0  # queued on `stream`; the kernel must run after it
        kernels.unscale_(
            [produced], torch.full((), 0.25, device="cuda"), torch.zeros((), device="cuda")
        )
        result = produced.clone()
    stream.synchronize()
    assert_bitwise(result, source)


@pytest.mark.cuda
def test_cuda_forced_small_parameter_layout(cupy_backend, monkeypatch):
    monkeypatch.setenv("AMP_KERNEL_PARAM_BYTES", str(_layout.PARAM_BYTES_SMALL))
    monkeypatch.setattr(cupy_backend.cuda, "_gpus", {})  # compiled anew, for the small layout
    monkeypatch.setattr(cupy_backend.cuda, "_plans", {})
    tensors = random_tensors([5, 0, 70000] * 150, FLOAT_DTYPES, "cuda", seed=12)
    tensors[-1][-1] = float("nan")
    inv = torch.full((), 0.5, device="cuda")
    expected, _ = reference_unscale(tensors, inv, "cuda")
    found = torch.zeros((), device="cuda")
    kernels.unscale_(tensors, inv, found)
    assert found.item() == 1.0
    for actual, wanted in zip(tensors, expected):
        assert_bitwise(actual, wanted)


@pytest.mark.cuda
def test_cuda_more_than_2_to_the_31_elements(cupy_backend):
    numel = 2**31 + 5
    free, _ = torch.cuda.mem_get_info()
    if free < numel * (2 + 4) + 2**30:
        pytest.skip("needs about 13 GB of free GPU memory")
    grads = torch.full((numel,), 2.0, dtype=torch.float16, device="cuda")
    grads[-1] = float("inf")
    masters = torch.empty(numel, dtype=torch.float32, device="cuda")
    found = torch.zeros((), device="cuda")
    kernels.unscale_to_([grads], [masters], torch.full((), 0.5, device="cuda"), found)
    assert found.item() == 1.0
    assert masters[-1].item() == float("inf")
    assert (masters[-1000:-1] == 1.0).all() and masters[0].item() == 1.0


@pytest.mark.cuda
def test_cuda_o2_training_uses_the_kernels(cupy_backend):
    import amp

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)
    ).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
    try:
        for step in range(5):
            x = torch.randn(32, 64, device="cuda")
            with amp.scale_loss(model(x).square().mean(), optimizer) as scaled:
                scaled.backward()
                if step == 2:
                    model[0].weight.grad.view(-1)[0] = float("inf")
            optimizer.step()
            optimizer.zero_grad()
        for param, master in zip(model.parameters(), amp.master_params(optimizer)):
            assert torch.equal(param, master.half())
        assert amp.state_dict()["loss_scaler0"]["loss_scale"] == 32768.0
        assert amp.last_overflow().params == ("0.weight",)
    finally:
        amp.deinitialize()


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_cuda_exact_bf16_masters_are_torchs_fused_step_on_fp32_copies(cupy_backend, kind):
    """O2 bf16 (masters: the weight and an int16 remainder) against torch's CUDA fused step on
    FP32 copies fed the FP32 gradients amp.master_params reports, step by step. The CuPy build
    steps AdamW with torch's CUDA formula (step_math.cu; 64 ulps apart on the H200 on 2026-11-28
    with the CPU formula; tests/kernels/test_cuda_adam_formula.py holds it on the emulated grid)."""
    import amp

    def make(params):
        if kind == "adamw":
            return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, fused=True)
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, fused=True)

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)
    ).cuda()
    optimizer = make(model.parameters())
    amp.initialize(model, optimizer, opt_level="O2", dtype=torch.bfloat16, verbosity=0)
    try:
        copies = [m.detach().clone() for m in amp.master_params(optimizer)]
        reference = make(copies)
        for step in range(4):
            x = torch.randn(32, 64, device="cuda")
            with amp.scale_loss(model(x).float().square().mean(), optimizer) as scaled:
                scaled.backward()
            for copy, master in zip(copies, amp.master_params(optimizer)):
                copy.grad = master.grad.detach().float().clone()
            optimizer.step()
            reference.step()
            optimizer.zero_grad()
            masters = [m.detach() for m in amp.master_params(optimizer)]
            ulps = [
                (m.view(torch.int32) - c.view(torch.int32)).abs().max().item()
                for m, c in zip(masters, copies)
            ]
            assert ulps == [0] * len(ulps), (step, ulps)
    finally:
        amp.deinitialize()


def test_unscaling_tensors_on_one_device_is_one_backend_call():
    from amp import kernels

    tensors = [torch.full((3,), 4.0) for _ in range(10)]
    found_inf = torch.zeros(())
    inv_scale = torch.full((), 0.5)
    own, _, names = profile_calls(lambda: kernels.unscale_(tensors, inv_scale, found_inf))
    assert own == 3, names  # unscale_, _flagged, the backend's unscale_
    assert all(torch.equal(t, torch.full((3,), 2.0)) for t in tensors)
    assert found_inf.item() == 0.0
    tensors[3][1] = float("inf")
    kernels.unscale_(tensors, inv_scale, found_inf)
    assert found_inf.item() == 1.0

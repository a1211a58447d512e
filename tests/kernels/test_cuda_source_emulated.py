"""multi_tensor.cu executed on the CPU: the CUDA source itself, compiled with g++ against the shim
in tests/helpers/cuda_emulation, behind amp's unmodified CuPy backend (tests/helpers/fake_cupy.py,
"compiled").

Every kernel the backend launches is checked bit for bit against torch and against the torch
backend, with the threads of each block run in three orders between barriers. The source is
compiled once per session (and cached on disk, keyed by its text and flags).
"""

import numpy as np
import pytest
import torch

from helpers import fake_cupy
from amp.kernels import _layout, _torch_backend
from helpers.cuda_emulation import build

pytestmark = pytest.mark.skipif(
    build.compiler() is None,
    reason="g++ is not installed: these tests compile multi_tensor.cu for the CPU with it",
)

FLOAT_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Tensor sizes around the vector width (4), the block's stride and the chunk (65536).
SIZES = [0, 1, 3, 4, 5, 2047, 4096 + 3, 65536, 65537, 2 * 65536 + 11]
ORDERS = [("forward", 0), ("reversed", 0), ("shuffled", 1)]


def _name(dtype):
    return str(dtype).removeprefix("torch.")


def _pair_id(pair):
    return f"{_name(pair[0])}-{_name(pair[1])}"


@pytest.fixture(params=ORDERS, ids=[order for order, _ in ORDERS])
def kernel(request, monkeypatch):
    """The CuPy backend on compiled kernels, threads run in one order; .launched() names them."""
    order, seed = request.param
    module, launches = fake_cupy.install(monkeypatch, kernels="compiled", order=order, seed=seed)
    module.launched = lambda: [name for name, _, _ in launches.calls]
    return module


def sample(size, dtype, seed):
    """Values of every kind `dtype` holds: ordinary, subnormal, near its largest, signed zeros."""
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(size, generator=generator) * 1000
    info = torch.finfo(dtype)
    special = torch.tensor(
        [info.smallest_normal / 3, -info.smallest_normal / 7, info.max * 0.75, -info.max, 0.0, -0.0]
    )
    count = min(size, len(special))
    values[torch.randperm(size, generator=generator)[:count]] = special[:count]
    return values.to(dtype)


def tensors_for(dtype, seed):
    """Tensors of SIZES plus contiguous views at odd offsets (unaligned for vector access)."""
    tensors = [sample(size, dtype, seed + i) for i, size in enumerate(SIZES)]
    base = sample(70000 + 9, dtype, seed + 99)
    return tensors + [base[1:70001], base[70003:70009]]


def assert_bitwise(actual, expected):
    for a, e in zip(actual, expected, strict=True):
        assert a.dtype == e.dtype
        torch.testing.assert_close(a, e, rtol=0, atol=0, equal_nan=True)


def clones(tensors):
    return [t.clone() for t in tensors]


# -- unscale_ ------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=_name)
def test_unscale_matches_torch_and_the_torch_backend(kernel, dtype):
    tensors = tensors_for(dtype, seed=1)
    inv_scale = torch.full((), 1 / 3.0)
    expected, expected_found = clones(tensors), torch.zeros(())
    torch._amp_foreach_non_finite_check_and_unscale_(expected, expected_found, inv_scale)
    by_torch_backend, torch_backend_found = clones(tensors), torch.zeros(())
    _torch_backend.unscale_(by_torch_backend, inv_scale, torch_backend_found)
    found = torch.zeros(())
    kernel.unscale_(tensors, inv_scale, found)
    assert kernel.launched() == [f"amp_unscale<{fake_cupy.TYPE_NAMES[dtype]}>"]
    assert_bitwise(tensors, expected)
    assert_bitwise(tensors, by_torch_backend)
    assert found.item() == expected_found.item() == torch_backend_found.item() == 0.0


@pytest.mark.parametrize("where", [(1, 0), (18, 65535), (30, 65536), (9, -1), (21, 0)])
def test_unscale_flags_a_nonfinite_value_anywhere(kernel, where):
    tensors = [t for dtype in FLOAT_DTYPES for t in tensors_for(dtype, seed=2)[:11]]
    tensors[where[0]][where[1]] = float("nan") if where[0] % 2 else float("-inf")
    inv_scale = torch.full((), 2.0**-12)
    expected, expected_found = clones(tensors), torch.zeros(())
    for dtype in FLOAT_DTYPES:
        group = [t for t in expected if t.dtype == dtype]
        torch._amp_foreach_non_finite_check_and_unscale_(group, expected_found, inv_scale)
    found = torch.zeros(())
    kernel.unscale_(tensors, inv_scale, found)
    assert len(kernel.launched()) == 3
    assert found.item() == expected_found.item() == 1.0
    assert_bitwise(tensors, expected)  # every element is written, the non-finite ones too


def test_unscale_split_over_many_parameter_blocks(kernel, monkeypatch):
    monkeypatch.setenv("AMP_KERNEL_PARAM_BYTES", str(_layout.PARAM_BYTES_SMALL))
    tensors = [sample(size, torch.float16, i) for i, size in enumerate([3, 0, 700, 4] * 150)]
    tensors[-2][-1] = float("inf")
    inv_scale = torch.full((), 0.5)
    expected, expected_found = clones(tensors), torch.zeros(())
    torch._amp_foreach_non_finite_check_and_unscale_(expected, expected_found, inv_scale)
    found = torch.zeros(())
    kernel.unscale_(tensors, inv_scale, found)
    capacity = _layout.max_tensors(1, _layout.PARAM_BYTES_SMALL)
    assert len(kernel.launched()) == -(-450 // capacity) > 1  # empty tensors take no slot
    assert found.item() == expected_found.item() == 1.0
    assert_bitwise(tensors, expected)


# -- the two-list kernels ------------------------------------------------------------------------


def pair_lists(pair, seed):
    sources = tensors_for(pair[0], seed)
    destinations = [sample(s.numel(), pair[1], seed + 50 + i) for i, s in enumerate(sources)]
    return sources, destinations


def run_all_three(function, sources, destinations, inv_scale, kernel):
    """(destinations, found) from torch's own ops, the torch backend and the kernel."""
    results = []
    for module in (None, _torch_backend, kernel):
        dst, found = clones(destinations), torch.zeros(())
        if module is None:
            for source, destination in zip(sources, dst):
                product = source.float() * inv_scale
                if function == "unscale_add_":
                    product = destination.float() + product
                destination.copy_(product)  # one rounding, into the destination's dtype
            found.fill_(float(not all(torch.isfinite(s).all() for s in sources)))
        else:
            getattr(module, function)(sources, dst, inv_scale, found)
        results.append((dst, found.item()))
    return results


@pytest.mark.parametrize("function", ["unscale_to_", "unscale_add_"])
@pytest.mark.parametrize("pair", _layout.DTYPE_PAIRS, ids=_pair_id)
def test_scaled_kernels_match_torch_and_the_torch_backend(kernel, function, pair):
    sources, destinations = pair_lists(pair, seed=3)
    sources[4][2] = float("inf")
    inv_scale = torch.full((), 2.0**-10 / 3)  # not a power of two: the multiply rounds
    (expected, expected_found), (backend, backend_found), (actual, found) = run_all_three(
        function, sources, destinations, inv_scale, kernel
    )
    kernel_name = "amp_scale_copy" if function == "unscale_to_" else "amp_scale_add"
    names = fake_cupy.TYPE_NAMES
    assert kernel.launched() == [f"{kernel_name}<{names[pair[0]]}, {names[pair[1]]}>"]
    assert_bitwise(actual, expected)
    assert_bitwise(backend, expected)
    assert found == expected_found == backend_found == 1.0


@pytest.mark.parametrize("function", ["unscale_to_", "unscale_add_"])
def test_one_rounding_into_float16(kernel, function):
    # 70000 is beyond float16, 70000 * 2**-10 = 68.359375 is not: 68.375 once rounded, no overflow.
    sources = [torch.tensor([70000.0, 1.0 + 2.0**-11 + 2.0**-20, -3.0e-8])]
    destinations = [torch.zeros(3, dtype=torch.float16)]
    inv_scale = torch.full((), 2.0**-10)
    for dst, found in run_all_three(function, sources, destinations, inv_scale, kernel):
        assert dst[0][0].item() == 68.375 and found == 0.0


def test_two_list_kernels_split_over_many_parameter_blocks(kernel, monkeypatch):
    monkeypatch.setenv("AMP_KERNEL_PARAM_BYTES", str(_layout.PARAM_BYTES_SMALL))
    sizes = [5, 0, 300] * 110
    sources = [sample(size, torch.float32, i) for i, size in enumerate(sizes)]
    destinations = [sample(size, torch.float16, i + 1000) for i, size in enumerate(sizes)]
    sources[-1][-1] = float("nan")
    inv_scale = torch.full((), 1 / 3.0)
    (expected, expected_found), (backend, backend_found), (actual, found) = run_all_three(
        "unscale_add_", sources, destinations, inv_scale, kernel
    )
    capacity = _layout.max_tensors(2, _layout.PARAM_BYTES_SMALL)
    assert len(kernel.launched()) == -(-220 // capacity) > 1
    assert_bitwise(actual, expected)
    assert_bitwise(backend, expected)
    assert found == expected_found == backend_found == 1.0


@pytest.mark.parametrize("pair", _layout.DTYPE_PAIRS, ids=_pair_id)
def test_copy_matches_torch(kernel, pair):
    sources, destinations = pair_lists(pair, seed=4)
    sources[1][0] = float("nan")
    kernel.copy_(sources, destinations)
    assert kernel.launched() == [
        f"amp_scale_copy<{fake_cupy.TYPE_NAMES[pair[0]]}, {fake_cupy.TYPE_NAMES[pair[1]]}>"
    ]
    assert_bitwise(destinations, [s.to(pair[1]) for s in sources])


# -- the L2 norm -----------------------------------------------------------------------------------


def exact_norm(tensors):
    return torch.linalg.vector_norm(torch.cat([t.double().flatten() for t in tensors]))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=_name)
def test_l2_norm_matches_torch(kernel, dtype, monkeypatch):
    monkeypatch.setenv("AMP_KERNEL_PARAM_BYTES", str(_layout.PARAM_BYTES_SMALL))
    # Finite values of ordinary size, over several launches (partial sums at an offset).
    tensors = [torch.randn(size).to(dtype) for size in [3, 0, 700] * 120 + SIZES]
    actual = kernel.l2_norm(tensors)
    assert kernel.launched()[-1] == "amp_norm_finalize" and len(kernel.launched()) > 2
    expected = exact_norm(tensors).float()
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=0)
    torch.testing.assert_close(_torch_backend.l2_norm(tensors), expected, rtol=1e-5, atol=0)


@pytest.mark.parametrize("value", [1e-19, 1e-40, 3e19], ids=["tiny", "subnormal", "huge"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_name)
def test_l2_norm_survives_flush_to_zero(kernel, dtype, value):
    # Squares below 2**-126 flush to zero under CuPy's -ftz=true; squares above 2**128 overflow.
    tensors = [torch.full((1000,), value).to(dtype), torch.full((24,), -value).to(dtype)]
    expected = exact_norm(tensors).float()
    assert expected.item() != 0.0 and expected.isfinite()
    torch.testing.assert_close(kernel.l2_norm(tensors), expected, rtol=2e-7, atol=0)
    torch.testing.assert_close(_torch_backend.l2_norm(tensors), expected, rtol=2e-7, atol=0)


# -- the emulation itself --------------------------------------------------------------------------

PROBES = r"""
__device__ float probe_mul_rn(float a, float b) {
  float r;
  asm("mul.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}
__global__ void last_writer(int* out) { out[0] = threadIdx.x; }
__global__ void diverge(int* out) {
  if (threadIdx.x == 3) return;
  __syncthreads();
  out[0] = 1;
}
__global__ void vote(int* out, int who) {
  out[blockIdx.x * blockDim.x + threadIdx.x] = __syncthreads_or(threadIdx.x == who);
}
__global__ void block_sums(const int* in, int* out) {
  __shared__ int values[64];
  values[threadIdx.x] = in[blockIdx.x * blockDim.x + threadIdx.x];
  __syncthreads();
  if (threadIdx.x == 0) {
    int sum = 0;
    for (int i = 0; i < 64; ++i) sum += values[i];
    out[blockIdx.x] = sum;
  }
}
__global__ void products(const float* a, const float* b, float* plain, float* rn) {
  plain[threadIdx.x] = a[threadIdx.x] * b[threadIdx.x];
  rn[threadIdx.x] = probe_mul_rn(a[threadIdx.x], b[threadIdx.x]);
}
__device__ float probe_sub(float a, float b) {
  float r;
  asm("sub.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}
__device__ float probe_div(float a, float b) {
  float r;
  asm("div.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}
__device__ float probe_sqrt(float a) {
  float r;
  asm("sqrt.rn.f32 %0, %1;" : "=f"(r) : "f"(a));
  return r;
}
__device__ float probe_fma(float a, float b, float c) {
  float r;
  asm("fma.rn.f32 %0, %1, %2, %3;" : "=f"(r) : "f"(a), "f"(b), "f"(c));
  return r;
}
__global__ void arithmetic(const float* a, const float* b, const float* c, float* out) {
  const int i = threadIdx.x, n = blockDim.x;
  out[i] = probe_sub(a[i], b[i]);
  out[n + i] = probe_div(a[i], b[i]);
  out[2 * n + i] = probe_sqrt(a[i]);
  out[3 * n + i] = probe_fma(a[i], b[i], c[i]);
}
__global__ void warp_max(const unsigned int* in, unsigned int* out) {
  const unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
  unsigned int x = in[i];
  for (int offset = 16; offset > 0; offset >>= 1) {
    const unsigned int other = __shfl_xor_sync(0xffffffffu, x, offset);
    x = other > x ? other : x;
  }
  out[i] = x;
}
__global__ void partners(const float* in, float* floats, int* ints) {
  floats[threadIdx.x] = __shfl_xor_sync(0xffffffffu, in[threadIdx.x], 1);
  ints[threadIdx.x] = __shfl_xor_sync(0xffffffffu, static_cast<int>(threadIdx.x), 6);
}
__global__ void paced(int* out) {
  __shared__ int seen[64];
  int x = threadIdx.x;
  if (threadIdx.x < 32) {  // the first warp shuffles three times, the second not at all
    for (int k = 0; k < 3; ++k) x = __shfl_xor_sync(0xffffffffu, x, 1);
  }
  seen[threadIdx.x] = x;
  __syncthreads();
  out[blockIdx.x * blockDim.x + threadIdx.x] = seen[63 - threadIdx.x];
}
__global__ void lane_missing(int* out) {
  if (threadIdx.x == 5) return;
  out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, static_cast<int>(threadIdx.x), 1);
}
__global__ void half_warp(int* out) {
  out[threadIdx.x] = __shfl_xor_sync(0x0000ffffu, static_cast<int>(threadIdx.x), 1);
}
"""
PROBE_NAMES = ["last_writer", "diverge", "vote", "block_sums", "products", "arithmetic"]
PROBE_NAMES += ["warp_max", "partners", "paced", "lane_missing", "half_warp"]


@pytest.fixture(
    scope="module",
    params=[(False, True), (True, True), (True, False)],
    ids=["no-ftz", "ftz", "ftz-ucontext"],
)
def probes(request):
    """The probes compiled as CuPy would, threads switched by the shim's fast switch (x86-64) or
    by ucontexts (elsewhere, and where a shadow stack is in force)."""
    ftz, fast = request.param
    options = ("-std=c++17", "-ftz=true" if ftz else "-ftz=false")
    if not fast:
        options += ("-DAMP_EMU_FAST_SWITCH=0",)
    return build.compile_module(PROBES, options, PROBE_NAMES)


def test_thread_order_within_a_phase_is_what_the_launch_asks(probes):
    out = torch.full((1,), -1, dtype=torch.int32)
    last = {}
    for order in ("forward", "reversed", "shuffled"):
        probes.launch("last_writer", (1,), (64,), (out.data_ptr(),), order=order, seed=3)
        last[order] = out.item()
    assert last["forward"] == 63 and last["reversed"] == 0 and last["shuffled"] not in (0, 63)


def test_threads_that_miss_a_barrier_are_an_error(probes):
    out = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(build.KernelError, match="1 threads returned, 63 wait at __syncthreads"):
        probes.launch("diverge", (1,), (64,), (out.data_ptr(),))


@pytest.mark.parametrize("who", [-1, 0, 37])
def test_syncthreads_or_and_shared_memory_per_block(probes, who):
    out = torch.full((3 * 64,), -1, dtype=torch.int32)
    probes.launch("vote", (3,), (64,), (out.data_ptr(), np.int32(who)), order="shuffled", seed=7)
    assert out.tolist() == [int(who >= 0)] * (3 * 64)
    values = torch.arange(3 * 64, dtype=torch.int32)
    sums = torch.zeros(3, dtype=torch.int32)
    probes.launch("block_sums", (3,), (64,), (values.data_ptr(), sums.data_ptr()), order="reversed")
    assert sums.tolist() == values.view(3, 64).sum(1).tolist()


@pytest.mark.parametrize("order", ["forward", "reversed", "shuffled"])
def test_a_warp_shuffle_exchanges_the_values_of_its_32_threads(probes, order):
    generator = torch.Generator().manual_seed(5)
    values = torch.randint(0, 2**31 - 1, (3 * 64,), generator=generator, dtype=torch.int32)
    out = torch.zeros_like(values)
    probes.launch("warp_max", (3,), (64,), (values.data_ptr(), out.data_ptr()), order=order)
    assert out.tolist() == values.view(6, 32).amax(1).repeat_interleave(32).tolist()
    floats, ints = torch.zeros(64), torch.zeros(64, dtype=torch.int32)
    source = torch.arange(64, dtype=torch.float32) / 3
    probes.launch(
        "partners",
        (1,),
        (64,),
        (source.data_ptr(), floats.data_ptr(), ints.data_ptr()),
        order=order,
    )
    lanes = torch.arange(64)
    assert torch.equal(floats, source[lanes ^ 1]) and ints.tolist() == (lanes ^ 6).tolist()


def test_warps_shuffle_at_their_own_pace_between_barriers(probes):
    out = torch.zeros(2 * 64, dtype=torch.int32)
    probes.launch("paced", (2,), (64,), (out.data_ptr(),), order="shuffled", seed=2)
    seen = 63 - torch.arange(64)
    expected = torch.where(seen < 32, seen ^ 1, seen)  # three swaps with the neighbour: one
    assert out.tolist() == expected.tolist() * 2


def test_a_shuffle_the_whole_warp_does_not_reach_is_an_error(probes):
    out = torch.zeros(64, dtype=torch.int32)
    with pytest.raises(build.KernelError, match="31 threads wait at __shfl_xor_sync"):
        probes.launch("lane_missing", (1,), (64,), (out.data_ptr(),))
    with pytest.raises(build.KernelError, match="full warp only"):
        probes.launch("half_warp", (1,), (64,), (out.data_ptr(),))


def test_arguments_are_checked_against_the_kernel_parameters(probes):
    out = torch.zeros(64, dtype=torch.int32)
    with pytest.raises(build.KernelError, match="argument 1 has 8 bytes, the kernel's parameter 4"):
        probes.launch("vote", (1,), (64,), (out.data_ptr(), 5))  # a Python int is 64-bit
    probes.launch("vote", (1,), (64,), (out.data_ptr(), np.int32(5)))
    assert out.tolist() == [1] * 64


@pytest.mark.skipif(not build.HAS_FTZ, reason="flush-to-zero is emulated with x86's MXCSR")
def test_ftz_flushes_plain_float_arithmetic_but_not_inline_ptx(probes):
    a = torch.tensor([1e-20, 1e-40, 3.0, -2e-39] * 16)
    b = torch.tensor([1e-20, 2.0, 1 / 3.0, 0.5] * 16)
    plain, rn = torch.empty(64), torch.empty(64)
    probes.launch(
        "products", (1,), (64,), (a.data_ptr(), b.data_ptr(), plain.data_ptr(), rn.data_ptr())
    )
    exact = a * b  # torch on the CPU keeps subnormals
    assert exact[0] != 0 and exact[1] != 0
    assert_bitwise([rn], [exact])
    if probes.ftz:
        assert plain[:4].tolist() == [0.0, 0.0, exact[2].item(), -0.0]
    else:
        assert_bitwise([plain], [exact])


def test_the_fused_steps_ptx_is_computed_exactly_with_subnormals_kept(probes):
    a = torch.tensor([2e-39, 5.0, 1e-30, 7.0, 3e-39, 0.1] * 8)
    b = torch.tensor([1e-39, 3.0, 1e8, 1e-10, 2e-39, 0.3] * 8)
    c = torch.tensor([1e-40, -15.0, -1e-22, 1.0, -6e-78, 0.03] * 8)
    out = torch.empty(4 * 48)
    probes.launch("arithmetic", (1,), (48,), tuple(t.data_ptr() for t in (a, b, c, out)))
    # torch on the CPU computes each in IEEE float32 with subnormals (fma in float64 is exact
    # here: the products fit its 53 bits, and the sum rounds once to float32 but for ties).
    exact_fma = (a.double() * b.double() + c.double()).float()
    expected = torch.cat([a - b, a / b, a.sqrt(), exact_fma])
    assert_bitwise([out], [expected])
    assert (expected[:48] != 0).any() and expected[:48].abs().min() < 1.2e-38  # subnormals


def test_unknown_inline_ptx_fails_the_build():
    source = """__global__ void k(float* out) {
      float r, a = 1.0f, b = 2.0f;
      asm("min.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
      out[0] = r;
    }"""
    with pytest.raises(RuntimeError, match="inline PTX the CUDA emulation does not compute"):
        build.compile_module(source, ("-std=c++17",), ["k"])


CONVERSIONS = r"""
__global__ void half_to_float(const unsigned short* in, float* out, long long n) {
  for (long long i = threadIdx.x; i < n; i += blockDim.x) {
    __half h;
    memcpy(&h, in + i, sizeof(h));
    out[i] = __half2float(h);
  }
}
__global__ void float_to_half(const float* in, unsigned short* out, long long n) {
  for (long long i = threadIdx.x; i < n; i += blockDim.x) {
    const __half h = __float2half_rn(in[i]);
    memcpy(out + i, &h, sizeof(h));
  }
}
"""


@pytest.mark.parametrize("cuda_headers", [True, False], ids=["cuda-headers", "fallback"])
def test_half_conversions_are_exact(cuda_headers):
    if cuda_headers and build.cuda_include() is None:
        pytest.skip("CUDA's headers are not installed")
    module = build.compile_module(
        CONVERSIONS,
        ("-std=c++17",),
        ["half_to_float", "float_to_half"],
        use_cuda_headers=cuda_headers,
    )
    every_half = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    floats = torch.empty(2**16)
    module.launch("half_to_float", (1,), (256,), (every_half.data_ptr(), floats.data_ptr(), 2**16))
    assert_bitwise([floats], [every_half.view(torch.float16).float()])
    # Every half, the float halfway to its neighbour and one float ulp either side of that,
    # subnormals, overflow and NaN included; and random float bit patterns.
    finite = floats[floats.isfinite()].sort().values.unique()
    middles = (finite[:-1].double() + finite[1:].double()).div(2).float()
    near = torch.cat([middles, middles.nextafter(middles + 1), middles.nextafter(middles - 1)])
    random = torch.randint(-(2**31), 2**31 - 1, (200_000,), dtype=torch.int32).view(torch.float32)
    sources = torch.cat([floats, near, random, torch.tensor([65519.99, 65520.0, 1e-8, 2.0**-25])])
    halves = torch.empty(sources.numel(), dtype=torch.int16)
    module.launch(
        "float_to_half", (1,), (256,), (sources.data_ptr(), halves.data_ptr(), sources.numel())
    )
    assert_bitwise([halves.view(torch.float16)], [sources.half()])


def test_the_fallback_headers_run_the_kernels(monkeypatch):
    module, launches = fake_cupy.install(monkeypatch, kernels="compiled", cuda_headers=False)
    for dtype in (torch.float16, torch.bfloat16):
        tensors = tensors_for(dtype, seed=5)
        expected = clones(tensors)
        torch._amp_foreach_non_finite_check_and_unscale_(
            expected, torch.zeros(()), torch.full((), 0.1)
        )
        module.unscale_(tensors, torch.full((), 0.1), torch.zeros(()))
        assert_bitwise(tensors, expected)
        sources = tensors_for(torch.float32, seed=6)
        destinations = [torch.empty(s.shape, dtype=dtype) for s in sources]
        module.copy_(sources, destinations)
        assert_bitwise(destinations, [s.to(dtype) for s in sources])
    assert len(launches.calls) == 4

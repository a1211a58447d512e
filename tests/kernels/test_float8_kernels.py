"""float8*.cu on the emulated grid (compiled for the CPU: tests/helpers/cuda_emulation) behind
amp/kernels/float8.py's CuPy path, bit for bit against the torch operations (_torch_float8.py,
torchao's numerics): every layout, scale and inverse, for bf16, fp16 and fp32 matrices of shapes
that are not multiples of 16 or of a tile, empty ones, inf, NaN and all-zero rows, and the rowwise
recipe's output scaling.
"""

import pytest
import torch

from amp.kernels import _torch_float8, float8
from helpers import fake_cupy
from helpers.cuda_emulation import build

pytestmark = pytest.mark.skipif(build.compiler() is None, reason="needs g++ for the emulated grid")

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
FORMATS = [torch.float8_e4m3fn, torch.float8_e5m2]
# (row-major, transposed, scales rounded to powers of 2): the recipes' and each layout alone.
SCALINGS = [
    (float8.TENSOR, float8.TENSOR, False),
    (float8.ROW, float8.COLUMN, True),
    (float8.ROW, None, False),
    (None, float8.COLUMN, False),
    (None, float8.TENSOR, True),
]
# Around the 128 x 128 tile, the 16-byte vectors (8 and 4 elements) and the 16-row stores.
SHAPES = [(1, 1), (3, 37), (16, 8), (40, 136), (129, 24), (130, 4), (17, 260)]
ORDERS = [("forward", 0), ("reversed", 0), ("shuffled", 3)]


def _name(value):
    return value if isinstance(value, str) else str(value).removeprefix("torch.")


@pytest.fixture(params=ORDERS, ids=[order for order, _ in ORDERS])
def kernel(request, monkeypatch):
    """float8.py's CuPy path on the compiled kernels, threads run in one order; .launched()."""
    module, launches = fake_cupy.install_float8(monkeypatch, *request.param)
    module.launched = lambda: [name for name, _, _ in launches.calls]
    return module


@pytest.fixture
def forward_kernel(monkeypatch):
    module, launches = fake_cupy.install_float8(monkeypatch)
    module.launched = lambda: [name for name, _, _ in launches.calls]
    return module


def sample(shape, dtype, seed, spread=True):
    """Values over a wide range (columns from 1e-3 to 1e3), with subnormals and signed zeros."""
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(shape, generator=generator)
    if spread:
        values *= torch.logspace(-3, 3, shape[1])
    flat = values.view(-1)
    tiny = torch.finfo(dtype).smallest_normal
    special = torch.tensor([tiny / 3, -tiny / 5, 0.0, -0.0])[: flat.numel()]
    flat[torch.randperm(flat.numel(), generator=generator)[: len(special)]] = special
    return values.to(dtype)


def assert_same(actual, expected, what):
    """Equal bits, NaNs aside (their payloads may differ); None where None."""
    if expected is None:
        assert actual is None, what
        return
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, what
    torch.testing.assert_close(
        actual.float(), expected.float(), rtol=0, atol=0, equal_nan=True, msg=what
    )
    numbers = ~torch.isnan(expected.float())
    wide = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[expected.element_size()]
    assert torch.equal(actual.view(wide)[numbers], expected.view(wide)[numbers]), what  # -0.0


def assert_casts(actual, expected):
    for name in ("data", "scale", "inverse", "data_t", "scale_t", "inverse_t"):
        assert_same(getattr(actual, name), getattr(expected, name), name)


def reference(matrices, float8_dtype, scaling):
    return [_torch_float8.cast(m, float8_dtype, *scaling) for m in matrices]


@pytest.mark.parametrize("scaling", SCALINGS, ids=lambda s: f"{_name(s[0])}-{_name(s[1])}")
@pytest.mark.parametrize("float8_dtype", FORMATS, ids=_name)
@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
def test_casts_match_the_torch_operations(forward_kernel, dtype, float8_dtype, scaling):
    matrices = [sample(shape, dtype, seed) for seed, shape in enumerate(SHAPES)]
    casts = float8.cast(matrices, float8_dtype, *scaling)
    assert len(forward_kernel.launched()) == 2  # every matrix in one amax and one cast launch
    for actual, expected in zip(casts, reference(matrices, float8_dtype, scaling)):
        assert_casts(actual, expected)


@pytest.mark.parametrize("scaling", SCALINGS[:2], ids=["tensorwise", "rowwise"])
def test_thread_order_changes_nothing(kernel, scaling):
    matrices = [sample((150, 140), torch.bfloat16, 5), sample((9, 300), torch.bfloat16, 6)]
    casts = float8.cast(matrices, torch.float8_e4m3fn, *scaling)
    for actual, expected in zip(casts, reference(matrices, torch.float8_e4m3fn, scaling)):
        assert_casts(actual, expected)


@pytest.mark.parametrize("scaling", SCALINGS[:2], ids=["tensorwise", "rowwise"])
@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
def test_inf_nan_and_all_zero_rows_and_columns(forward_kernel, dtype, scaling):
    """An inf makes its amax inf (scale 0: NaN where it was, zeros around it), a NaN makes it
    NaN; an all-zero row or column takes the scale of amax EPS."""
    matrix = sample((20, 33), dtype, 7)
    matrix[3, 4], matrix[11, 30], matrix[15, 0] = float("inf"), float("-inf"), float("nan")
    matrix[7, :] = 0.0
    matrix[:, 9] = 0.0
    clean = sample((24, 40), dtype, 8)
    clean[:, 5] = 0.0
    zeros = torch.zeros(16, 16, dtype=dtype)
    matrices = [matrix, clean, zeros]
    casts = float8.cast(matrices, torch.float8_e4m3fn, *scaling)
    for actual, expected in zip(casts, reference(matrices, torch.float8_e4m3fn, scaling)):
        assert_casts(actual, expected)
    assert casts[2].scale.float().eq(448.0 / 1e-12 if not scaling[2] else 2.0**48).all()


@pytest.mark.parametrize("float8_dtype", FORMATS, ids=_name)
def test_every_rounding_boundary(forward_kernel, float8_dtype):
    """An fp32 matrix whose amax is the format's largest value (scale exactly 1): each FP8 value,
    the midpoints between neighbours (ties to even) and their float32 neighbours, the format's
    subnormals and float32's."""
    largest = torch.finfo(float8_dtype).max
    codes = torch.arange(256, dtype=torch.uint8).view(float8_dtype).float()
    codes = codes[torch.isfinite(codes)].unique()
    midpoints = (codes[1:] + codes[:-1]) / 2
    steps = [midpoints, torch.nextafter(midpoints, torch.tensor(float("inf"))),
             torch.nextafter(midpoints, torch.tensor(float("-inf"))), codes]
    tiny = torch.tensor([1e-30, -1e-45, 1e-45, -0.0])
    values = torch.cat(steps + [tiny])
    values = torch.cat([values, torch.tensor([largest] * (-len(values) % 64))])
    matrix = values.view(-1, 64)
    (cast,) = float8.cast([matrix], float8_dtype, float8.TENSOR, float8.TENSOR, False)
    assert cast.scale.item() == 1.0
    assert_casts(cast, reference([matrix], float8_dtype, SCALINGS[0])[0])


def test_empty_matrices_take_no_tile_and_get_their_scales(forward_kernel):
    matrices = [torch.zeros(0, 5, dtype=torch.bfloat16), torch.zeros(6, 0, dtype=torch.bfloat16),
                sample((5, 6), torch.bfloat16, 9)]
    for scaling in SCALINGS[:2]:
        casts = float8.cast(matrices, torch.float8_e4m3fn, *scaling)
        for actual, expected in zip(casts, reference(matrices, torch.float8_e4m3fn, scaling)):
            assert_casts(actual, expected)
    assert len(forward_kernel.launched()) == 4  # only the non-empty matrix launches


def test_many_matrices_go_in_launches_of_24(forward_kernel):
    matrices = [sample((3 + i % 5, 16 + 7 * (i % 3)), torch.float16, i) for i in range(50)]
    casts = float8.cast(matrices, torch.float8_e5m2, *SCALINGS[1])
    assert forward_kernel.launched() == ["amp_f8_amax<__half>"] * 3 + ["amp_f8_cast<__half, 1>"] * 3
    for actual, expected in zip(casts, reference(matrices, torch.float8_e5m2, SCALINGS[1])):
        assert_casts(actual, expected)


def test_matrices_of_two_dtypes_and_unaligned_ones(forward_kernel):
    """One launch pair per input dtype; a matrix at an odd offset takes the element-wise path."""
    base = sample((1, 200 * 24 + 1), torch.bfloat16, 10, spread=False).view(-1)
    unaligned = base[1:].view(200, 24)
    matrices = [unaligned, sample((8, 48), torch.float32, 11), sample((64, 16), torch.bfloat16, 12)]
    casts = float8.cast(matrices, torch.float8_e4m3fn, *SCALINGS[0])
    assert sorted(forward_kernel.launched()) == sorted(
        ["amp_f8_amax<__nv_bfloat16>", "amp_f8_cast<__nv_bfloat16, 0>", "amp_f8_amax<float>",
         "amp_f8_cast<float, 0>"]
    )
    for actual, expected in zip(casts, reference(matrices, torch.float8_e4m3fn, SCALINGS[0])):
        assert_casts(actual, expected)


@pytest.mark.parametrize("shape", [(5, 3000), (37, 40), (3, 13)], ids=str)
def test_scale_outer_matches_the_torch_operations(forward_kernel, shape):
    rows, cols = shape
    out = sample(shape, torch.bfloat16, 13, spread=False) * 1e4
    out[0, 0], out[-1, -1] = float("inf"), float("nan")
    generator = torch.Generator().manual_seed(14)
    row_inverse = torch.rand(rows, 1, generator=generator) * 3
    col_inverse = torch.rand(1, cols, generator=generator) * 1e-3
    col_inverse[0, -1] = 0.0
    expected = out.clone()
    _torch_float8.scale_outer_(expected, row_inverse, col_inverse)
    float8.scale_outer_(out, row_inverse, col_inverse)
    assert forward_kernel.launched() == ["amp_f8_scale_outer"]
    assert_same(out, expected, "out")


@pytest.mark.cuda
@pytest.mark.parametrize("float8_dtype", FORMATS, ids=_name)
def test_on_a_gpu_float8_cu_matches_the_torch_operations(float8_dtype):
    """On the device: the hardware conversion (cvt.satfinite), NVRTC's log2f and exp2f, and the
    tiled stores at real alignments, against torch's CUDA operations."""
    from amp import kernels

    if kernels.cuda_backend().name != "cupy":
        pytest.skip(f"CuPy is not used: {kernels.cuda_backend().reason}")
    matrices = [sample(shape, torch.bfloat16, seed).cuda() for seed, shape in enumerate(SHAPES)]
    matrices += [sample((2048, 4096), dtype, 20).cuda() for dtype in DTYPES]
    matrices[-1][5, 7], matrices[-1][9, 0] = float("inf"), float("nan")
    for scaling in SCALINGS:
        casts = float8.cast(matrices, float8_dtype, *scaling)
        for actual, matrix in zip(casts, matrices):
            assert_casts(actual, _torch_float8.cast(matrix, float8_dtype, *scaling))
    out = sample((4096, 1000), torch.bfloat16, 21).cuda()
    rows, cols = torch.rand(4096, 1, device="cuda"), torch.rand(1, 1000, device="cuda")
    expected = out.clone()
    _torch_float8.scale_outer_(expected, rows, cols)
    float8.scale_outer_(out, rows, cols)
    assert_same(out, expected, "scale_outer_")

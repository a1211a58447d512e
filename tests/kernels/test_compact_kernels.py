"""The compact steps' kernels (multi_tensor.cu's amp_compact_adam / amp_compact_sgd, compiled for
the CPU: tests/helpers/cuda_emulation) behind the CuPy backend's host code, bit for bit against
the torch backend (amp/kernels/_torch_compact.py), the oracle.

torch's fused CPU ops round the elements of their scalar loop (past the last whole vector of a
thread's range) differently from their vector body, which the kernels follow: the oracle runs on
one thread with every row padded with zeros to whole vectors, as the fused steps' tests hold it
(tests/kernels/test_fused_step.py). Zeros stepped stay zeros, so the padding changes no value,
code or scale of the rows' own elements.
"""

import sys

import pytest
import torch

from amp import kernels
from amp.kernels import _codecs, _sources, _torch_backend
from helpers import ROOT, fake_cupy
from helpers.cuda_emulation import build
from helpers.floats import bits

pytestmark = [
    pytest.mark.skipif(build.compiler() is None, reason="needs g++ for the emulated grid"),
    # torch on one thread: the oracle needs it, and two threads take ten times as long here
    pytest.mark.usefixtures("one_thread"),
]

SIZES = [0, 1, 31, 32, 33, 4096 + 3, 65536 + 5]  # around a block (32) and the chunk (65536)
ORDERS = [("forward", 0), ("reversed", 0), ("shuffled", 1)]
GRADS = [torch.bfloat16, torch.float16, torch.float32]
MOMENTS = ["fp32", "bf16", "int8"]
MASTERS = ["compact", "remainder", "exact"]
INV = 2.0**-10
ADAM = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.05)
SGD = [
    dict(lr=0.1, momentum=0.9, dampening=0.0, weight_decay=0.01, nesterov=False),
    dict(lr=0.1, momentum=0.9, dampening=0.0, weight_decay=0.0, nesterov=True),
    dict(lr=0.3, momentum=0.8, dampening=0.25, weight_decay=0.1, nesterov=False),
    dict(lr=0.1, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False),
]
SGD_IDS = ["momentum", "nesterov", "dampening", "plain"]
VECTOR = 64  # elements: a whole number of torch's CPU vectors (16 floats with AVX-512)
ENCODINGS = {"compact": kernels.compact_encode, "remainder": kernels.remainder_encode}


@pytest.fixture(params=ORDERS, ids=[order for order, _ in ORDERS])
def kernel(request, monkeypatch):
    """The CuPy backend on compiled kernels, threads run in one order; .launched() names them."""
    order, seed = request.param
    module, launches = fake_cupy.install(monkeypatch, kernels="compiled", order=order, seed=seed)
    module.launched = lambda: [name for name, _, _ in launches.calls]
    return module


@pytest.fixture
def forward_kernel(monkeypatch):
    module, launches = fake_cupy.install(monkeypatch, kernels="compiled")
    module.launched = lambda: [name for name, _, _ in launches.calls]
    return module


# -- state ----------------------------------------------------------------------------------------


def _low_types(grad_dtype, count):
    """The low-precision copies of exact masters: the gradient's type, or for FP32 gradients
    each kind the kernels take; row 2 has none (a plain FP32 parameter among masters)."""
    kinds = [grad_dtype] if grad_dtype is not torch.float32 else [torch.float16, torch.bfloat16]
    return [None if i == 2 else kinds[i % len(kinds)] for i in range(count)]


def make_state(sizes, master, moments, grad_dtype, *, sgd=False, seed=0):
    """Parallel lists of a compact step's state: grads, lows, masters (FP32 ones; or the int8
    corrections or int16 remainders of the bf16 lows), m and v (SGD: m the buffers, no v) with
    their scales (None for FP32 and bf16 moments), steps."""
    generator = torch.Generator().manual_seed(seed)

    def randn(n, scale):
        return torch.randn(n, generator=generator) * scale

    fp32 = [randn(n, 0.1) for n in sizes]
    grads = [randn(n, 1000.0) for n in sizes]
    m = [randn(n, 0.01) for n in sizes]
    v = [torch.rand(n, generator=generator) * 1e-4 for n in sizes]
    for i, n in enumerate(sizes):
        fp32[i][3::11] = 0.0
        # Tiny second moments where the gradient is 0: a positive value never takes code 0.
        grads[i][5::7] = 0.0
        v[i][5::7] = 1e-15
        if n > 200:  # a block of zeros: its scale is 0, its divisor 1
            for values in (grads[i], m[i], v[i]):
                values[64:96] = 0.0
            # A block of subnormal first moments: its scale is subnormal, not 0 (nothing flushed).
            grads[i][128:160] = 0.0
            m[i][128:160] = torch.randn(32, generator=generator) * 1e-39
            v[i][128:160] = 1e-40
    state = dict(grads=[g.to(grad_dtype) for g in grads])
    if master in ENCODINGS:
        state["lows"], state["masters"] = map(list, zip(*map(ENCODINGS[master], fp32)))
    else:
        state["masters"] = fp32
        state["lows"] = [
            None if dtype is None else t.to(dtype)
            for t, dtype in zip(fp32, _low_types(grad_dtype, len(sizes)))
        ]
    moment_lists = [(m, True)] if sgd else [(m, True), (v, False)]
    held, scales = [], []
    for values, signed in moment_lists:
        if moments == "int8":
            codes, block_scales = map(
                list, zip(*[kernels.moment_encode(t, signed) for t in values])
            )
            held.append(codes)
            scales.append(block_scales)
        else:
            held.append(
                [t.to(torch.float32 if moments == "fp32" else torch.bfloat16) for t in values]
            )
            scales.append(None)
    state["m"], state["m_scales"] = held[0], scales[0]
    if not sgd:
        state["v"], state["v_scales"] = held[1], scales[1]
        state["steps"] = [torch.tensor(float(3 + i)) for i in range(len(sizes))]
    return state


def copied(state):
    def copy(value):
        if isinstance(value, torch.Tensor):
            return value.clone()
        if isinstance(value, list):
            return [copy(item) for item in value]
        return value

    return {key: copy(value) for key, value in state.items()}


def _scalar(value, state):
    return None if value is None else torch.tensor(value, device=state["grads"][0].device)


def run_adam(module, state, *, found=0.0, inv=INV, decoupled=True, starts=None):
    state = copied(state)
    scales = None if state["m_scales"] is None else (state["m_scales"], state["v_scales"])
    module.adam_step_(
        state["grads"],
        state["lows"],
        state["masters"],
        state["m"],
        state["v"],
        state["steps"],
        scales,
        _scalar(inv, state),
        _scalar(found, state),
        kernels.AdamOptions(**ADAM, decoupled=decoupled),
        starts,
    )
    return state


def run_sgd(module, state, options, *, first_step=False, found=0.0, inv=INV):
    state = copied(state)
    module.sgd_step_(
        state["grads"],
        state["lows"],
        state["masters"],
        state["m"],
        state["m_scales"],
        _scalar(inv, state),
        _scalar(found, state),
        kernels.SGDOptions(**options),
        first_step,
    )
    return state


# -- the oracle -----------------------------------------------------------------------------------

_ELEMENTWISE = ("grads", "masters", "lows", "m", "v")
_BLOCKWISE = ("m_scales", "v_scales")


def _padded(tensor, numel):
    flat = tensor.reshape(-1)
    return torch.cat([flat, flat.new_zeros(numel - flat.numel())])


def oracle(run, state, *args, **kwargs):
    """run(_torch_backend, state, ...) with its torch ops' vector body everywhere (see the module
    doc), on one thread (as every test here runs)."""
    sizes = [g.numel() for g in state["grads"]]
    whole = [-(-n // VECTOR) * VECTOR for n in sizes]
    padded = dict(state)
    for key in _ELEMENTWISE:
        if state.get(key) is not None:
            padded[key] = [None if t is None else _padded(t, n) for t, n in zip(state[key], whole)]
    for key in _BLOCKWISE:
        if state.get(key) is not None:
            padded[key] = [
                None if t is None else _padded(t, n // _codecs.BLOCK)
                for t, n in zip(state[key], whole)
            ]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        stepped = run(_torch_backend, padded, *args, **kwargs)
    finally:
        torch.set_num_threads(threads)
    out = dict(stepped)
    for key in _ELEMENTWISE:
        if state.get(key) is not None:
            out[key] = [
                None if t is None else p[: t.numel()].view(t.shape)
                for t, p in zip(state[key], stepped[key])
            ]
    for key in _BLOCKWISE:
        if state.get(key) is not None:
            out[key] = [
                None if t is None else p[: t.numel()] for t, p in zip(state[key], stepped[key])
            ]
    return out


def assert_same_bits(actual, expected):
    assert actual.keys() == expected.keys()
    for key in actual:
        if actual[key] is None:
            assert expected[key] is None, key
            continue
        for i, (x, y) in enumerate(zip(actual[key], expected[key], strict=True)):
            if x is None or y is None:
                assert x is None and y is None, (key, i)
                continue
            assert x.dtype == y.dtype and x.shape == y.shape, (key, i)
            x, y = (bits(t) if t.is_floating_point() else t for t in (x, y))
            assert torch.equal(x, y), (key, i, (x != y).nonzero()[:5].flatten().tolist())


def expected_kernels(kernel_name, state, grad_dtype, moments, first_step=False):
    """The kernels a step launches: one per (gradient, master) kind of its rows (an exact master
    without a copy takes the kernel of its gradient's type: its pointer is null); FP32 masters
    with FP32 moments and a copy of the gradient's type take amp_adam / amp_sgd (but for SGD's
    first step, which they do not make)."""
    moment = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.int8}[moments]
    rest = state["masters"][0].dtype
    if rest in (torch.int8, torch.int16):
        return {_sources.compact_kernel(kernel_name, grad_dtype, _KIND[rest], moment)}
    names = set()
    for low in state["lows"]:
        copy = torch.float32 if low is None else low.dtype  # float32: none
        if moment is torch.float32 and (grad_dtype, copy) in _sources.STEP_TYPES and not first_step:
            plain = kernel_name.replace("compact_", "")
            names.add(f"{plain}<{_sources.TYPE_NAMES[grad_dtype]}, {_sources.TYPE_NAMES[copy]}>")
        else:  # without a copy: the gradient's type (the copy's pointer is null)
            kind = grad_dtype if low is None else copy
            names.add(_sources.compact_kernel(kernel_name, grad_dtype, kind, moment))
    return names


_KIND = {torch.int8: _sources.COMPACT, torch.int16: _sources.REMAINDER}
_COUNTS = {"amp_compact_adam": "amp_compact_count_steps", "amp_adam": "amp_count_steps"}


# -- AdamW / Adam ----------------------------------------------------------------------------------


@pytest.mark.parametrize("grad_dtype", GRADS, ids=str)
@pytest.mark.parametrize("master", MASTERS)
@pytest.mark.parametrize("moments", MOMENTS)
def test_the_compact_adam_kernel_is_the_torch_backend_bit_for_bit(
    kernel, moments, master, grad_dtype
):
    """AdamW with bf16 and FP32 gradients (FP32 ones without a scale or a flag: a plain
    parameter's), Adam with fp16 ones; empty rows go to the torch backend, which counts their
    steps."""
    state = make_state(SIZES, master, moments, grad_dtype)
    decoupled = grad_dtype is not torch.float16
    plain = grad_dtype is torch.float32  # no scaler: neither a scale nor a flag
    options = dict(inv=None if plain else INV, found=None if plain else 0.0, decoupled=decoupled)
    stepped = run_adam(kernel, state, **options)
    assert_same_bits(stepped, oracle(run_adam, state, **options))
    assert [s.item() for s in stepped["steps"]] == [4.0 + i for i in range(len(SIZES))]
    launched = kernel.launched()
    assert set(launched[::2]) == expected_kernels("amp_compact_adam", state, grad_dtype, moments)
    assert launched[1::2] == [_COUNTS[name.split("<")[0]] for name in launched[::2]]


@pytest.mark.parametrize("moments", ["bf16", "int8"])
def test_the_compact_adam_kernel_dithers_a_shard_from_its_start(
    forward_kernel, monkeypatch, moments
):
    """Rows that are shards (FSDP2's) dither their second moments by the element's index in the
    whole tensor: the kernel takes each row's start, as the torch backend does, over two launches
    (a 4 KB parameter budget holds 52 rows) and at starts past 2**16 (the dither's period)."""
    monkeypatch.setenv("AMP_KERNEL_PARAM_BYTES", "4096")
    sizes = [300 + 3, 64] * 30
    starts = [(i * 7 + 3) * _codecs.BLOCK * (1 if i % 3 else 3000) for i in range(len(sizes))]
    state = make_state(sizes, "compact", moments, torch.bfloat16)
    stepped = run_adam(forward_kernel, state, starts=starts)
    assert_same_bits(stepped, oracle(run_adam, state, starts=starts))
    assert not torch.equal(stepped["v"][1], run_adam(_torch_backend, state)["v"][1])
    assert forward_kernel.launched().count(forward_kernel.launched()[0]) == 2


@pytest.mark.parametrize("master", MASTERS)
@pytest.mark.parametrize("moments", MOMENTS)
def test_a_skipped_compact_adam_step_changes_no_bit(forward_kernel, moments, master):
    state = make_state(SIZES, master, moments, torch.bfloat16)
    for module in (forward_kernel, _torch_backend):
        assert_same_bits(run_adam(module, state, found=1.0), state)
    assert forward_kernel.launched()  # launched: the device decides, not the host


# -- SGD ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("master", MASTERS)
@pytest.mark.parametrize("moments", MOMENTS)
def test_the_compact_sgd_kernel_is_the_torch_backend_bit_for_bit(kernel, moments, master):
    """Each of SGD's forms (gradients of a type each), the momentum's first step too: the
    buffers start as the gradients (the held ones are not read)."""
    expected_names = set()
    for options, grad_dtype in zip(SGD, GRADS + [torch.bfloat16]):
        state = make_state(SIZES, master, moments, grad_dtype, sgd=True)
        for first_step in [False, True] if options["momentum"] else [False]:
            stepped = run_sgd(kernel, state, options, first_step=first_step)
            expected = oracle(run_sgd, state, options, first_step=first_step)
            assert_same_bits(stepped, expected)
            held = moments if options["momentum"] else "fp32"  # no buffers: the FP32 kernels
            expected_names |= expected_kernels(
                "amp_compact_sgd", state, grad_dtype, held, first_step
            )
    assert set(kernel.launched()) == expected_names


@pytest.mark.parametrize("master", MASTERS)
@pytest.mark.parametrize("moments", MOMENTS)
def test_a_skipped_compact_sgd_step_changes_no_bit(forward_kernel, moments, master):
    state = make_state(SIZES, master, moments, torch.float16, sgd=True)
    for module in (forward_kernel, _torch_backend):
        for first_step in (False, True):
            assert_same_bits(
                run_sgd(module, state, SGD[0], found=1.0, first_step=first_step), state
            )


# -- the host side -------------------------------------------------------------------------------------


def test_rows_no_compact_kernel_takes_go_to_the_torch_backend(forward_kernel):
    """A weight not contiguous, fp16 moments, moments of two kinds in a row: the torch backend
    steps those rows, the kernels the others, in one call (sizes of whole vectors, for the rows
    the torch backend steps)."""
    state = make_state([64, 96, 32, 48, 96], "compact", "int8", torch.bfloat16)
    state["lows"][1] = state["lows"][1].view(8, 12).t().contiguous().t()  # the same values
    state["v"][2] = kernels.moment_decode(state["v"][2], state["v_scales"][2])  # FP32 and codes
    state["v_scales"][2] = None
    for key in ("m", "v"):
        state[key][3] = kernels.moment_decode(state[key][3], state[f"{key}_scales"][3]).half()
        state[f"{key}_scales"][3] = None
    stepped = run_adam(forward_kernel, state)
    assert forward_kernel.launched() == [
        "amp_compact_adam<__nv_bfloat16, amp::Compact, amp::Codes8>",
        "amp_compact_count_steps",
    ]
    assert_same_bits(stepped, oracle(run_adam, state))
    assert not stepped["lows"][1].is_contiguous()


def test_more_tensors_than_one_launch_holds_are_stepped_and_counted_once(
    forward_kernel, monkeypatch
):
    monkeypatch.setenv("AMP_KERNEL_PARAM_BYTES", "4096")
    capacity = 52  # a Meta<8> in 4 KB
    state = make_state([33] * (capacity + 3), "compact", "int8", torch.bfloat16)
    stepped = run_adam(forward_kernel, state)
    name = "amp_compact_adam<__nv_bfloat16, amp::Compact, amp::Codes8>"
    assert forward_kernel.launched() == [name] * 2 + ["amp_compact_count_steps"] * 2
    assert_same_bits(stepped, oracle(run_adam, state))


def test_the_packed_launches_are_kept_and_follow_new_gradients_and_moved_data(forward_kernel):
    """The launches are planned once for the same lists and rewritten where pointers change:
    new gradients at every step, a weight given new data."""
    state = make_state([64, 4096 + 3, 100], "compact", "int8", torch.bfloat16)
    ours, reference = copied(state), copied(state)
    for step in range(3):
        grads = [(torch.randn(g.shape) * 100).to(torch.bfloat16) for g in state["grads"]]
        if step == 2:
            for key in ("lows", "m"):
                ours[key][0].data = ours[key][0].clone()
        for target, module in ((ours, forward_kernel), (reference, None)):
            target["grads"] = grads
            if module is None:
                stepped = oracle(run_adam, target)
            else:
                stepped = run_adam(module, target)
            for key in ("lows", "masters", "m", "v", "m_scales", "v_scales", "steps"):
                for held, new in zip(target[key], stepped[key]):
                    held.copy_(new)
        assert_same_bits(ours, reference)


@pytest.mark.cuda
@pytest.mark.parametrize("master", MASTERS)
@pytest.mark.parametrize("moments", MOMENTS)
def test_on_a_gpu_the_compact_kernels_are_the_torch_backend_bit_for_bit(moments, master):
    """The CuPy backend on CUDA tensors against the torch backend on CUDA tensors: torch's CUDA
    fused ops, whose AdamW formula the CuPy build follows (step_math.cu); SGD against the CPU
    oracle too, the two devices' SGD rounding alike."""
    choice = kernels.cuda_backend()
    assert choice.name == "cupy", f"the CuPy backend is not in use: {choice.reason}"

    def to(state, device):
        return {
            key: None if value is None else [None if t is None else t.to(device) for t in value]
            for key, value in state.items()
        }

    adam = make_state(SIZES, master, moments, torch.bfloat16)
    stepped = to(run_adam(choice.module, to(adam, "cuda")), "cpu")
    assert_same_bits(stepped, to(run_adam(_torch_backend, to(adam, "cuda")), "cpu"))
    sgd = make_state(SIZES, master, moments, torch.bfloat16, sgd=True)
    for first_step in (False, True):
        stepped = to(run_sgd(choice.module, to(sgd, "cuda"), SGD[0], first_step=first_step), "cpu")
        assert_same_bits(stepped, oracle(run_sgd, sgd, SGD[0], first_step=first_step))


# -- the bytes they move ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "master, moments, grad_dtype, expected",
    [
        ("compact", "int8", torch.bfloat16, 12.5),  # 2 + (2 + 2) + (1 + 1) + 2 * (1 + 1) + 16 / 32
        ("compact", "bf16", torch.bfloat16, 16.0),
        ("remainder", "fp32", torch.bfloat16, 26.0),  # 2 + (2 + 2) * 2 + (4 + 4) * 2
        ("exact", "fp32", torch.bfloat16, 28.0),  # amp_adam's
        ("exact", "int8", torch.float32, 18.5),  # 4 + (4 + 4) + (0 + 2) + 4 + 16 / 32
    ],
)
def test_the_bytes_a_compact_adam_step_moves_per_parameter(
    forward_kernel, master, moments, grad_dtype, expected
):
    """benchmarks/kernel_work.py's count of the launches a step makes, over its parameters (the
    step counts' 12 bytes a tensor aside): a compact master with 8-bit moments moves 12.5 bytes a
    parameter, where an FP32 master with FP32 moments moves 28."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import kernel_work

    sizes = [65536 + 5, 4096 + 3, 32 * 40]
    state = make_state(sizes, master, moments, grad_dtype)
    if master == "exact":  # each with a bf16 copy
        state["lows"] = [m.to(torch.bfloat16) for m in state["masters"]]
    with kernel_work.kernel_traffic() as work:
        run_adam(forward_kernel, state)
    assert work.launches == 2
    blocks = sum(-(-n // 32) for n in sizes)
    scales = 4 * 2 * 2 * blocks if moments == "int8" else 0
    steps = 12 * len(sizes)  # read by the step, read and written by the count
    per_element = expected - (0.5 if moments == "int8" else 0)  # the scales: 16 bytes a block
    assert work.bytes == per_element * sum(sizes) + scales + steps
    assert expected <= (work.bytes - steps) / sum(sizes) < expected + 0.01

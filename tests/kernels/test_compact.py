"""Compact state (amp/kernels/_codecs.py, _torch_compact.py): a master as its bf16 weight and an
int16 remainder (exact) or an int8 correction, moments in 8 bits or bf16, and the fused steps over
them: the FP32 update of the decoded values (torch's fused step's bits for exact masters), in
pieces that change nothing, a skipped step that changes no bit."""

import pytest
import torch

from amp import kernels
from amp.kernels import _codecs, _torch_compact
from helpers.floats import bits

ADAM = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.05, decoupled=True)
SGD = dict(lr=0.1, momentum=0.9, dampening=0.25, weight_decay=0.01, nesterov=False)


def special_values():
    values = [0.0, -0.0, float("inf"), -float("inf"), 3.4e38, -3.3895e38, 1e-40, -1e-45, 2**-133]
    values += [1.0, 1.0 - 2**-24, -1.0 + 2**-24, 2.0 - 2**-10, 1.0 + 2**-8 + 2**-16, 65504.0]
    values += [torch.finfo(torch.float32).max, 2**-126, -(2**-126) * 1.5]
    return torch.tensor(values)


def test_a_compact_master_is_torchs_bf16_cast_and_a_correction_within_a_256th_of_its_ulp():
    generator = torch.Generator().manual_seed(0)
    scale = torch.exp(4 * torch.randn(200_000, generator=generator))
    x = torch.cat([torch.randn(200_000, generator=generator) * scale, special_values()])
    # every 128th bit pattern of a few binades (bf16's midpoints and the ties among them)
    mantissas = torch.arange(0, 1 << 16, dtype=torch.int32) * 128
    for exponent in (0, 1, 126, 127, 253):
        for sign in (0, -(2**31)):
            patterns = (exponent << 23) | mantissas | sign
            x = torch.cat([x, patterns.view(torch.float32), (patterns | 127).view(torch.float32)])
    low, correction = kernels.compact_encode(x)
    assert torch.equal(bits(low), bits(x.to(torch.bfloat16)))  # what every writer of it writes
    y = kernels.compact_decode(low, correction)
    xb, yb = bits(x), bits(y)
    finite = torch.isfinite(x) & torch.isfinite(low)
    assert ((xb[finite] < 0) == (yb[finite] < 0)).all()
    distance = ((xb & 0x7FFFFFFF) - (yb & 0x7FFFFFFF))[finite].abs()  # in fp32 bit units
    assert distance.max() <= 256  # 1/256 of a bf16 ulp, near a tie with the midpoint
    assert (distance > 128).float().mean() < 0.01  # elsewhere 1/512
    again = kernels.compact_encode(y)  # decoding and encoding again gives the same two
    assert torch.equal(bits(again[0]), bits(low)) and torch.equal(again[1], correction)
    assert correction.abs().max() <= 127


def _patterns():
    """Random FP32 values of every magnitude, the special ones, and every 128th bit pattern of a
    few binades with both signs (bf16's ties among them), NaNs with payloads."""
    generator = torch.Generator().manual_seed(0)
    scale = torch.exp(4 * torch.randn(200_000, generator=generator))
    x = [torch.randn(200_000, generator=generator) * scale, special_values()]
    mantissas = torch.arange(0, 1 << 16, dtype=torch.int32) * 128
    for exponent in (0, 1, 126, 254, 255):
        for sign in (0, -(2**31)):
            patterns = (exponent << 23) | mantissas | sign
            x += [patterns.view(torch.float32), (patterns | 127).view(torch.float32)]
    return torch.cat(x)


def test_an_exact_master_holds_every_fp32_value_in_its_weight_and_remainder():
    x = _patterns()
    low, remainder = kernels.remainder_encode(x)
    assert low.dtype is torch.bfloat16 and remainder.dtype is torch.int16
    y = kernels.remainder_decode(low, remainder)
    nan = torch.isnan(x)
    assert torch.equal(bits(y[~nan]), bits(x[~nan]))
    assert torch.isnan(y[nan]).all() and torch.isnan(low[nan]).all()  # a NaN stays a NaN
    again = kernels.remainder_encode(y)  # decoding and encoding again gives the same two
    assert torch.equal(bits(again[0]), bits(low)) and torch.equal(again[1], remainder)


def test_an_exact_masters_nan_is_a_quiet_nan_of_its_sign_on_either_path():
    """Every high half against low halves around the carry: a NaN's weight is its high half with
    the quiet bit set and its remainder 0 (the CUDA kernel's rule), whether the CPU's check for a
    NaN ran first (a plain tensor) or the fix-up ran unasked (any other: FakeTensors, devices, a
    trace of torch.compile)."""
    highs = torch.arange(-(2**15), 2**15, dtype=torch.int32)
    lows = torch.tensor([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF], dtype=torch.int32)
    x = ((highs[:, None] << 16) | lows).view(-1).view(torch.float32)
    low, remainder = kernels.remainder_encode(x)
    nan = torch.isnan(x)
    assert torch.equal(bits(low)[nan], ((bits(x)[nan] >> 16) | 0x40).to(torch.int16))
    assert not remainder[nan].any()
    unasked = kernels.remainder_encode(torch.nn.Parameter(x, requires_grad=False))
    assert torch.equal(bits(unasked[0]), bits(low)) and torch.equal(unasked[1], remainder)
    traced = torch.compile(kernels.remainder_encode, fullgraph=True, backend="eager")(x)
    assert torch.equal(bits(traced[0]), bits(low)) and torch.equal(traced[1], remainder)
    # Where a plain CPU tensor has no values to give (vmap, FakeTensorMode, make_fx), unasked
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    mapped = torch.vmap(kernels.remainder_encode)(x.view(-1, 64))
    assert torch.equal(bits(mapped[0]).view(-1), bits(low))
    assert torch.equal(mapped[1].view(-1), remainder)
    with FakeTensorMode(allow_non_fake_inputs=True):
        assert kernels.remainder_encode(x)[1].shape == x.shape
    make_fx(kernels.remainder_encode)(x[:64])
    finite = x[torch.isfinite(x)][:1000]  # no NaN: the CPU skips the fix-up, the rest runs it
    asked, unasked = (kernels.remainder_encode(v) for v in (finite, torch.nn.Parameter(finite)))
    assert torch.equal(bits(asked[0]), bits(unasked[0])) and torch.equal(asked[1], unasked[1])


ONE_ELEMENT_STRIDES = [
    torch.randn(1, 4)[:, 1],  # stride 4
    torch.tensor(0.5).expand(1),  # stride 0
    torch.empty_strided((1, 1), (7, 3)).fill_(2.0),
]


@pytest.mark.parametrize(
    "value", [torch.randn(s) for s in [(), (1,), (1, 1), (3,), (2, 5)]] + ONE_ELEMENT_STRIDES,
    ids=lambda v: f"{tuple(v.shape)}-{v.stride()}",
)
def test_an_exact_masters_weight_and_remainder_are_dense_at_every_size(value):
    """Read off the FP32 bits' halves (strided views), both come out with unit strides: DDP's
    buckets and checkpoints view them as bytes, which a stride of 2 on one element refuses; and
    one element of any stride (contiguous to torch) encodes as its value does."""
    shape = value.shape
    low, remainder = kernels.remainder_encode(value)
    assert torch.equal(kernels.remainder_decode(low, remainder), value)
    for part in (low, remainder):
        assert part.shape == shape and part.is_contiguous()
        flat = part if part.dim() else part.view(1)  # torch views no 0-dim tensor as bytes
        assert flat.view(torch.int8).numel() == 2 * part.numel()


def test_an_exact_masters_weight_is_torchs_cast_but_at_ties_rounded_down_to_even():
    """The weight is the nearest bf16; an exact tie goes away from zero (a remainder of +0x8000
    would not fit), where torch's cast rounds to even: only the ties below an even weight
    differ, by one ulp."""
    x = _patterns()
    low = kernels.remainder_encode(x)[0]
    nan = torch.isnan(x)
    theirs = bits(x.to(torch.bfloat16)).view(torch.int16)
    ours = bits(low).view(torch.int16)
    differ = (ours != theirs) & ~nan
    tie = (bits(x) & 0xFFFF) == 0x8000
    even_below = ((bits(x) >> 16) & 1) == 0  # the tie's lower neighbour
    assert torch.equal(differ, tie & even_below & ~nan)
    assert (ours[differ].int() - theirs[differ].int()).abs().max() == 1


def test_a_compact_master_is_the_same_whether_the_cpu_asked_about_its_rare_values_or_not():
    """On a plain CPU tensor the encoding asks first whether any value is NaN or rounds up to
    inf, and the decoding whether any weight is inf or NaN, and skip their fix-ups where none
    is; any other tensor (a Parameter here, as FakeTensors, devices and traces) runs them
    unasked. Both give the same bits, with such values and without."""
    x = _patterns()  # NaNs, infs and values rounding up to inf among them
    ordinary = x[torch.isfinite(x) & (x.abs() < 3e38)]
    for values in (x, ordinary):
        low, correction = kernels.compact_encode(values)
        unasked = kernels.compact_encode(torch.nn.Parameter(values, requires_grad=False))
        assert torch.equal(bits(unasked[0]), bits(low)) and torch.equal(unasked[1], correction)
        back = kernels.compact_decode(low, correction)
        plain = torch.nn.Parameter(low, requires_grad=False)
        assert torch.equal(bits(kernels.compact_decode(plain, correction)), bits(back))
    for value in ONE_ELEMENT_STRIDES:
        low, correction = kernels.compact_encode(value)
        dense = kernels.compact_encode(value.clone(memory_format=torch.contiguous_format))
        assert low.shape == correction.shape == value.shape
        assert torch.equal(bits(low), bits(dense[0])) and torch.equal(correction, dense[1])


def test_special_values_keep_their_meaning():
    low, correction = kernels.compact_encode(
        torch.tensor([-0.0, float("inf"), float("nan"), 3.4e38])
    )
    back = kernels.compact_decode(low, correction)
    assert str(back[0].item()) == "-0.0" and back[1].item() == float("inf")
    assert torch.isnan(back[2]) and correction[2].item() == 0 and torch.isinf(back[3])


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_an_8_bit_moment_is_block_scaled(signed):
    generator = torch.Generator().manual_seed(1)
    values = torch.randn(1000, generator=generator) * torch.exp(
        2 * torch.randn(1000, generator=generator)
    )
    values = values if signed else values.square()
    values[100:132] = 0.0  # an all-zero block
    codes, scales = kernels.moment_encode(values.view(10, 100), signed)
    assert codes.shape == (10, 100) and codes.dtype is (torch.int8 if signed else torch.uint8)
    assert scales.shape == (-(-1000 // _codecs.BLOCK),)
    back = kernels.moment_decode(codes, scales).view(-1)
    assert back.shape == values.shape and (back[100:132] == 0).all()
    blocks = _codecs.blocks(values).abs().amax(1)
    error = (back - values).abs() / blocks.repeat_interleave(_codecs.BLOCK)[
        : values.numel()
    ].clamp_min(1e-30)
    assert error.max() < (2 / 127 if signed else 2 / 255)
    if not signed:  # a positive value never decodes to 0 (its denominator would be eps alone)
        assert (back[values > 0] > 0).all()


def compact_state(sizes, moments, seed=0):
    generator = torch.Generator().manual_seed(seed)
    fp32 = [torch.randn(n, generator=generator) * 0.1 for n in sizes]
    lows, corrections = map(list, zip(*map(kernels.compact_encode, fp32)))
    m = [torch.randn(n, generator=generator) * 0.01 for n in sizes]
    v = [torch.rand(n, generator=generator) * 1e-4 for n in sizes]
    state = dict(
        grads=[(torch.randn(n, generator=generator) * 1000).to(torch.bfloat16) for n in sizes],
        lows=lows,
        corrections=corrections,
        steps=[torch.tensor(3.0) for _ in sizes],
    )
    if moments == "int8":
        (state["m"], m_scales), (state["v"], v_scales) = (
            zip(*[kernels.moment_encode(t, signed) for t in moment])
            for moment, signed in ((m, True), (v, False))
        )
        state["m"], state["v"] = list(state["m"]), list(state["v"])
        state["scales"] = (list(m_scales), list(v_scales))
    else:
        dtype = torch.float32 if moments == "fp32" else torch.bfloat16
        state["m"], state["v"], state["scales"] = (
            [t.to(dtype) for t in m],
            [t.to(dtype) for t in v],
            None,
        )
    return state


def copied(state):
    def copy(value):
        if isinstance(value, torch.Tensor):
            return value.clone()
        if isinstance(value, (list, tuple)):
            return type(value)(map(copy, value))
        return value

    return {key: copy(value) for key, value in state.items()}


def adam(state, found=0.0, inv=2.0**-10):
    state = copied(state)
    kernels.adam_step_(
        state["grads"],
        state["lows"],
        state["corrections"],
        state["m"],
        state["v"],
        state["steps"],
        kernels.AdamOptions(**ADAM),
        scales=state["scales"],
        inv_scale=torch.tensor(inv),
        found_inf=torch.tensor(found),
    )
    return state


def reference_adam(state, inv=2.0**-10):
    """What compact_adam_step_ computes, written plainly: decode, torch's fused op, encode."""
    out = copied(state)
    for i, grad in enumerate(state["grads"]):
        master = kernels.compact_decode(state["lows"][i], state["corrections"][i])
        if state["scales"] is None:
            m, v = state["m"][i].float(), state["v"][i].float()
        else:
            m = kernels.moment_decode(state["m"][i], state["scales"][0][i])
            v = kernels.moment_decode(state["v"][i], state["scales"][1][i])
        step = state["steps"][i] + 1
        torch._fused_adamw_(
            [master],
            [grad.float() * inv],
            [m],
            [v],
            [],
            [step],
            **{k: ADAM[k] for k in ("lr", "beta1", "beta2", "eps", "weight_decay")},
            amsgrad=False,
            maximize=False,
        )
        out["lows"][i], out["corrections"][i] = kernels.compact_encode(master)
        out["steps"][i] = step
        if state["scales"] is None:
            out["m"][i], out["v"][i] = m.to(state["m"][i].dtype), v.to(state["v"][i].dtype)
            if state["v"][i].dtype is torch.bfloat16:  # the second moment: stochastically
                out["v"][i] = _codecs.bf16_stochastic(v, step)
        else:
            (out["m"][i], out["scales"][0][i]) = kernels.moment_encode(m, True)
            # the second moment's codes rounded stochastically, by the step's dither
            (out["v"][i], out["scales"][1][i]) = _codecs.unsigned_encode(v, step)
    return out


def assert_same(a, b):
    for key in a:
        left, right = a[key], b[key]
        if key == "scales" and left is not None:
            left, right = left[0] + left[1], right[0] + right[1]
        for x, y in zip(left or (), right or (), strict=True):
            assert torch.equal(
                bits(x) if x.is_floating_point() else x, bits(y) if y.is_floating_point() else y
            ), key


def test_a_steps_second_moment_codes_round_stochastically_by_index_and_step():
    """Within a step, the unsigned codes are rounded stochastically: the same bits for the same
    (index, step), a piece from `start` as the slice of the whole, others at another step, and
    unbiased: over many steps a value between two codes averages to where it lies."""
    roots = torch.full((4096,), 0.3 / 255.0 + 20 / 255.0)  # 20.3 codes below the block maximum
    roots[::32] = 1.0  # each block's maximum, code 255
    values = roots.square()
    step = torch.tensor(7.0)
    codes, _ = _codecs.unsigned_encode(values, step)
    assert torch.equal(codes, _codecs.unsigned_encode(values, step)[0])
    assert torch.equal(codes[1024:], _codecs.unsigned_encode(values[1024:], step, 1024)[0])
    assert not torch.equal(codes, _codecs.unsigned_encode(values, torch.tensor(8.0))[0])
    held = roots != 1.0
    assert set(codes[held].unique().tolist()) == {20, 21}
    means = torch.stack(
        [_codecs.unsigned_encode(values, torch.tensor(float(s)))[0][held].float() for s in range(64)]
    ).mean(0)
    assert abs(means.mean().item() - 20.3) < 0.01  # unbiased over elements and steps
    assert abs(means[0].item() - 20.3) < 0.2  # and over the steps of one element
    nearest = _codecs.unsigned_encode(values)[0]
    assert set(nearest[held].unique().tolist()) == {20}  # without a step: to nearest


def test_an_8_bit_second_moment_follows_its_ema_where_rounding_to_nearest_sticks():
    """Adam's second moment, encoded every step, as the small gradients' squares fall 4x beside
    a steady large one (which sets their blocks' scale): stochastic rounding follows the exact
    EMA, rounding to nearest stays where it was (the reason for it)."""
    generator = torch.Generator().manual_seed(0)
    squares = torch.rand(32 * 64, generator=generator) * 1e-2
    squares[::32] = 1.0  # a large element in each block: the others are a few codes of it
    exact = squares.clone()
    held = {"nearest": kernels.moment_encode(squares, False), "stochastic": None}
    held["stochastic"] = held["nearest"]
    beta2 = 0.999
    for step in range(1, 1001):
        new = torch.where(squares < 1.0, squares / 4, squares)
        exact = exact * beta2 + new * (1 - beta2)
        for name, (codes, scales) in held.items():
            v = kernels.moment_decode(codes, scales) * beta2 + new * (1 - beta2)
            stepped = torch.tensor(float(step)) if name == "stochastic" else None
            held[name] = _codecs.unsigned_encode(v, stepped)
    small = squares < 1.0
    for name, expected in (("stochastic", (0.9, 1.1)), ("nearest", (1.3, float("inf")))):
        ratio = (kernels.moment_decode(*held[name])[small] / exact[small]).median().item()
        assert expected[0] < ratio < expected[1], (name, ratio)


def test_a_bf16_second_moment_follows_its_ema_where_rounding_to_nearest_sticks():
    """bf16's 8 bits hold a second moment as coarsely: decaying from 1 towards 0.25, rounded to
    nearest it never leaves 1 (0.1% a step is below half an ulp), stochastically it follows."""
    held = {"nearest": torch.ones(4096), "stochastic": torch.ones(4096)}
    exact = torch.ones(4096)
    for step in range(1, 1001):
        exact = exact * 0.999 + 0.25 * (1 - 0.999)
        for name, v in held.items():
            v = v.float() * 0.999 + 0.25 * (1 - 0.999)
            stochastic = name == "stochastic"
            held[name] = (
                _codecs.bf16_stochastic(v, torch.tensor(float(step))) if stochastic else v.bfloat16()
            )
    assert (held["nearest"] == 1).all()
    ratio = held["stochastic"].float().mean() / exact.mean()
    assert abs(ratio.item() - 1) < 0.01, ratio


@pytest.mark.parametrize("moments", ["fp32", "bf16", "int8"])
def test_the_compact_adam_step_is_the_fp32_update_of_the_decoded_state(moments, one_thread):
    state = compact_state([64, 4096, 100], moments)
    assert_same(adam(state), reference_adam(state))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kind", ["adamw", "adam", "sgd", "sgd first step"])
def test_an_exact_masters_step_is_torchs_fused_step_on_its_fp32_values(kind, threads):
    """bf16 weights and int16 remainders stepped with FP32 moments give, bit for bit, torch's
    fused op on FP32 tensors holding their values (whole tensors: pieces would move the CPU
    op's scalar tails), whatever the thread count; their weights that value's rounding."""
    generator = torch.Generator().manual_seed(3)
    sizes = [64, 5000, (1 << 20) + 3, 1]
    fp32 = [torch.randn(n, generator=generator) * 0.1 for n in sizes]
    lows, remainders = map(list, zip(*map(kernels.remainder_encode, fp32)))
    grads = [(torch.randn(n, generator=generator) * 1000).to(torch.bfloat16) for n in sizes]
    m = [torch.randn(n, generator=generator) * 0.01 for n in sizes]
    v = [torch.rand(n, generator=generator) * 1e-4 for n in sizes]
    inv, found = torch.tensor(2.0**-10), torch.tensor(0.0)
    theirs = [t.clone() for t in fp32]
    their_grads = [g.float() * inv for g in grads]
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        if kind.startswith("adam"):
            options = dict(ADAM, decoupled=kind == "adamw")
            steps, their_steps = ([torch.tensor(3.0) for _ in sizes] for _ in range(2))
            their_m, their_v = [t.clone() for t in m], [t.clone() for t in v]
            kernels.adam_step_(
                grads, lows, remainders, m, v, steps, kernels.AdamOptions(**options),
                inv_scale=inv, found_inf=found,
            )
            torch._foreach_add_(their_steps, 1)
            step = torch._fused_adamw_ if options.pop("decoupled") else torch._fused_adam_
            step(theirs, their_grads, their_m, their_v, [], their_steps, amsgrad=False,
                 maximize=False, **options)
            assert all(torch.equal(bits(a), bits(b)) for a, b in zip(m + v, their_m + their_v))
            assert [s.item() for s in steps] == [4.0] * len(sizes)
        else:
            first = kind == "sgd first step"
            buffers = [t.clone() for t in m]
            their_buffers = [t.clone() for t in m]
            kernels.sgd_step_(
                grads, lows, remainders, buffers, kernels.SGDOptions(**SGD), first_step=first,
                inv_scale=inv, found_inf=found,
            )
            torch._fused_sgd_(theirs, their_grads, their_buffers, maximize=False,
                              is_first_step=first, **SGD)
            assert all(torch.equal(bits(a), bits(b)) for a, b in zip(buffers, their_buffers))
    finally:
        torch.set_num_threads(saved)
    for low, remainder, expected in zip(lows, remainders, theirs):
        assert torch.equal(bits(kernels.remainder_decode(low, remainder)), bits(expected))
        assert torch.equal(bits(low), bits(kernels.remainder_encode(expected)[0]))


def test_an_exact_step_skipped_or_not_contiguous_changes_what_it_should():
    """A skipped step changes no bit; a transposed weight and remainder are stepped in place as
    a contiguous one."""
    generator = torch.Generator().manual_seed(4)
    fp32 = torch.randn(48, 40, generator=generator)
    low, remainder = kernels.remainder_encode(fp32)
    grad = torch.randn(48, 40, generator=generator).to(torch.bfloat16)
    options = kernels.AdamOptions(**ADAM)
    state = [torch.zeros(48, 40), torch.zeros(48, 40), torch.tensor(0.0)]
    before = [t.clone() for t in (low, remainder, *state)]
    kernels.adam_step_([grad], [low], [remainder], *([t] for t in state), options,
                       found_inf=torch.tensor(1.0))
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip((low, remainder, *state), before))
    transposed = [t.t().contiguous().t() for t in (low, remainder, grad)]
    t_state = [torch.zeros(40, 48).t(), torch.zeros(40, 48).t(), torch.tensor(0.0)]
    kernels.adam_step_([transposed[2]], [transposed[0]], [transposed[1]],
                       *([t] for t in t_state), options)
    kernels.adam_step_([grad], [low], [remainder], *([t] for t in state), options)
    assert not transposed[0].is_contiguous()
    assert torch.equal(bits(transposed[0]), bits(low))
    assert torch.equal(transposed[1], remainder)


@pytest.mark.parametrize("moments", ["fp32", "int8"])
def test_pieces_change_nothing(monkeypatch, moments, one_thread):
    state = compact_state([64, 5000], moments)
    whole = adam(state)
    monkeypatch.setattr(_torch_compact, "PIECE", 2 * _codecs.BLOCK)
    assert_same(adam(state), whole)


def _halves(state, at):
    """The one tensor of `state` as two rows, its elements before `at` and from it (two shards
    of it), the scales of 8-bit moments split at the block `at` starts."""
    out = {"steps": [state["steps"][0].clone(), state["steps"][0].clone()]}
    for key in ("grads", "lows", "corrections", "m", "v"):
        out[key] = [state[key][0][:at].clone(), state[key][0][at:].clone()]
    out["scales"] = None
    if state["scales"] is not None:
        block = at // _codecs.BLOCK
        out["scales"] = tuple([s[0][:block].clone(), s[0][block:].clone()] for s in state["scales"])
    return out


@pytest.mark.parametrize("moments", ["bf16", "int8"])
def test_a_shard_stepped_from_its_start_is_its_part_of_the_whole_tensor(moments, one_thread):
    """FSDP2's rows are shards: stepped with their first elements in the whole tensor (starts),
    their moments' stochastic roundings (and an 8-bit moment's blocks) are the whole tensor's,
    bit for bit; from 0 they are not."""
    state = compact_state([4800], moments)  # a [100, 48] weight; row 50 starts at element 2400
    halves, expected = _halves(state, 2400), _halves(adam(state), 2400)
    sharded = copied(halves)
    kernels.adam_step_(
        sharded["grads"], sharded["lows"], sharded["corrections"], sharded["m"], sharded["v"],
        sharded["steps"], kernels.AdamOptions(**ADAM), scales=sharded["scales"],
        inv_scale=torch.tensor(2.0**-10), found_inf=torch.tensor(0.0), starts=[0, 2400],
    )
    assert_same(sharded, expected)
    from_zero = adam(halves)
    assert not torch.equal(from_zero["v"][1], expected["v"][1])


def test_8_bit_codes_of_a_shard_starting_inside_a_block_are_refused():
    state = compact_state([100], "int8")
    with pytest.raises(ValueError, match="starts at element 50 of its tensor, inside a block"):
        kernels.adam_step_(
            state["grads"], state["lows"], state["corrections"], state["m"], state["v"],
            state["steps"], kernels.AdamOptions(**ADAM), scales=state["scales"], starts=[50],
        )


@pytest.mark.parametrize("moments", ["bf16", "int8"])
def test_a_skipped_step_changes_no_bit(moments):
    """Nor one that encoding again would change: an inf weight's correction, a NaN's payload."""
    state = compact_state([64, 300], moments)
    low = state["lows"][0].view(-1).view(torch.int16)
    low[:2] = torch.tensor([0x7F80, 0x7F85], dtype=torch.int16)  # inf, a NaN with a payload
    state["corrections"][0].view(-1)[:2] = 5
    if moments == "bf16":
        state["m"][0].view(-1).view(torch.int16)[0] = 0x7FA1
    assert_same(adam(state, found=1.0), state)


def test_exact_masters_with_8_bit_moments_step_the_masters_in_place(one_thread):
    state = compact_state([64, 100], "int8")
    masters = [
        kernels.compact_decode(low, c) for low, c in zip(state["lows"], state["corrections"])
    ]
    lows = [m.to(torch.bfloat16) for m in masters]
    theirs = reference_adam(state)
    kernels.adam_step_(
        state["grads"],
        lows,
        masters,
        state["m"],
        state["v"],
        state["steps"],
        kernels.AdamOptions(**ADAM),
        scales=state["scales"],
        inv_scale=torch.tensor(2.0**-10),
        found_inf=torch.tensor(0.0),
    )
    for master, low, low_c in zip(masters, lows, theirs["lows"]):
        assert torch.equal(bits(kernels.compact_encode(master)[0]), bits(low_c))
        assert torch.equal(low, master.to(torch.bfloat16))


def test_the_first_sgd_step_starts_the_momentum_as_the_gradient():
    grads = [torch.randn(50).to(torch.bfloat16)]
    lows, corrections = map(list, zip(kernels.compact_encode(torch.randn(50))))
    buffers, scales = map(list, zip(kernels.moment_encode(torch.zeros(50), True)))
    expected = grads[0].float() * 0.5
    kernels.sgd_step_(
        grads,
        lows,
        corrections,
        buffers,
        kernels.SGDOptions(**dict(SGD, weight_decay=0.0)),
        scales=scales,
        first_step=True,
        inv_scale=torch.tensor(0.5),
        found_inf=torch.tensor(0.0),
    )
    back = kernels.moment_decode(buffers[0], scales[0])
    assert torch.allclose(back, expected, rtol=2 / 127, atol=expected.abs().max().item() * 2 / 127)

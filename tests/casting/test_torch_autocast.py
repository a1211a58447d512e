"""The contract with torch.autocast (amp/casting/torch_autocast.py, native_autocast.py): one truth
with PyTorch's autocast. amp's casting is torch's own autocast state, and torch.autocast regions
are amp regions, under O1 and amp.autocast (checkpointing, custom_fwd, FP32 islands, RNNs,
compile, threads, devices)."""

import contextlib
import threading

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

import amp
from amp._state import amp_state
from helpers import DTYPES, casting
from helpers.state import torch_autocast_state

LOW = pytest.mark.parametrize("dtype", DTYPES, ids=str)
MODES = pytest.mark.parametrize("mode", ["O1", "autocast"])


# -- torch reads amp's state --------------------------------------------------------------------


@MODES
@LOW
def test_torch_reports_amps_state(mode, dtype):
    assert not torch.is_autocast_enabled("cpu")
    with casting(mode, dtype):
        assert torch.is_autocast_enabled("cpu") and torch.is_autocast_enabled("cuda")
        assert torch.get_autocast_dtype("cpu") is dtype
        assert torch.get_autocast_dtype("cuda") is dtype
        assert torch.is_autocast_cache_enabled()
        assert torch._C._is_any_autocast_enabled()
        with amp.disable_casts():
            assert not torch.is_autocast_enabled("cpu")
            assert not torch._C._is_any_autocast_enabled()
    assert not torch.is_autocast_enabled("cpu") and not torch._C._is_any_autocast_enabled()


@pytest.mark.filterwarnings("ignore:CUDA is not available:UserWarning")  # a CUDA region, CPU only
def test_region_options_are_reported_per_device():
    with amp.autocast(dtype=torch.bfloat16, device_type="cpu", cache_enabled=False):
        assert torch.is_autocast_enabled("cpu") and not torch.is_autocast_enabled("cuda")
        assert not torch.is_autocast_cache_enabled()
        with amp.autocast(dtype=torch.float16, device_type="cuda"):
            # A region on one device leaves the other as it was, as torch's regions do.
            assert torch.get_autocast_dtype("cpu") is torch.bfloat16
            assert torch.get_autocast_dtype("cuda") is torch.float16


def test_torch_state_is_thread_local_like_amps():
    seen = {}

    def other():
        seen["enabled"] = torch.is_autocast_enabled("cpu")

    with amp.autocast(dtype=torch.bfloat16):
        worker = threading.Thread(target=other)
        worker.start()
        worker.join()
    assert seen["enabled"] is False


def test_amps_casting_is_torchs_own_state_and_backward_runs_without_it():
    """torch's dispatcher-level autocast is on with amp's dtypes (it casts the ops on which the
    tables agree with it), and off during backward: an FP32 island's gradient stays FP32."""
    readers = torch.is_autocast_enabled, torch.get_autocast_dtype, torch._C._is_any_autocast_enabled
    a = torch.randn(4, 4, requires_grad=True)
    seen = []

    class Spy(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            seen.append((torch.is_autocast_enabled("cpu"), torch.mm(grad, grad).dtype))
            return grad

    with amp.autocast(dtype=torch.bfloat16):
        assert amp.casting.native_autocast.is_enabled("cpu")
        assert torch.get_autocast_dtype("cuda") is torch.bfloat16
        with torch.autocast("cpu", enabled=False):
            island = Spy.apply(a @ a)  # FP32
        island.sum().backward()
        with torch.autocast("cpu", dtype=torch.float16):
            assert amp.casting.native_autocast.dtype_of("cpu") is torch.float16
    assert (torch.is_autocast_enabled, torch.get_autocast_dtype) == readers[:2]
    assert torch._C._is_any_autocast_enabled is readers[2]  # torch's readers: never patched
    assert seen == [(False, torch.float32)]
    ones, weight = torch.ones(4, 4), a.detach()
    assert torch.equal(a.grad, ones @ weight.t() + weight.t() @ ones)


# -- torch.autocast inside amp's casting ---------------------------------------------------------


@MODES
@LOW
def test_torch_autocast_disabled_is_an_fp32_island(mode, dtype):
    a, b = torch.randn(8, 8), torch.randn(8, 8)
    reference = torch.mm(a, b)
    with casting(mode, dtype):
        assert torch.mm(a, b).dtype is dtype
        with torch.autocast("cpu", enabled=False):
            assert torch.mm(a, b).equal(reference)
            assert not torch.is_autocast_enabled("cpu")
        assert torch.mm(a, b).dtype is dtype
        with torch.autocast("cuda", enabled=False):  # another device: CPU casting goes on
            assert torch.mm(a, b).dtype is dtype


@MODES
@LOW
def test_nested_torch_autocast_is_a_region_in_its_dtype(mode, dtype):
    other = torch.float16 if dtype is torch.bfloat16 else torch.bfloat16
    a = torch.randn(8, 8)
    with casting(mode, dtype):
        with torch.autocast("cpu", dtype=other):
            assert torch.mm(a, a).dtype is other
            assert torch.get_autocast_dtype("cpu") is other
            with torch.autocast("cpu", enabled=False):
                assert torch.mm(a, a).dtype is torch.float32
            assert F.softmax(a.to(other), -1).dtype is torch.float32  # amp's FP32 table
        assert torch.mm(a, a).dtype is dtype


def test_torch_autocast_uses_amps_tables_and_registrations(registrations):
    a = torch.randn(8, 8)
    amp.register_float_function(torch, "mm")
    with amp.autocast(dtype=torch.bfloat16):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert torch.mm(a.bfloat16(), a.bfloat16()).dtype is torch.float32
            with amp.trace() as trace:
                F.linear(a, a)
    assert trace.records[0].ran_in is torch.bfloat16


def test_a_torch_region_opened_before_amp_and_amps_regions_inside_it_nest_as_one_stack():
    a = torch.randn(8, 8)
    amp.deinitialize()
    with torch.autocast("cpu", dtype=torch.bfloat16):  # torch's own region: amp not installed
        with amp.autocast(dtype=torch.float16):
            assert torch.mm(a, a).dtype is torch.float16
            assert amp.casting.native_autocast.dtype_of("cpu") is torch.float16
        assert amp.casting.native_autocast.is_enabled("cpu")
        assert torch.mm(a, a).dtype is torch.bfloat16  # torch's own casting again
    assert not amp.casting.native_autocast.is_enabled("cpu")


def test_deinitialize_inside_a_region_waits_for_it():
    original = torch.mm
    with amp.autocast():
        amp.deinitialize()
        assert torch.mm(torch.randn(2, 2), torch.randn(2, 2)).dtype is torch.float16
    assert torch.mm is original


# -- custom_fwd / custom_bwd from torch ----------------------------------------------------------


class Fp32Op(torch.autograd.Function):
    """A third-party op that must run in FP32 (as CUDA/Triton extensions declare it)."""

    seen = []

    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu", cast_inputs=torch.float32)
    def forward(ctx, x, weight):
        Fp32Op.seen.append(("forward", x.dtype, torch.mm(x, weight).dtype))
        ctx.save_for_backward(x, weight)
        return torch.mm(x, weight)

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        Fp32Op.seen.append(("backward", grad.dtype, torch.mm(grad, weight.t()).dtype))
        return torch.mm(grad, weight.t()), torch.mm(x.t(), grad)


class LowOp(torch.autograd.Function):
    seen = []

    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu")
    def forward(ctx, x):
        return torch.mm(x, x)

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, grad):
        LowOp.seen.append(torch.mm(grad, grad).dtype)
        return grad


@MODES
@LOW
def test_torch_custom_fwd_cast_inputs_runs_in_fp32(mode, dtype):
    Fp32Op.seen.clear()
    x = torch.randn(4, 4, requires_grad=True)
    weight = torch.randn(4, 4, requires_grad=True)
    with casting(mode, dtype):
        out = Fp32Op.apply(x.to(dtype), weight)
        assert out.dtype is torch.float32
        out.sum().backward()
    assert Fp32Op.seen == [
        ("forward", torch.float32, torch.float32),
        ("backward", torch.float32, torch.float32),
    ]
    reference = torch.mm(x.to(dtype).float(), weight)
    assert out.equal(reference)


@MODES
@LOW
def test_torch_custom_bwd_runs_backward_under_the_forwards_state(mode, dtype):
    LowOp.seen.clear()
    x = torch.randn(4, 4, requires_grad=True)
    with casting(mode, dtype):
        out = LowOp.apply(x)
        assert out.dtype is dtype
    with amp.disable_casts():
        out.float().sum().backward()  # backward outside any casting: custom_bwd restores it
    assert LowOp.seen == [dtype]


# -- a library's FP32 island: rotary embeddings -----------------------------------------------------


class Rotary(nn.Module):
    """Attention with rotary embeddings computed in FP32 under torch.autocast(enabled=False),
    as transformer libraries write them."""

    def __init__(self, width=16):
        super().__init__()
        self.qk = nn.Linear(width, 2 * width)
        inverse = 1.0 / (10000 ** (torch.arange(0, width, 2).float() / width))
        self.register_buffer("inverse", inverse)
        self.island_dtypes = []

    def forward(self, x):
        q, k = self.qk(x).chunk(2, -1)
        with torch.autocast(x.device.type, enabled=False):
            positions = torch.arange(x.shape[1], dtype=torch.float32)
            angles = torch.outer(positions, self.inverse)
            cos, sin = angles.cos().repeat(1, 2), angles.sin().repeat(1, 2)
            q32, k32 = q.float(), k.float()
            half = q32.shape[-1] // 2
            rotate = lambda t: torch.cat((-t[..., half:], t[..., :half]), -1)  # noqa: E731
            q32 = q32 * cos + rotate(q32) * sin
            k32 = k32 * cos + rotate(k32) * sin
            scores = torch.matmul(q32, k32.transpose(-1, -2))
            self.island_dtypes.append(scores.dtype)
        return torch.matmul(scores.softmax(-1), x)


@MODES
@LOW
def test_rotary_embedding_island_runs_in_fp32(mode, dtype):
    model = Rotary()
    x = torch.randn(2, 5, 16)
    with casting(mode, dtype, model):
        out = model(x)
        assert out.dtype is dtype  # the matmul after the island is cast again
    assert model.island_dtypes == [torch.float32]


# -- activation checkpointing -------------------------------------------------------------------


def _net():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(16, 32),
        nn.GELU(),
        nn.LayerNorm(32),
        nn.Linear(32, 32),
        nn.Softmax(-1),
        nn.Linear(32, 8),
    )


def _gradients(mode, dtype, run):
    model = _net()
    x = torch.randn(4, 16, requires_grad=True)
    if mode == "O1":
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model, optimizer = amp.initialize(
            model, optimizer, opt_level="O1", dtype=dtype, verbosity=0
        )
        try:
            loss = run(model, x).float().square().sum()
            with amp.scale_loss(loss, optimizer) as scaled:
                scaled.backward()
        finally:
            amp.deinitialize()
    else:
        with amp.autocast(dtype=dtype):
            loss = run(model, x).float().square().sum()
        loss.backward()
    return [x.grad] + [p.grad for p in model.parameters()]


CHECKPOINTS = {
    "non-reentrant": lambda model, x: checkpoint(model, x, use_reentrant=False),
    "reentrant": lambda model, x: checkpoint(model, x, use_reentrant=True),
    "sequential": lambda model, x: checkpoint_sequential(model, 3, x, use_reentrant=False),
    "sequential-reentrant": lambda model, x: checkpoint_sequential(model, 3, x, use_reentrant=True),
}


@pytest.mark.parametrize("kind", list(CHECKPOINTS))
@MODES
@LOW
def test_checkpointed_gradients_are_bit_identical(kind, mode, dtype):
    expected = _gradients(mode, dtype, lambda model, x: model(x))
    got = _gradients(mode, dtype, CHECKPOINTS[kind])
    assert all(g is not None for g in got)
    for want, have in zip(expected, got):
        assert have.dtype is want.dtype and torch.equal(have, want)


# -- RNNs -----------------------------------------------------------------------------------------


class Stacks(nn.Module):
    """Recurrent modules fed by low-precision outputs: stacked LSTMs, conv -> GRU,
    attention -> RNN."""

    def __init__(self):
        super().__init__()
        self.first, self.second = nn.LSTM(8, 8), nn.LSTM(8, 8)
        self.conv, self.gru = nn.Conv1d(8, 8, 3, padding=1), nn.GRU(8, 8, batch_first=True)
        self.attention = nn.MultiheadAttention(8, 2, batch_first=True)
        self.rnn = nn.RNN(8, 8, batch_first=True)
        self.cell = nn.LSTMCell(8, 8)

    def forward(self, x):  # x: (batch, length, 8)
        y = self.second(self.first(x.transpose(0, 1))[0])[0].transpose(0, 1)
        y = self.gru(self.conv(y.transpose(1, 2)).transpose(1, 2))[0]
        y = self.rnn(self.attention(y, y, y, need_weights=False)[0])[0]
        return self.cell(y[:, -1])[0]


@MODES
@LOW
def test_rnns_take_low_precision_inputs(mode, dtype):
    model = Stacks()
    x = torch.randn(2, 5, 8)
    with casting(mode, dtype, model):
        with amp.trace() as trace:
            out = model(x)
        out.float().sum().backward()
    assert out.dtype is dtype
    recurrent = [r for r in trace.records if r.op.startswith("torch._VF.")]
    assert [r.op.rsplit(".", 1)[1] for r in recurrent] == [
        "lstm",
        "lstm",
        "gru",
        "rnn_tanh",
        "lstm_cell",
    ]
    assert all(r.ran_in is dtype for r in recurrent)  # weights cast as the table says
    assert all(p.grad is not None and p.grad.dtype is torch.float32 for p in model.parameters())


# -- call forms -----------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:CUDA is not available:UserWarning")  # a CUDA region, CPU only
def test_torch_call_forms():
    a = torch.randn(4, 4)
    with amp.autocast("cpu", dtype=torch.bfloat16):
        assert torch.mm(a, a).dtype is torch.bfloat16
    with amp.autocast("cpu", torch.float16):
        assert torch.mm(a, a).dtype is torch.float16
    with amp.autocast("cpu"):  # torch's default dtype for the device
        assert torch.mm(a, a).dtype is torch.get_autocast_dtype("cpu") is torch.bfloat16
    with amp.autocast(device_type="cpu", dtype=torch.bfloat16, enabled=True):
        assert torch.mm(a, a).dtype is torch.bfloat16
    with amp.autocast("cuda", dtype=torch.bfloat16):  # casts CUDA tensors only
        assert torch.mm(a, a).dtype is torch.float32
    with amp.autocast(dtype=torch.float32, enabled=False):
        assert torch.mm(a, a).dtype is torch.float32
    with amp.autocast("cpu", torch.bfloat16, False):  # enabled, positionally, in torch's order
        assert torch.mm(a, a).dtype is torch.float32
    with amp.autocast(True, torch.bfloat16):  # amp's positional order
        assert torch.mm(a, a).dtype is torch.bfloat16


def test_torch_exception_types_for_bad_devices():
    for bad in ("tpu", "xpu"):
        with pytest.raises(RuntimeError, match="unsupported device_type"):
            amp.autocast(bad)
        with pytest.raises(RuntimeError, match="unsupported device_type"):
            amp.autocast(device_type=bad)
    with pytest.raises(ValueError, match="device_type"):
        amp.autocast(device_type=0)
    with pytest.raises(TypeError, match="multiple values"):
        amp.autocast("cpu", enabled=True, device_type="cpu")
    with pytest.raises(TypeError, match="unexpected keyword"):
        amp.autocast(device="cpu")
    with pytest.raises(ValueError, match="low-precision"):
        amp.autocast("cpu", dtype=torch.float32)


# -- torch.compile ---------------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, width=32, heads=4):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attention = nn.MultiheadAttention(width, heads, batch_first=True)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )

    def forward(self, x):
        y = self.norm1(x)
        x = x + self.attention(y, y, y, need_weights=False)[0]
        hidden = self.mlp[0](self.norm2(x))
        return x + self.mlp[2](self.mlp[1](hidden)), hidden


@pytest.mark.slow
@MODES
def test_compiled_block_trains_in_one_graph_without_recompiles(mode):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = Block()
    eager_model = Block()
    eager_model.load_state_dict(model.state_dict())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    compiled = torch.compile(model, fullgraph=True)
    x = torch.randn(2, 8, 32)

    def step(module):
        if mode == "O1":
            out, hidden = module(x)
            with amp.scale_loss(out.float().square().mean(), optimizer) as scaled:
                scaled.backward()
        else:
            with amp.autocast(dtype=torch.bfloat16):
                out, hidden = module(x)
            out.float().square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        return out, hidden

    with contextlib.ExitStack() as stack:
        if mode == "O1":
            amp.initialize(model, optimizer, opt_level="O1", dtype=torch.bfloat16, verbosity=0)
            stack.callback(amp.deinitialize)
        for _ in range(3):
            out, hidden = step(compiled)
        assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
        eager_model.load_state_dict(model.state_dict())
        with (
            casting("autocast", torch.bfloat16) if mode == "autocast" else contextlib.nullcontext()
        ):
            want, want_hidden = eager_model(x)
            got, got_hidden = compiled(x)
    assert counters["stats"]["unique_graphs"] == 1  # no recompile after warm-up
    assert hidden.dtype is want_hidden.dtype is torch.bfloat16  # the graph casts as eager does
    assert got.dtype is want.dtype
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    torch._dynamo.reset()


def test_wrappers_take_the_compiled_path_while_compiling(monkeypatch):
    """While torch.export or Dynamo traces, a wrapper casts with plain tensor code (no weight
    cache), from torch's state as Dynamo saved it."""
    x = torch.randn(2, 4).half()
    with amp.autocast(dtype=torch.bfloat16):
        monkeypatch.setattr(torch.compiler, "_is_compiling_flag", True)
        traced = torch.softmax(x, -1)
        monkeypatch.setattr(torch.compiler, "_is_compiling_flag", False)
        assert torch.is_autocast_enabled("cpu")
    assert traced.dtype is torch.float32
    assert torch.equal(traced, torch.softmax(x.float(), -1))
    assert amp_state.torch_patches.users == 0


@pytest.mark.slow
def test_disable_casts_inside_a_compiled_function():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()

    def both(x):
        with amp.disable_casts():
            kept = torch.mm(x, x)
        return torch.mm(x, x), kept

    compiled = torch.compile(both, fullgraph=True)
    x = torch.randn(8, 8)
    with amp.autocast(dtype=torch.bfloat16):
        for _ in range(2):
            cast, kept = compiled(x)
    assert (cast.dtype, kept.dtype) == (torch.bfloat16, torch.float32)
    assert counters["stats"]["unique_graphs"] == 1
    torch._dynamo.reset()


@pytest.mark.parametrize("device_type", [None, "cpu"])
def test_a_region_opened_inside_a_compiled_function_is_one_graph(device_type):
    """amp.autocast in the compiled code itself, either form: Dynamo traces the region's torch
    setters (a thread's first region sets its two devices through their dispatch keys in eager
    mode only), one graph that casts as eager does; the thread's state is as it was after."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    weight = torch.randn(8, 8)

    def region(x):
        with amp.autocast(dtype=torch.bfloat16, device_type=device_type):
            inside = F.linear(x, weight)
        return inside, F.linear(x, weight)

    # Entered once before: a first region's install of the patches is not traceable, and a
    # region policy first made in a trace (cached) recompiles the function once.
    with amp.autocast(dtype=torch.bfloat16, device_type=device_type):
        pass
    before = torch_autocast_state()
    compiled = torch.compile(region, fullgraph=True, backend="eager")
    x = torch.randn(4, 8)
    for _ in range(2):
        inside, after = compiled(x)
    assert (inside.dtype, after.dtype) == (torch.bfloat16, torch.float32)
    assert torch.equal(inside, F.linear(x.bfloat16(), weight.bfloat16()))
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    assert torch_autocast_state() == before
    torch._dynamo.reset()


# -- CUDA (run where a GPU is lent) ------------------------------------------------------------------


@pytest.mark.cuda
@LOW
def test_cuda_islands_readers_and_checkpoint(dtype):
    a = torch.randn(8, 8, device="cuda")
    with amp.autocast("cuda", dtype=dtype):
        assert torch.is_autocast_enabled("cuda") and not torch.is_autocast_enabled("cpu")
        assert torch.mm(a, a).dtype is dtype
        assert torch.mm(a.cpu(), a.cpu()).dtype is torch.float32
        with torch.autocast("cuda", enabled=False):
            assert torch.mm(a, a).dtype is torch.float32
    model = _net().cuda()
    x = torch.randn(4, 16, device="cuda", requires_grad=True)
    grads = []
    for run in (lambda: model(x), lambda: checkpoint(model, x, use_reentrant=False)):
        model.zero_grad()
        x.grad = None
        with amp.autocast("cuda", dtype=dtype):
            loss = run().float().square().sum()
        loss.backward()
        grads.append([x.grad.clone()] + [p.grad.clone() for p in model.parameters()])
    assert all(torch.equal(want, have) for want, have in zip(*grads))


# -- torch regions and graphs around amp ---------------------------------------------------------


@pytest.mark.slow
def test_a_graph_compiled_outside_a_region_is_not_reused_inside_one():
    torch._dynamo.reset()
    linear = nn.Linear(4, 4)
    x = torch.randn(2, 4)
    compiled = torch.compile(lambda x: linear(x), backend="eager")
    with amp.autocast(dtype=torch.bfloat16):  # installs the patches
        assert compiled(x).dtype is torch.bfloat16
    assert compiled(x).dtype is torch.float32
    with amp.autocast(dtype=torch.bfloat16):
        assert compiled(x).dtype is torch.bfloat16
    with torch.autocast("cpu", dtype=torch.float16):
        assert compiled(x).dtype is torch.float16
    amp.initialize(nn.Linear(1, 1), opt_level="O1", dtype=torch.bfloat16, verbosity=0)
    try:
        assert compiled(x).dtype is torch.bfloat16
        with amp.disable_casts():
            assert compiled(x).dtype is torch.float32
        with torch.autocast("cpu", enabled=False):
            assert compiled(x).dtype is torch.float32
    finally:
        amp.deinitialize()
    torch._dynamo.reset()


@pytest.mark.slow
def test_torch_autocast_inside_a_graph_run_as_fx_code_is_torchs_own():
    torch._dynamo.reset()
    linear = nn.Linear(4, 4)
    x = torch.randn(2, 4)

    def region(x, fail=False):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = linear(x)
            if fail:
                raise ValueError("inside")
        return y

    with amp.autocast(dtype=torch.float16):
        pass  # amp's patches are installed from here on
    compiled = torch.compile(region, backend="eager")
    assert compiled(x).dtype is torch.bfloat16  # as eager torch: the graph's ops are torch's
    assert not torch.is_autocast_enabled("cpu") and not amp.casting.native_autocast.any_enabled()
    torch._dynamo.reset()


def test_amp_custom_fwd_sees_a_torch_region_opened_before_amp():
    amp.deinitialize()

    class Op(torch.autograd.Function):
        @staticmethod
        @amp.custom_fwd(cast_inputs=torch.float32)
        def forward(ctx, x):
            return x.dtype, torch.is_autocast_enabled("cpu"), torch.mm(x, x).dtype

        @staticmethod
        def backward(ctx, *grads):
            return None

    with torch.autocast("cpu", dtype=torch.bfloat16):  # torch's own: amp not installed
        assert Op.apply(torch.randn(2, 2).bfloat16()) == (torch.float32, False, torch.float32)
    assert not amp.casting.native_autocast.any_enabled()


@pytest.mark.parametrize("region", ["torch before amp", "torch.autocast", "amp.autocast", "off"])
def test_o1_inside_a_region_is_refused(region):
    """O1 sets torch's autocast state of the thread, which an open region would put back as it
    exits: refused, and nothing is changed."""
    if region == "torch before amp":
        amp.deinitialize()
    contexts = {
        "torch before amp": lambda: torch.autocast("cpu", dtype=torch.bfloat16),
        "torch.autocast": lambda: torch.autocast("cpu", dtype=torch.bfloat16),
        "amp.autocast": lambda: amp.autocast(dtype=torch.bfloat16),
        "off": amp.disable_casts,
    }
    model = nn.Linear(2, 2)
    weight = model.weight.detach().clone()
    with contexts[region]():
        with pytest.raises(RuntimeError, match="inside an autocast region"):
            amp.initialize(model, opt_level="O1", verbosity=0)
    assert not amp_state.initialized and torch.equal(model.weight, weight)
    amp.deinitialize()


@pytest.mark.filterwarnings("ignore:CUDA is not available:UserWarning")  # a CUDA region, CPU only
def test_readers_fall_back_to_torchs_state_where_amp_casts_nothing():
    amp.deinitialize()
    with torch.autocast("cpu", dtype=torch.bfloat16):  # torch's own region on CPU
        with amp.autocast("cuda", dtype=torch.float16):
            assert torch.is_autocast_enabled("cpu")  # torch's own casting goes on there
            assert torch.get_autocast_dtype("cpu") is torch.bfloat16
            assert torch.get_autocast_dtype("cuda") is torch.float16
            assert torch.mm(torch.randn(2, 2), torch.randn(2, 2)).dtype is torch.bfloat16


def test_readers_take_torchs_argument_forms_and_errors():
    with amp.autocast(dtype=torch.float16):
        assert torch.is_autocast_enabled("cpu:0")
        assert torch.get_autocast_dtype("cpu:0") is torch.float16
        assert torch.is_autocast_enabled(device_type="cpu")
        with pytest.raises(TypeError) as raised:
            torch.get_autocast_dtype()
        assert str(raised.value).startswith("get_autocast_dtype() missing")  # torch's message


def test_patched_calls_read_torchs_state_and_trace_only_while_something_traces():
    x = torch.randn(2, 2)
    with amp.autocast():
        assert amp_state.active
    assert not amp_state.active  # patches stay installed; a call goes straight to the original
    with amp.trace() as trace:  # a trace outside any region still records, as "off"
        assert amp_state.active
        torch.mm(x, x)
    assert [record.policy for record in trace.records] == ["off"] and not amp_state.active
    assert not hasattr(torch.mm, "__amp_kind__")  # only while a trace is open is it wrapped
    amp.initialize(nn.Linear(1, 1), opt_level="O1", verbosity=0)
    try:
        assert amp_state.active and torch.mm(x, x).dtype is torch.float16
    finally:
        amp.deinitialize()
    assert not amp_state.active


def test_a_thread_in_a_torch_region_when_o1_starts_keeps_torchs_casting():
    """O1 is the thread's that initialized it: a thread inside a torch.autocast region of its own
    (opened before amp was installed) goes on casting as torch does, and stops when it leaves."""
    import threading

    amp.deinitialize()  # no patches: the worker's region below is torch's own
    seen = {}
    ready, go = threading.Event(), threading.Event()

    def worker():
        a = torch.full((2, 2), 1e5)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            seen["torch alone"] = torch.mm(a, a)
            ready.set()
            go.wait(30)
            seen["under O1"] = torch.mm(a, a)
            seen["dtype"] = torch.get_autocast_dtype("cpu")
            seen["enabled"] = torch.is_autocast_enabled("cpu")
        seen["after"] = torch.mm(a, a).dtype

    thread = threading.Thread(target=worker)
    thread.start()
    try:
        assert ready.wait(30)
        model = torch.nn.Linear(2, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        amp.initialize(model, optimizer, opt_level="O1", verbosity=0)
    finally:
        go.set()
        thread.join(30)
    amp.deinitialize()
    assert seen["torch alone"].dtype is torch.bfloat16
    assert torch.equal(seen["under O1"], seen["torch alone"])  # 2e10, not inf: cast once
    assert seen["dtype"] is torch.bfloat16 and seen["enabled"]
    assert seen["after"] is torch.float32


def test_an_invalid_device_string_raises_torchs_error():
    with pytest.raises(RuntimeError, match="Invalid device string: 'not a real device'"):
        torch.autocast("not a real device")
    with pytest.raises(RuntimeError, match="Invalid device string: 'not a real device'"):
        amp.autocast("not a real device")
    with pytest.raises(RuntimeError, match="unsupported device_type 'xpu'"):
        amp.autocast("xpu")

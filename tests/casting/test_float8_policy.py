"""float8= as a policy: where FP8 runs, where it does not, and how it is switched on and off."""

import threading

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

import amp
from amp import lists
from amp._state import amp_state

FP8 = torch.float8_e4m3fn


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32), nn.Linear(32, 10))


def _ran_in(trace):
    """(op, policy, ran in) of every F.linear call in the trace."""
    return [(r.policy, r.ran_in) for r in trace.records if r.op.endswith("functional.linear")]


# -- the table and its kind ---------------------------------------------------------------------


def test_float8_funcs_are_data_and_fall_back_to_low_precision():
    entries = list(lists.float8_entries())
    assert [(e.namespace, e.name, e.kind) for e in entries] == [
        ("torch.nn.functional", "linear", lists.FLOAT8)
    ]
    low = {(e.namespace, e.name) for e in lists.entries() if e.kind == lists.LOWER_PRECISION}
    assert all((e.namespace, e.name) in low for e in entries)  # their policy when float8 is off


def test_float8_wrappers_are_installed_only_once_float8_is_asked_for():
    with amp.autocast(dtype=torch.bfloat16):
        # torch's autocast casts F.linear as amp's table says: no wrapper, no float8 check
        assert not hasattr(F.linear, "__amp_kind__")
    with amp.autocast(dtype=torch.bfloat16, float8="tensorwise"):
        assert F.linear.__amp_kind__ == lists.FLOAT8
        assert torch._C._nn.linear.__amp_kind__ == lists.FLOAT8  # the C binding follows
    assert F.linear.__amp_kind__ == lists.FLOAT8  # until the patches are removed
    amp.deinitialize()
    assert not hasattr(F.linear, "__amp_kind__") and not amp_state.torch_patches.float8
    with amp.autocast(dtype=torch.bfloat16):
        assert not hasattr(F.linear, "__amp_kind__")
    amp.deinitialize()


# -- what runs in FP8 -----------------------------------------------------------------------------


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_trace_shows_float8_where_the_shapes_fit(recipe):
    model, x = _mlp(), torch.randn(16, 32)
    with amp.autocast(dtype=torch.bfloat16, float8=recipe), amp.trace() as trace:
        out = model(x)
    assert out.dtype is torch.bfloat16
    assert _ran_in(trace) == [
        ("float8", FP8),
        ("float8", FP8),
        ("lower_precision", torch.bfloat16),  # 10 out features: not a multiple of 16
    ]
    assert "float8_e4m3fn" in str(trace)
    with amp.autocast(dtype=torch.bfloat16, float8=recipe), amp.trace() as trace:
        model(torch.randn(12, 32))  # 12 tokens: the grad-weight matmul would not take them
    assert {ran_in for _, ran_in in _ran_in(trace)} == {torch.bfloat16}
    amp.deinitialize()


def test_the_c_binding_and_keyword_calls_run_in_fp8():
    x, w, b = torch.randn(16, 32), torch.randn(48, 32), torch.randn(48)
    with amp.autocast(dtype=torch.bfloat16, float8="tensorwise"), amp.trace() as trace:
        by_binding = torch._C._nn.linear(x, w, b)
        by_keyword = F.linear(input=x, weight=w, bias=b)
        positional = F.linear(x, w, b)
    assert [r.ran_in for r in trace.records] == [FP8] * 3
    assert torch.equal(by_binding, positional) and torch.equal(by_keyword, positional)
    assert not torch.equal(positional, F.linear(x.bfloat16(), w.bfloat16(), b.bfloat16()))
    amp.deinitialize()


@pytest.mark.parametrize("opt_level", ["O2", "O3"])
def test_o2_o3_cast_nothing_else(opt_level):
    """At O2/O3 amp patches for float8 under a policy that casts nothing: every other op runs as
    it would at that level, torch's autocast readers say off, banned functions are not refused."""
    model = _mlp()
    model = amp.initialize(model, opt_level=opt_level, dtype=torch.bfloat16, float8="tensorwise")
    try:
        x = torch.randn(16, 32)
        with amp.trace() as trace:
            model(x)
            soft = torch.softmax(torch.randn(4, 4, dtype=torch.bfloat16), -1)
            mixed = torch.mm(torch.randn(4, 4), torch.randn(4, 4))  # FP32 stays FP32
            p = torch.rand(4, dtype=torch.bfloat16)
            F.binary_cross_entropy(p, torch.ones(4, dtype=torch.bfloat16))  # no refusal
        assert soft.dtype is torch.bfloat16 and mixed.dtype is torch.float32
        assert _ran_in(trace) == [("float8", FP8), ("float8", FP8), ("off", torch.bfloat16)]
        assert {r.policy for r in trace.records if not r.op.endswith("linear")} == {"off"}
        assert not torch.is_autocast_enabled("cpu") and not torch.is_autocast_enabled("cuda")
        assert not torch._C._is_any_autocast_enabled()
        assert amp_state.properties.float8 == "tensorwise"
    finally:
        amp.deinitialize()


def test_o1_float8_holds_in_its_thread_and_in_regions_of_others():
    """O1 (float8 included) casts in the thread that initialized it: torch's autocast state is
    per thread. A thread started under O1 starts with casting off, as under torch.autocast, and a
    region there runs in FP8 again."""
    model = _mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(
        model, optimizer, opt_level="O1", dtype=torch.bfloat16, float8="rowwise", verbosity=0
    )
    seen = {}
    try:

        def run():
            with amp.trace() as outside:
                model(torch.randn(16, 32))
            with amp.autocast(dtype=torch.bfloat16, float8="rowwise"), amp.trace() as inside:
                model(torch.randn(16, 32))
            seen["outside"], seen["inside"] = _ran_in(outside), _ran_in(inside)

        thread = threading.Thread(target=run)
        thread.start()
        thread.join()
        with amp.trace() as own:
            model(torch.randn(16, 32))
    finally:
        amp.deinitialize()
    assert _ran_in(own)[:2] == [("float8", FP8)] * 2
    assert seen["outside"][:2] == [("off", torch.float32)] * 2
    assert seen["inside"][:2] == [("float8", FP8)] * 2


# -- switching it off ---------------------------------------------------------------------------


def test_regions_that_turn_float8_off_and_torch_autocast_that_keeps_it():
    linear, x = nn.Linear(32, 48), torch.randn(16, 32)
    with amp.autocast(dtype=torch.bfloat16, float8="tensorwise"):
        with amp.trace() as trace:
            with amp.disable_casts():
                linear(x)  # amp casts nothing: FP32
            with amp.autocast(enabled=False):
                linear(x)  # an amp region off: no FP8 either
            with amp.autocast(dtype=torch.bfloat16):
                linear(x)  # an amp region states its whole policy: no float8 asked
            with torch.autocast("cpu", enabled=False):
                linear(x)  # torch.autocast changes dtypes only (as for torchao's Float8Linear)
    assert [ran_in for _, ran_in in _ran_in(trace)] == [
        torch.float32,
        torch.float32,
        torch.bfloat16,
        FP8,
    ]
    amp.deinitialize()


def test_registering_linear_takes_it_out_of_fp8(registrations):
    amp.register_float_function(F, "linear")
    with amp.autocast(dtype=torch.bfloat16, float8="tensorwise"), amp.trace() as trace:
        _mlp()(torch.randn(16, 32))
    assert {(p, r) for p, r in _ran_in(trace)} == {("fp32", torch.float32)}
    amp.deinitialize()


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_fp32_modules_keep_the_first_and_last_layers_out_of_fp8(opt_level):
    """The usual exclusions: the first layer (it sees the raw inputs) and the last (the logits)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.Linear(64, 16))
    model = amp.initialize(
        model,
        opt_level=opt_level,
        dtype=torch.bfloat16,
        float8="tensorwise",
        fp32_modules=["0", "3"],
        verbosity=0,
    )
    try:
        with amp.trace() as trace:
            out = model(torch.randn(16, 32))
        out.float().sum().backward()
    finally:
        amp.deinitialize()
    assert [ran_in for _, ran_in in _ran_in(trace)] == [torch.float32, FP8, torch.float32]
    assert all(p.grad is not None for p in model.parameters())


def test_gradient_checkpointing_recomputes_in_fp8():
    """Recomputation runs under the torch.autocast state the forward saw; float8 carries
    through it, so checkpointed gradients are those of the plain run, bit for bit."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
    x = torch.randn(16, 32)
    grads = []
    for checkpointed in (False, True):
        model.zero_grad()
        amp.initialize(model, opt_level="O1", dtype=torch.bfloat16, float8="tensorwise")
        try:
            if checkpointed:
                out = torch.utils.checkpoint.checkpoint(model, x, use_reentrant=False)
            else:
                out = model(x)
            out.float().square().sum().backward()
        finally:
            amp.deinitialize()
        grads.append([p.grad.clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


# -- errors ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["rowwise_with_gw_hp", "TENSORWISE", True, 8])
def test_unknown_recipes_are_refused_and_nothing_changes(value):
    model = _mlp()
    before = F.linear
    with pytest.raises(ValueError, match="not a float8 recipe.*'tensorwise', 'rowwise'"):
        amp.initialize(model, opt_level="O2", float8=value)
    with pytest.raises(ValueError, match="not a float8 recipe"):
        amp.initialize(model, enabled=False, float8=value)
    with pytest.raises(ValueError, match=r"autocast\(float8=...\)"):
        amp.autocast(float8=value)
    assert F.linear is before and not amp_state.initialized
    assert next(model.parameters()).dtype is torch.float32


def test_o0_with_float8_is_refused():
    model = _mlp()
    with pytest.raises(ValueError, match="opt_level='O0' trains in pure FP32"):
        amp.initialize(model, opt_level="O0", float8="tensorwise")
    assert not amp_state.initialized and not amp_state.torch_patches.installed


def test_autocast_takes_float8_by_keyword_only():
    with pytest.raises(TypeError, match="at most 4 positional"):
        amp.autocast(True, torch.bfloat16, True, None, "tensorwise")
    region = amp.autocast("cpu", dtype=torch.bfloat16, float8="rowwise")  # torch's form too
    assert region.float8 == "rowwise"


def test_the_options_log_names_float8(caplog):
    model = _mlp()
    with caplog.at_level("INFO", logger="amp"):
        amp.initialize(model, opt_level="O2", dtype=torch.bfloat16, float8="rowwise")
    amp.deinitialize()
    assert f"{'float8':22} : rowwise" in caplog.text

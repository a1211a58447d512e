"""The forms of O2's state (amp/weights/forms.py, kept by owner.py): masters as bf16 weights with
int16 remainders (exact) or int8 corrections (compact), moments in FP32, 8 bits or bf16, all in
the parameters' state entries and stepped by the fused step; what they train to, skips,
checkpoints either way and loaded before or after initialize, deinitialize after any of them,
and what is refused."""

import copy
import io

import pytest
import torch

import amp
from helpers.models import inject, loss_of, make_model
from helpers.o2 import general_path

pytestmark = pytest.mark.usefixtures("deinitialized")

FORMS = [
    dict(master_weights="compact"),
    dict(master_weights="compact", optimizer_state="int8"),
    dict(master_weights="compact", optimizer_state="bf16"),
    dict(optimizer_state="int8"),
]
IDS = ["compact", "compact-int8", "compact-bf16", "int8"]
EVERY_FORM, EVERY_ID = [{}, dict(optimizer_state="bf16"), *FORMS], ["exact", "bf16", *IDS]


def plain(cls=torch.optim.AdamW, batch_norm=True, **options):
    model = make_model(inputs=16, hidden=32, outputs=16, batch_norm=batch_norm)
    return model, cls(model.parameters(), **(options or dict(lr=0.01)))


def initialize(model, optimizer, form):
    return amp.initialize(
        model, optimizer, opt_level="O2", dtype=torch.bfloat16, verbosity=0, **form
    )


def setup(form, cls=torch.optim.AdamW, batch_norm=True, **options):
    return initialize(*plain(cls, batch_norm, **options), form)


def train(model, optimizer, steps, inside=None):
    for step in steps:
        optimizer.zero_grad()
        with amp.scale_loss(loss_of(model, step, inputs=16, outputs=16), optimizer) as scaled:
            scaled.backward()
            if inside is not None:
                inside(step, model)
        optimizer.step()


def values(model, optimizer):
    """Everything a step may change: weights, their FP32 values, optimizer state, amp's state
    (not batch norm's statistics, which the forward updates)."""
    named = dict(model.named_parameters())
    state = {key: value for key, value in model.state_dict().items() if key in named}
    weights = [p.detach() for p in model.parameters()]
    return copy.deepcopy((weights, state, optimizer.state_dict(), amp.state_dict()))


def assert_equal(a, b):
    for x, y in zip(_flat(a), _flat(b), strict=True):
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and torch.equal(
                x.view(-1).view(torch.uint8), y.view(-1).view(torch.uint8)
            )
        else:
            assert x == y


def _flat(value):
    if isinstance(value, dict):
        for key in sorted(value, key=str):
            yield key
            yield from _flat(value[key])
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _flat(item)
    else:
        yield value


@pytest.mark.parametrize("form", FORMS, ids=IDS)
def test_compact_state_keeps_what_it_says_and_no_fp32_master(form):
    model, optimizer = setup(form)
    train(model, optimizer, range(2))
    held = [p for group in optimizer.param_groups for p in group["params"]]
    assert [p is q for p, q in zip(held, model.parameters())] == [True] * len(held)  # real
    compact = form.get("master_weights") == "compact"
    # the Linear weights (batch norm's stay FP32): [16, 32] first, whose rows are whole blocks of
    # 32 (8-bit codes); [32, 16]'s are not, and keeps FP32 moments under "int8", as the biases
    cast = [m for m in reversed(held) if m.dim() == 2]
    assert all(p.dtype is torch.bfloat16 for p in cast)
    state = optimizer.state[cast[0]]  # what torch's step keeps, in the form
    kind = form.get("optimizer_state", "fp32")
    keys = {"fp32": {"exp_avg", "exp_avg_sq"}, "bf16": {"exp_avg_bf16", "exp_avg_sq_bf16"}}
    keys["int8"] = {"exp_avg_codes", "exp_avg_scales", "exp_avg_sq_codes", "exp_avg_sq_scales"}
    assert set(state) == keys[kind] | {"step"}
    rest = "master_correction" if compact else "master_remainder"
    number = next(i for i, p in enumerate(held) if p is cast[0])
    saved = optimizer.state_dict()["state"][number]  # with the master's rest
    assert set(saved) == keys[kind] | {"step", rest}
    assert saved[rest].dtype is (torch.int8 if compact else torch.int16)
    assert not any(t.dtype is torch.float32 and t.shape == cast[0].shape for t in state.values()
                   if kind != "fp32")  # no FP32 master anywhere
    if kind == "int8":
        assert state["exp_avg_codes"].dtype is torch.int8
        assert state["exp_avg_sq_codes"].dtype is torch.uint8
        assert state["exp_avg_scales"].shape == (16, 1)  # laid out as the rows
        for param in (cast[1], model[0].bias):
            assert set(optimizer.state[param]) == {"exp_avg", "exp_avg_sq", "step"}
            assert optimizer.state[param]["exp_avg"].dtype is torch.float32
    assert all(p.dtype is torch.bfloat16 for p in model[0].parameters())


@pytest.mark.parametrize("form", FORMS[:2], ids=IDS[:2])
def test_compact_masters_follow_fp32_masters_to_a_fraction_of_a_bf16_ulp(form):
    """One step from the same weights: the compact master is the FP32 master to within what its
    correction keeps (1/256 of a bf16 ulp, twice: before and after the step)."""
    exact = setup({}, batch_norm=False, lr=0.01, fused=True)
    train(*exact, range(1))
    reference = [p.detach().clone() for p in exact[0].state_dict().values()]
    amp.deinitialize()
    model, optimizer = setup(form, batch_norm=False, lr=0.01, fused=True)
    train(model, optimizer, range(1))
    for ours, theirs in zip(model.state_dict().values(), reference):
        # 1/128 of a bf16 ulp of the larger of the weight and its update (lr 0.01: at most 0.01)
        bound = (theirs.abs() + 0.01) * 2**-7 / 128
        assert ((ours - theirs).abs() <= bound).all()


@pytest.mark.parametrize(
    "options", [dict(float8="tensorwise"), dict(fp32_modules=["2"])], ids=["float8", "fp32"]
)
def test_float8_and_layers_kept_fp32_step_as_with_fp32_masters(options):
    """float8= and fp32_modules= with compact masters: a step as with FP32 masters, to what the
    correction keeps; a layer kept FP32 has no master, its own weight stepped."""
    results = []
    for form in ({}, dict(master_weights="compact")):
        model = make_model(inputs=16, hidden=32, outputs=16)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
        model, optimizer = amp.initialize(
            model, optimizer, opt_level="O2", dtype=torch.bfloat16, verbosity=0, **form, **options
        )
        with amp.trace() as trace:
            train(model, optimizer, range(1))
        results.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        stepped = optimizer.param_groups[0]["params"]
        kept = model[2].weight.dtype is torch.float32 and any(p is model[2].weight for p in stepped)
        amp.deinitialize()
    if "float8" in options:
        assert torch.float8_e4m3fn in {record.ran_in for record in trace.records}
    else:
        assert kept
    for name, theirs in results[0].items():
        bound = (theirs.abs() + 0.01) * 2**-7 / 128  # as in the test above
        assert ((results[1][name] - theirs).abs() <= bound).all(), name


@pytest.mark.parametrize("form", FORMS, ids=IDS)
def test_a_skipped_step_changes_no_bit(form):
    model, optimizer = setup(form)
    train(model, optimizer, range(3))
    before = values(model, optimizer)
    train(model, optimizer, [3], inside=lambda step, m: inject(m[0].weight))
    after = values(model, optimizer)
    assert_equal(before[:3], after[:3])
    assert after[3]["loss_scaler0"]["loss_scale"] == before[3]["loss_scaler0"]["loss_scale"] / 2


@pytest.mark.parametrize("form", FORMS, ids=IDS)
def test_a_skipped_first_step_makes_no_state_and_the_next_starts_as_a_first_one(form):
    """SGD's momentum starts as the gradient at a taken first step (with dampening, a made
    buffer would start damped): a skipped first step leaves no state, as with FP32 masters."""
    options = dict(lr=0.1, momentum=0.9, dampening=0.5)
    runs = []
    for this in (form, {}):
        model, optimizer = setup(this, torch.optim.SGD, **options)
        before = copy.deepcopy(optimizer.state_dict())
        train(model, optimizer, [0], inside=lambda step, m: inject(m[0].weight))
        assert_equal(before, optimizer.state_dict())
        train(model, optimizer, [1])
        amp.deinitialize()
        runs.append([optimizer.state[p]["momentum_buffer"] for p in model.parameters()])
    for compact, exact in zip(*runs, strict=True):
        torch.testing.assert_close(compact, exact, atol=0.02 * exact.abs().max(), rtol=0)


def _saved(model, optimizer):
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, buffer)
    buffer.seek(0)
    return buffer


@pytest.mark.parametrize("form", FORMS, ids=IDS)
def test_a_resume_is_bit_for_bit(form):
    model, optimizer = setup(form)
    train(model, optimizer, range(5))
    uninterrupted = values(model, optimizer)
    amp.deinitialize()
    model, optimizer = setup(form)
    train(model, optimizer, range(2))
    checkpoint, scale = _saved(model, optimizer), amp.state_dict()
    amp.deinitialize()
    model, optimizer = setup(form)
    loaded = torch.load(checkpoint, weights_only=True)  # plain tensors: compact on disk
    model.load_state_dict(loaded["model"])
    optimizer.load_state_dict(loaded["optimizer"])
    amp.load_state_dict(scale)
    train(model, optimizer, range(2, 5))
    assert_equal(values(model, optimizer), uninterrupted)


@pytest.mark.parametrize("form", EVERY_FORM, ids=EVERY_ID)
def test_a_checkpoint_loaded_into_the_optimizer_before_initialize_resumes_as_one_loaded_after(
    form,
):
    """torch's load casts the floating state to the parameters' dtype (bf16 moments, codes'
    scales): initialize takes the entries in any form and dtype into this run's form (a compact
    checkpoint's codes were stepped as if they were the moments before)."""
    model, optimizer = setup(form)
    train(model, optimizer, range(2))
    checkpoint, scale = _saved(model, optimizer), amp.state_dict()
    amp.deinitialize()
    runs = []
    for before in (False, True):
        model, optimizer = plain()
        checkpoint.seek(0)
        loaded = torch.load(checkpoint, weights_only=True)
        model.load_state_dict(loaded["model"])
        if before:
            optimizer.load_state_dict(loaded["optimizer"])
        model, optimizer = initialize(model, optimizer, form)
        if not before:
            optimizer.load_state_dict(loaded["optimizer"])
        amp.load_state_dict(scale)
        train(model, optimizer, range(2, 4))
        runs.append(values(model, optimizer))
        amp.deinitialize()
    assert_equal(runs[1], runs[0])


def _torch_state_and_a_plain_step(model, optimizer):
    assert all(p.dtype is torch.float32 for p in model.parameters())
    for param in model.parameters():
        state = optimizer.state.get(param)
        if state:
            assert set(state) == {"step", "exp_avg", "exp_avg_sq"}, set(state)
            assert all(v.dtype is torch.float32 for v in state.values())
    loss_of(model, 9, inputs=16, outputs=16).backward()
    optimizer.step()  # torch's own step from that state


@pytest.mark.parametrize("form", EVERY_FORM, ids=EVERY_ID)
@pytest.mark.parametrize("after", ["load", "resume", "add_param_group"])
def test_deinitialize_after_a_load_a_resume_or_a_new_group_hands_back_torchs_state(form, after):
    """amp's keys (masters' rests, codes, bf16 moments) never outlive it (torch's next step
    raised KeyError: 'exp_avg' after a load or a group added under compact state)."""
    model, optimizer = plain()
    if after == "add_param_group":  # the last layer frozen at initialize, thawed later
        last = list(model[-1].parameters())
        optimizer = torch.optim.AdamW(list(model.parameters())[: -len(last)], lr=0.01)
    model, optimizer = initialize(model, optimizer, form)
    train(model, optimizer, range(2))
    if after == "load":
        optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    elif after == "resume":
        checkpoint = _saved(model, optimizer)
        amp.deinitialize()
        model, optimizer = setup(form)
        loaded = torch.load(checkpoint, weights_only=True)
        model.load_state_dict(loaded["model"])
        optimizer.load_state_dict(loaded["optimizer"])
    else:
        optimizer.add_param_group({"params": last})
    train(model, optimizer, range(2, 3))
    amp.deinitialize()
    _torch_state_and_a_plain_step(model, optimizer)


@pytest.mark.parametrize("form", FORMS[:2], ids=IDS[:2])
def test_checkpoints_of_fp32_masters_and_of_compact_state_load_into_each_other(form):
    exact = setup({})
    train(*exact, range(3))
    fp32_checkpoint = _saved(*exact)
    amp.deinitialize()
    model, optimizer = setup(form)
    loaded = torch.load(fp32_checkpoint, weights_only=True)
    model.load_state_dict(loaded["model"])
    optimizer.load_state_dict(loaded["optimizer"])
    for ours, theirs in zip(model.state_dict().values(), loaded["model"].values()):
        if ours.is_floating_point():
            assert (ours - theirs).abs().max() <= theirs.abs().max() * 2**-15
    state = optimizer.state_dict()["state"][0]
    assert "exp_avg" in state or "exp_avg_codes" in state  # in this run's form
    train(model, optimizer, range(3, 4))
    compact_checkpoint = _saved(model, optimizer)
    compact_values = [v.clone() for v in model.state_dict().values()]
    amp.deinitialize()
    model, optimizer = setup({})
    loaded = torch.load(compact_checkpoint, weights_only=True)
    model.load_state_dict(loaded["model"])
    optimizer.load_state_dict(loaded["optimizer"])
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), compact_values))
    expected = {"step", "exp_avg", "exp_avg_sq", "master_remainder"}  # exact masters' form
    assert set(optimizer.state_dict()["state"][0]) == expected
    train(model, optimizer, range(4, 5))


@pytest.mark.parametrize("form", FORMS, ids=IDS)
def test_deinitialize_hands_back_the_fp32_values_and_torchs_state(form):
    model, optimizer = setup(form)
    train(model, optimizer, range(3))
    fp32 = {k: v.clone() for k, v in model.state_dict().items()}
    amp.deinitialize()
    assert all(p.dtype is torch.float32 for p in model.parameters())
    assert all(torch.equal(v, fp32[k]) for k, v in model.state_dict().items())
    state = optimizer.state[model[0].weight]
    assert set(state) == {"step", "exp_avg", "exp_avg_sq"}
    assert state["exp_avg"].dtype is torch.float32
    loss_of(model, 9, inputs=16, outputs=16).backward()
    optimizer.step()  # a plain torch step from that state


@pytest.mark.parametrize("form", [{}, FORMS[0]], ids=["exact", "compact"])
def test_deinitialize_hands_back_each_parameters_layout(form):
    """A channels_last convolution and a transposed weight keep their strides (compact values
    are decoded contiguous)."""
    conv = torch.nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
    linear = torch.nn.Linear(6, 5, bias=False)
    linear.weight = torch.nn.Parameter(torch.randn(6, 5).t())
    model = torch.nn.ModuleDict({"conv": conv, "linear": linear})
    strides = [p.stride() for p in model.parameters()]
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    amp.initialize(model, optimizer, opt_level="O2", dtype=torch.bfloat16, verbosity=0, **form)
    amp.deinitialize()
    assert [p.stride() for p in model.parameters()] == strides
    assert all(p.dtype is torch.float32 for p in model.parameters())


def test_clipping_through_master_params_clips_the_fp32_gradients_the_step_uses():
    model, optimizer = setup(dict(master_weights="compact", optimizer_state="int8"))
    train(model, optimizer, range(2))
    with amp.scale_loss(loss_of(model, 2, inputs=16, outputs=16), optimizer) as scaled:
        scaled.backward()
    masters = list(amp.master_params(optimizer))
    norm = torch.nn.utils.clip_grad_norm_(masters, 1e-3)
    assert norm > 1e-3 and all(m.grad is None or m.grad.dtype is torch.float32 for m in masters)
    clipped = torch.linalg.vector_norm(
        torch.stack([m.grad.norm() for m in masters if m.grad is not None])
    )
    assert clipped == pytest.approx(1e-3, rel=1e-3)
    optimizer.step()


@pytest.mark.parametrize(
    "form, cls, options, match",
    [
        (dict(master_weights="compact", dtype=torch.float16), torch.optim.AdamW, {}, "bfloat16"),
        (dict(master_weights="compact"), torch.optim.RMSprop, {}, "RMSprop"),
        (dict(optimizer_state="int8"), torch.optim.AdamW, dict(amsgrad=True), "amsgrad"),
        (dict(optimizer_state="int8", opt_level="O1"), torch.optim.AdamW, {}, "no master"),
        (dict(optimizer_state="int4"), torch.optim.AdamW, {}, "'int8'"),
    ],
    ids=["fp16", "rmsprop", "amsgrad", "o1", "int4"],
)
def test_what_compact_state_cannot_do_is_refused_and_nothing_changes(form, cls, options, match):
    model = make_model()
    weights = copy.deepcopy(model.state_dict())
    optimizer = cls(model.parameters(), lr=0.01, **options)
    kwargs = dict(dict(opt_level="O2", dtype=torch.bfloat16, verbosity=0), **form)
    with pytest.raises(ValueError, match=match):
        amp.initialize(model, optimizer, **kwargs)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in weights.items())
    assert "_amp_record" not in vars(optimizer)
    amp.deinitialize()


def test_compact_state_has_no_general_path_and_a_refused_step_changes_nothing():
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with general_path(), pytest.raises(ValueError, match="AMP_FUSED_STEP=0"):
        amp.initialize(
            model, optimizer, opt_level="O2", dtype=torch.bfloat16, master_weights="compact"
        )
    model, optimizer = setup(dict(master_weights="compact"), torch.optim.SGD, lr=0.1)
    optimizer.param_groups[0]["lr"] = torch.tensor(0.1)  # a scheduler's tensor learning rate
    with amp.scale_loss(loss_of(model, 0, inputs=16, outputs=16), optimizer) as scaled:
        scaled.backward()
    before = copy.deepcopy(optimizer.state_dict())
    with pytest.raises(RuntimeError, match="lr is a Tensor, not a number.*Nothing was changed"):
        optimizer.step()
    assert_equal(optimizer.state_dict(), before)


@pytest.mark.parametrize("form", FORMS[1:2], ids=IDS[1:2])
def test_sgd_with_momentum_and_layers_kept_fp32(form):
    model = make_model(inputs=16, hidden=32, outputs=16, batch_norm=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, dampening=0.1)
    model, optimizer = amp.initialize(
        model,
        optimizer,
        opt_level="O2",
        dtype=torch.bfloat16,
        verbosity=0,
        fp32_modules=[torch.nn.ReLU],
        **form,
    )
    train(model, optimizer, range(3))
    assert optimizer.state[model[3].weight]["momentum_buffer_codes"].dtype is torch.int8
    assert optimizer.state[model[0].weight]["momentum_buffer"].dtype is torch.float32
    assert model[1].weight.dtype is torch.float32  # batch norm

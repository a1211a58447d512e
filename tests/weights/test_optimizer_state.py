"""O2 checkpoints of the optimizer (amp/weights/optimizer_state.py): optimizer.state_dict() carries
each master's rest in its parameter's entry (`master`, `master_remainder`, `master_correction`;
older amp's top-level `amp_master_params` loads too), loads into plain FP32 training, and a load
it refuses changes nothing. Resuming from a checkpoint bit for bit: tests/programs/test_resume.py."""

import copy

import pytest
import torch

import amp
from amp import kernels
from helpers.models import loss_of, make_model
from helpers.o2 import optimizer_params, saved, setup, train_step
from helpers.o2 import static_o2
from helpers.o2 import general_path
from helpers.state import (
    assert_equal_states,
    assert_same,
    everything,
    saved_masters,
    snapshot,
    step_cleanly,
)


def test_optimizer_state_dict_carries_masters_and_malformed_ones_change_nothing():
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
    try:
        with amp.scale_loss(loss_of(model, 0), optimizer) as scaled:
            scaled.backward()
        optimizer.step()
        saved = copy.deepcopy(optimizer.state_dict())
        assert set(saved_masters(saved)) == {0, 1, 2, 3}
        assert all(entry["master"].dtype is torch.float32 for entry in saved["state"].values())
        before = snapshot(model, optimizer)
        bad = copy.deepcopy(saved)
        bad["state"][1]["master"] = torch.zeros(3)
        with pytest.raises(ValueError, match=r"master weight \(master\) of parameter 1 has shape"):
            optimizer.load_state_dict(bad)
        bad = copy.deepcopy(saved)
        bad["state"][9] = {"master": torch.zeros(8, 4)}
        with pytest.raises(ValueError, match="state for parameter 9"):
            optimizer.load_state_dict(bad)
        bad = dict(copy.deepcopy(saved), amp_master_params={1: torch.zeros(3)})  # older amp's
        with pytest.raises(ValueError, match=r"master weight \(master\) of parameter 1 has shape"):
            optimizer.load_state_dict(bad)
        assert_equal_states(before, snapshot(model, optimizer))
        with amp.scale_loss(loss_of(model, 1), optimizer) as scaled:
            scaled.backward()
        optimizer.step()
        optimizer.load_state_dict(saved)
        assert_equal_states(before, snapshot(model, optimizer))
    finally:
        amp.deinitialize()


def test_o2_checkpoint_loads_into_plain_fp32_training():
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
    try:
        with amp.scale_loss(loss_of(model, 0), optimizer) as scaled:
            scaled.backward()
        optimizer.step()
        model_state, optimizer_state = copy.deepcopy((model.state_dict(), optimizer.state_dict()))
        masters = [m.detach().clone() for m in amp.master_params(optimizer)]
    finally:
        amp.deinitialize()
    plain = make_model(5)
    plain_optimizer = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    plain.load_state_dict(model_state)
    plain_optimizer.load_state_dict(optimizer_state)
    for param, master in zip(plain.parameters(), masters):
        assert torch.equal(param, master)


def test_an_o2_checkpoint_with_missing_masters_is_refused_and_changes_nothing(trained):
    model, optimizer = trained("O2")
    step_cleanly(model, optimizer)
    saved = copy.deepcopy(optimizer.state_dict())
    step_cleanly(model, optimizer, 1)
    before = everything(model, optimizer)
    fewer = copy.deepcopy(saved)
    for index in (1, 2, 3):
        del fewer["state"][index]["master"]
    with pytest.raises(ValueError, match=r"lacks those of \[1, 2, 3\]"):
        optimizer.load_state_dict(fewer)
    with pytest.raises(TypeError, match="Drop the key"):
        optimizer.load_state_dict(dict(saved, amp_master_params=None))
    assert_same(before, everything(model, optimizer))
    optimizer.load_state_dict(saved)  # the whole checkpoint loads
    for master, value in zip(amp.master_params(optimizer), saved_masters(saved).values()):
        assert torch.equal(master, value)


class _Uncopyable(torch.Tensor):
    """A master weight that passes every check and still cannot be copied from."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.copy_:
            raise RuntimeError("this tensor cannot be copied")
        return super().__torch_function__(func, types, args, kwargs or {})


def _o2_adam_two_steps(general=False):
    with general_path(general):
        model, optimizer = static_o2(torch.optim.Adam)

    def step():
        with amp.scale_loss(model(torch.randn(2, 4)).float().sum(), optimizer) as scaled:
            scaled.backward()
        optimizer.step()
        optimizer.zero_grad()

    step()
    saved = copy.deepcopy(optimizer.state_dict())
    step()
    return model, optimizer, saved


@pytest.mark.parametrize("bad", ["meta", "sparse", "uncopyable"])
def test_a_load_with_an_unusable_master_changes_nothing(bad):
    """Refused before anything changes, or (a master no check can tell, on the general path,
    which copies it into its FP32 master) put back as it was."""
    model, optimizer, saved = _o2_adam_two_steps(general=bad == "uncopyable")
    value = saved["state"][0]["master"]
    if bad == "meta":
        saved["state"][0]["master"] = value.to("meta")
    elif bad == "sparse":
        saved["state"][0]["master"] = value.to_sparse()
    else:
        saved["state"][0]["master"] = value.as_subclass(_Uncopyable)
    state = {param: {k: v.clone() for k, v in s.items()} for param, s in optimizer.state.items()}
    params = [p.detach().clone() for p in amp.master_params(optimizer)]
    with pytest.raises((ValueError, RuntimeError), match="meta|sparse|cannot be copied"):
        optimizer.load_state_dict(saved)
    assert all(float(s["step"]) == 2 for s in optimizer.state.values())
    for param, entries in state.items():
        assert all(torch.equal(optimizer.state[param][k], v) for k, v in entries.items())
    assert all(torch.equal(p, q) for p, q in zip(amp.master_params(optimizer), params))
    amp.deinitialize()


@pytest.mark.usefixtures("deinitialized")
@pytest.mark.parametrize("skipped", [False, True], ids=["after-a-step", "after-a-skipped-step"])
def test_an_optimizer_checkpoint_saved_first_holds_a_write_into_the_model(skipped):
    """A write into the model after a step (a mask, a broadcast) is the masters' value from then
    on. An optimizer checkpoint serialized before the model's state dict is looked at must hold
    it, or the resumed run steps from masters without it (not bit-exact with the run that went
    on). A skipped step between the write and the save must not lose it either."""
    model, optimizer = setup()
    train_step(model, optimizer)
    with torch.no_grad():
        model[0].weight.mul_(0.5)
    if skipped:
        train_step(model, optimizer, seed=2, scale=1e30)  # FP16 gradients overflow
        assert amp.last_overflow() is not None
    optimizer_file = saved(optimizer.state_dict())
    model_file = saved(model.state_dict())
    amp_state_dict = amp.state_dict()
    train_step(model, optimizer, seed=3)
    went_on = optimizer_params(optimizer)
    amp.deinitialize()

    model, optimizer = setup()
    model.load_state_dict(torch.load(model_file))
    optimizer.load_state_dict(torch.load(optimizer_file))
    amp.load_state_dict(amp_state_dict)
    train_step(model, optimizer, seed=3)
    for resumed, expected in zip(optimizer_params(optimizer), went_on):
        assert torch.equal(resumed, expected)


@pytest.mark.usefixtures("deinitialized")
def test_torch_optimizers_carry_the_masters_through_torchs_state_dict_hooks():
    """A torch optimizer keeps its own state_dict and load_state_dict methods: torch's state-dict
    hooks add and take the masters, so every caller of Optimizer.state_dict sees them, and
    deinitialize leaves no hook behind."""
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    hooks = (
        optimizer._optimizer_state_dict_post_hooks,
        optimizer._optimizer_load_state_dict_pre_hooks,
        optimizer._optimizer_load_state_dict_post_hooks,
    )
    amp.initialize(model, optimizer, opt_level="O2", dtype=torch.bfloat16, verbosity=0)
    assert "state_dict" not in vars(optimizer) and "load_state_dict" not in vars(optimizer)
    step_cleanly(model, optimizer)
    state = torch.optim.Optimizer.state_dict(optimizer)  # the class's method, unbound
    assert set(saved_masters(state)) == {0, 1, 2, 3}
    changed = copy.deepcopy(state)
    changed["state"][0]["master_remainder"].zero_()  # the weight alone: its value
    torch.optim.Optimizer.load_state_dict(optimizer, changed)
    assert torch.equal(optimizer_params(optimizer)[0], model[0].weight.float())
    assert "master_remainder" not in optimizer.state[model[0].weight]  # amp holds the rests
    assert optimizer.state_dict()["state"][0]["master_remainder"].dtype is torch.int16
    assert optimizer.state[model[0].weight]["exp_avg"].dtype is torch.float32  # not bf16
    amp.deinitialize()
    assert all(len(registered) == 0 for registered in hooks)
    assert not saved_masters(optimizer.state_dict())


@pytest.mark.usefixtures("deinitialized")
def test_an_optimizer_whose_class_saves_its_own_way_carries_the_masters_too():
    """A class with its own state_dict (ZeroRedundancyOptimizer's runs no torch hook) or a wrapper
    (apex's LARC) gets amp's replacements of the two methods instead."""

    class OwnStateDict(torch.optim.SGD):
        def state_dict(self):
            return {**super().state_dict(), "mine": True}

    model = make_model()
    optimizer = OwnStateDict(model.parameters(), lr=0.1)
    amp.initialize(model, optimizer, opt_level="O2", dtype=torch.bfloat16, verbosity=0)
    assert "state_dict" in vars(optimizer)
    step_cleanly(model, optimizer)
    state = optimizer.state_dict()
    assert state["mine"] and set(saved_masters(state)) == {0, 1, 2, 3}


def _moments_of_width(hidden, cls):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 4)
    )
    optimizer = cls(
        model.parameters(), lr=0.01, **({"momentum": 0.9} if cls is torch.optim.SGD else {})
    )
    model(torch.randn(4, 8)).square().mean().backward()
    optimizer.step()
    return copy.deepcopy(optimizer.state_dict())


@pytest.mark.usefixtures("deinitialized")
@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.SGD], ids=["adamw", "sgd"])
@pytest.mark.parametrize("wider", [True, False], ids=["larger-moments", "smaller-moments"])
@pytest.mark.parametrize(
    "form",
    [
        dict(),
        dict(master_weights="compact"),
        dict(master_weights="compact", optimizer_state="int8"),
    ],
    ids=["exact", "compact", "compact-int8"],
)
def test_moments_of_another_size_than_their_parameters_are_refused_changing_nothing(
    form, wider, cls
):
    """A plain torch checkpoint of a model of another width: torch's fused ops, which amp's step
    calls, would step a prefix of each moment or read past its end."""
    checkpoint = _moments_of_width(48 if wider else 40, cls)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 44), torch.nn.ReLU(), torch.nn.Linear(44, 4))
    optimizer = cls(
        model.parameters(), lr=0.01, **({"momentum": 0.9} if cls is torch.optim.SGD else {})
    )
    model, optimizer = amp.initialize(
        model, optimizer, opt_level="O2", dtype=torch.bfloat16, verbosity=0, **form
    )
    with amp.scale_loss(model(torch.randn(4, 8)).float().square().mean(), optimizer) as scaled:
        scaled.backward()
    optimizer.step()
    before = copy.deepcopy(optimizer.state_dict())
    with pytest.raises(ValueError, match="and the parameter shape .* another model"):
        optimizer.load_state_dict(checkpoint)
    torch.testing.assert_close(optimizer.state_dict(), before, rtol=0, atol=0, equal_nan=True)


def _initialized_and_stepped(form):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 44), torch.nn.ReLU(), torch.nn.Linear(44, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    model, optimizer = amp.initialize(
        model, optimizer, opt_level="O2", dtype=torch.bfloat16, verbosity=0, **form
    )
    with amp.scale_loss(model(torch.randn(4, 32)).float().square().mean(), optimizer) as scaled:
        scaled.backward()
    optimizer.step()
    return optimizer


@pytest.mark.usefixtures("deinitialized")
@pytest.mark.parametrize(
    "form, key, change",
    [
        (dict(), "exp_avg", lambda t: t.t().contiguous()),
        (dict(master_weights="compact", optimizer_state="int8"), "exp_avg_scales", lambda t: t[:1]),
        (
            dict(master_weights="compact", optimizer_state="int8"),
            "exp_avg_sq_scales",
            lambda t: torch.cat([t, t]),
        ),
    ],
    ids=["transposed-moment", "truncated-scales", "doubled-scales"],
)
def test_a_moment_of_another_shape_or_other_block_scales_is_refused_changing_nothing(
    form, key, change
):
    optimizer = _initialized_and_stepped(form)
    before = copy.deepcopy(optimizer.state_dict())
    broken = copy.deepcopy(before)
    broken["state"][0][key] = change(broken["state"][0][key])
    with pytest.raises(ValueError, match="and the parameter shape .* another model"):
        optimizer.load_state_dict(broken)
    torch.testing.assert_close(optimizer.state_dict(), before, rtol=0, atol=0, equal_nan=True)
    optimizer.load_state_dict(before)  # its own checkpoint loads


@pytest.mark.usefixtures("deinitialized")
def test_an_older_int8_checkpoint_loads_exactly_codes_of_any_tensor_flat_scales():
    """amp once held 8-bit codes for every tensor, their scales flat: a bias's codes (now FP32
    moments: its rows are no blocks of 32) load as their decoded values, bit for bit, and a
    weight's flat scales as the same values laid out by rows."""
    optimizer = _initialized_and_stepped(dict(master_weights="compact", optimizer_state="int8"))
    weight, bias = optimizer.param_groups[0]["params"][:2]
    now = optimizer.state_dict()
    older = copy.deepcopy(now)
    expected = {}
    for moment, signed in (("exp_avg", True), ("exp_avg_sq", False)):
        codes, scales = kernels.moment_encode(older["state"][1].pop(moment), signed)
        older["state"][1].update({f"{moment}_codes": codes, f"{moment}_scales": scales})
        expected[moment] = kernels.moment_decode(codes, scales)
        older["state"][0][f"{moment}_scales"] = older["state"][0][f"{moment}_scales"].view(-1)
    optimizer.load_state_dict(older)
    entry = optimizer.state[bias]
    assert set(entry) == {"exp_avg", "exp_avg_sq", "step"}
    for moment, values in expected.items():
        assert entry[moment].dtype is torch.float32
        assert torch.equal(entry[moment].view(torch.int32), values.view(torch.int32)), moment
        scales = optimizer.state[weight][f"{moment}_scales"]
        assert scales.shape == (44, 1)
        assert torch.equal(scales, now["state"][0][f"{moment}_scales"])


# -- torch's distributed checkpoint ----------------------------------------------------------------

DCP_FORMS = {"exact": {}, "compact-int8": dict(master_weights="compact", optimizer_state="int8")}


def _dcp_run(form):
    model = make_model(inputs=16, hidden=32, outputs=16, batch_norm=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    return amp.initialize(
        model, optimizer, opt_level="O2", dtype=torch.bfloat16, verbosity=0, **DCP_FORMS[form]
    )


def _dcp_steps(model, optimizer, steps):
    for step in steps:
        optimizer.zero_grad()
        with amp.scale_loss(loss_of(model, step, inputs=16, outputs=16), optimizer) as scaled:
            scaled.backward()
        optimizer.step()
    weights = [p.detach().clone() for p in model.parameters()]
    state = [
        (key, value.clone())
        for param in model.parameters()
        for key, value in sorted(optimizer.state[param].items())
    ]
    rests = vars(optimizer)["_amp_record"].owner.rests()
    return weights, state + [("rest", rest.clone()) for rest in rests]


@pytest.mark.usefixtures("deinitialized")
@pytest.mark.parametrize("form", list(DCP_FORMS))
def test_torchs_distributed_checkpoint_saves_and_loads_o2_bit_for_bit(form, tmp_path):
    """get_state_dict / set_state_dict (torchtitan's, Lightning's and Accelerate's way) and
    torch.distributed.checkpoint.save / load, with amp.state_dict() beside them: the model's FP32
    values under the model's names, each parameter's state (its master's rest, its moments in
    their form) under its name; resumed, the run is the uninterrupted one bit for bit."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, optimizer = _dcp_run(form)
    _dcp_steps(model, optimizer, range(2))
    model_state, optimizer_state = get_state_dict(model, optimizer)
    assert all(v.dtype is torch.float32 for v in model_state.values() if v.is_floating_point())
    rest = "master_remainder" if form == "exact" else "master_correction"
    assert rest in optimizer_state["state"]["0.weight"]
    with pytest.warns(UserWarning, match="single process"):  # no process group: torch says so
        dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=tmp_path)
    scale = amp.state_dict()
    uninterrupted = _dcp_steps(model, optimizer, range(2, 4))
    amp.deinitialize()

    model, optimizer = _dcp_run(form)
    model_state, optimizer_state = get_state_dict(model, optimizer)  # the shapes to load into
    loaded = {"model": model_state, "optimizer": optimizer_state}
    with pytest.warns(UserWarning, match="single process"):
        dcp.load(loaded, checkpoint_id=tmp_path)
    set_state_dict(
        model, optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optimizer"]
    )
    amp.load_state_dict(scale)
    resumed = _dcp_steps(model, optimizer, range(2, 4))
    for (a, b) in zip(resumed[0], uninterrupted[0], strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    for (key_a, a), (key_b, b) in zip(resumed[1], uninterrupted[1], strict=True):
        assert key_a == key_b and a.dtype == b.dtype and torch.equal(a, b), key_a


@pytest.mark.usefixtures("deinitialized", "one_rank_group")
@pytest.mark.parametrize("source, target", [("exact", "compact-int8"), ("compact-int8", "exact")])
def test_a_full_state_dict_of_another_form_loads_its_moments(source, target):
    """torch's full state dicts (StateDictOptions(full_state_dict=True)) are merged over the
    state a step of the target run made first: an entry then holds the target form's zero
    moments beside the checkpoint's in another form, and the checkpoint's are the values."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_state_dict,
        set_state_dict,
    )

    full = StateDictOptions(full_state_dict=True)
    model, optimizer = _dcp_run(source)
    _dcp_steps(model, optimizer, range(2))
    model_state, optimizer_state = get_state_dict(model, optimizer, options=full)  # amp's form
    optimizer_state = copy.deepcopy(optimizer_state)
    amp.deinitialize()
    _, plain = get_state_dict(model, optimizer, options=full)  # torch's, FP32
    want = {name: entry["exp_avg"] for name, entry in plain["state"].items()}

    model, optimizer = _dcp_run(target)
    set_state_dict(
        model, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state,
        options=full,
    )
    amp.deinitialize()
    _, loaded = get_state_dict(model, optimizer, options=full)
    for name, moment in want.items():
        got = loaded["state"][name]["exp_avg"]
        assert got.abs().sum() > 0, name
        # 8-bit codes hold a moment within a code's width of its FP32 value
        assert torch.allclose(got, moment, rtol=0.05, atol=1e-3 * moment.abs().max()), name

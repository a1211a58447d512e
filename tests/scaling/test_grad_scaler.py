"""amp.GradScaler (amp/scaling/grad_scaler.py) against torch.amp.GradScaler: same traces, same
errors, the same getters, setters and state dict, and it works on CPU."""

import inspect
import pickle

import pytest
import torch
from torch.testing._internal.common_cuda import _create_scaling_case

import amp
from helpers.o2 import linear_o2
from helpers import DEVICES

SCALER_ARGS = dict(init_scale=128.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=1)


def torch_scaler(device, **kwargs):
    return torch.amp.GradScaler(device, **{**SCALER_ARGS, **kwargs})


def amp_scaler(device, **kwargs):
    return amp.GradScaler(**{**SCALER_ARGS, **kwargs})


def inject_at_skip(scaler, model, step, skip_iter):
    if step == skip_iter and scaler.is_enabled():
        model[1].weight.grad.fill_(float("inf"))


def scenario_plain(
    scaler, device, optimizer_ctor=torch.optim.SGD, kwargs=None, dtype=torch.float32
):
    torch.manual_seed(0)
    _, model, _, optimizer, data, loss_fn, skip_iter = _create_scaling_case(
        device=device, optimizer_ctor=optimizer_ctor, optimizer_kwargs=kwargs
    )
    model.to(dtype)
    trace = []
    for step, (x, y) in enumerate(data):
        optimizer.zero_grad()
        loss = loss_fn(model(x.to(dtype)), y.to(dtype))
        scaler.scale(loss).backward()
        inject_at_skip(scaler, model, step, skip_iter)
        trace.append(scaler.step(optimizer))
        scaler.update()
        trace.append((scaler.get_scale(), scaler._get_growth_tracker()))
    return trace, model, optimizer


def scenario_clipping(scaler, device):
    torch.manual_seed(0)
    _, model, _, optimizer, data, loss_fn, skip_iter = _create_scaling_case(device=device)
    trace = []
    for step, (x, y) in enumerate(data):
        optimizer.zero_grad()
        scaler.scale(loss_fn(model(x), y)).backward()
        inject_at_skip(scaler, model, step, skip_iter)
        scaler.unscale_(optimizer)
        trace.append(
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.2, error_if_nonfinite=False)
        )
        scaler.step(optimizer)
        scaler.update()
        trace.append(scaler.get_scale())
    return trace, model, optimizer


def scenario_clipping_scaled(scaler, device):
    torch.manual_seed(0)
    _, model, _, optimizer, data, loss_fn, skip_iter = _create_scaling_case(device=device)
    trace = []
    for step, (x, y) in enumerate(data):
        optimizer.zero_grad()
        scaler.scale(loss_fn(model(x), y)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.2 * scaler.get_scale())
        inject_at_skip(scaler, model, step, skip_iter)
        scaler.step(optimizer)
        scaler.update()
        trace.append(scaler.get_scale())
    return trace, model, optimizer


def scenario_accumulation(scaler, device):
    torch.manual_seed(0)
    _, model, _, optimizer, data, loss_fn, _ = _create_scaling_case(device=device)
    trace = []
    for _ in range(2):
        optimizer.zero_grad()
        for x, y in data:
            scaler.scale(loss_fn(model(x), y) / len(data)).backward()
        scaler.step(optimizer)
        scaler.update()
        trace.append(scaler.get_scale())
    return trace, model, optimizer


def scenario_multiple(scaler, device):
    torch.manual_seed(0)
    _, model0, _, optimizer0, data, loss_fn, skip_iter = _create_scaling_case(device=device)
    _, model1, _, optimizer1 = _create_scaling_case(device=device)[:4]
    trace = []
    for step, (x, y) in enumerate(data):
        optimizer0.zero_grad()
        optimizer1.zero_grad()
        out0, out1 = model0(x), model1(x)
        loss0 = loss_fn(0.3 * out0 + 0.7 * out1, y)
        loss1 = loss_fn(0.6 * out0 - 0.4 * out1, y)
        scaler.scale(loss0).backward(retain_graph=True)
        scaler.scale(loss1).backward()
        inject_at_skip(scaler, model1, step, skip_iter)
        scaler.unscale_(optimizer0)  # one optimizer unscaled explicitly, as torch's test does
        trace.append(scaler.step(optimizer0))
        trace.append(scaler.step(optimizer1))
        scaler.update()
        trace.append(scaler.get_scale())
    return trace, torch.nn.ModuleList([model0, model1]), [optimizer0, optimizer1]


def scenario_penalty(scaler, device):
    torch.manual_seed(0)
    _, model, _, optimizer, data, loss_fn, skip_iter = _create_scaling_case(device=device)
    trace = []
    for step, (x, y) in enumerate(data):
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        grads = torch.autograd.grad(scaler.scale(loss), model.parameters(), create_graph=True)
        inv = 1.0 / scaler.get_scale()
        penalty = sum((g * inv).pow(2).sum() for g in grads).sqrt()
        scaler.scale(loss + penalty).backward()
        inject_at_skip(scaler, model, step, skip_iter)
        scaler.step(optimizer)
        scaler.update()
        trace.append(scaler.get_scale())
    return trace, model, optimizer


def scenario_sparse(scaler, device):
    torch.manual_seed(0)
    embedding = torch.nn.Embedding(10, 4, sparse=True).to(device)
    optimizer = torch.optim.SGD(embedding.parameters(), lr=0.5)
    trace = []
    for step in range(3):
        optimizer.zero_grad()
        loss = embedding(torch.tensor([[1, 2, 2], [7, 1, 0]], device=device)).square().sum()
        scaler.scale(loss).backward()
        if step == 1:
            embedding.weight.grad._values()[0, 0] = float("nan")
        trace.append(scaler.step(optimizer))
        scaler.update()
        trace.append(scaler.get_scale())
    return trace, embedding, optimizer


def scenario_autocast_fp16(scaler, device):
    torch.manual_seed(0)
    _, model, _, optimizer, data, loss_fn, skip_iter = _create_scaling_case(device=device)
    trace = []
    for step, (x, y) in enumerate(data):
        optimizer.zero_grad()
        with torch.autocast(device, dtype=torch.float16):
            loss = loss_fn(model(x), y)
        scaler.scale(loss).backward()
        inject_at_skip(scaler, model, step, skip_iter)
        scaler.step(optimizer)
        scaler.update()
        trace.append(scaler.get_scale())
    return trace, model, optimizer


SCENARIOS = {
    "plain": scenario_plain,
    "plain-adam": lambda s, d: scenario_plain(s, d, torch.optim.Adam),
    "fused-adam": lambda s, d: scenario_plain(s, d, torch.optim.Adam, {"fused": True}),
    "fused-sgd": lambda s, d: scenario_plain(
        s, d, torch.optim.SGD, {"fused": True, "momentum": 0.9}
    ),
    "bfloat16-gradients": lambda s, d: scenario_plain(s, d, dtype=torch.bfloat16),
    "clipping": scenario_clipping,
    "clipping-scaled": scenario_clipping_scaled,
    "accumulation": scenario_accumulation,
    "multiple": scenario_multiple,
    "penalty": scenario_penalty,
    "sparse": scenario_sparse,
    "autocast-fp16": scenario_autocast_fp16,
}


def _assert_identical(a, b):
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.layout == b.layout
        if a.is_sparse:
            a, b = a.coalesce().to_dense(), b.coalesce().to_dense()
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_identical(x, y)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            _assert_identical(a[key], b[key])
    else:
        assert a == b


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", sorted(SCENARIOS))
@pytest.mark.parametrize("enabled", [True, False])
def test_same_trajectory_and_parameters_as_torch(name, device, enabled):
    try:
        theirs = SCENARIOS[name](torch_scaler(device, enabled=enabled), device)
    except NotImplementedError as error:  # torch's CUDA unscale without bfloat16 (torch < 2.13)
        pytest.skip(f"torch {torch.__version__} cannot run this case itself: {error}")
    ours = SCENARIOS[name](amp_scaler(device, enabled=enabled), device)
    trace_theirs, model_theirs, optimizer_theirs = theirs
    trace_ours, model_ours, optimizer_ours = ours
    _assert_identical(trace_ours, trace_theirs)
    _assert_identical(list(model_ours.parameters()), list(model_theirs.parameters()))
    _assert_identical(
        [p.grad for p in model_ours.parameters()], [p.grad for p in model_theirs.parameters()]
    )
    optimizers = optimizer_ours if isinstance(optimizer_ours, list) else [optimizer_ours]
    theirs_list = optimizer_theirs if isinstance(optimizer_theirs, list) else [optimizer_theirs]
    for o, t in zip(optimizers, theirs_list):
        _assert_identical(o.state_dict()["state"], t.state_dict()["state"])


def test_closed_form_scale_of_the_plain_scenario():
    trace, _, _ = scenario_plain(amp_scaler("cpu"), "cpu")
    # 4 iterations, one skipped: 128 * 2**3 * 0.5
    assert trace[-1] == (128.0 * 2**3 * 0.5, 0)


# -- misuse errors: the same type and message as torch's ----------------------------------------------


def _error(scaler_factory, steps):
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = scaler_factory("cpu")
    try:
        for action in steps:
            if action == "scale":
                scaler.scale(model(torch.randn(2, 2)).sum()).backward()
            elif action == "closure":
                scaler.step(optimizer, closure=lambda: None)
            else:
                getattr(scaler, action)(*([optimizer] if action in ("unscale_", "step") else []))
    except Exception as error:  # the behaviour under test
        return error
    return None


@pytest.mark.parametrize(
    "steps",
    [
        ["unscale_"],
        ["step"],
        ["update"],
        ["scale", "unscale_", "unscale_"],
        ["scale", "step", "unscale_"],
        ["scale", "step", "step"],
        ["scale", "closure"],
    ],
)
def test_misuse_errors_match_torch(steps):
    theirs, ours = _error(torch_scaler, steps), _error(amp_scaler, steps)
    assert theirs is not None and ours is not None
    assert isinstance(ours, type(theirs))
    assert str(ours) == str(theirs)


def test_no_inf_checks_recorded():
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for factory in (torch_scaler, amp_scaler):
        scaler = factory("cpu")
        scaler.scale(torch.ones((), requires_grad=True))
        with pytest.raises(AssertionError, match="No inf checks were recorded for this optimizer."):
            scaler.step(optimizer)


def test_fp16_gradients_are_refused_with_advice():
    model = torch.nn.Linear(2, 2).half()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = amp.GradScaler()
    scaler.scale(model(torch.randn(2, 2).half()).float().sum()).backward()
    with pytest.raises(ValueError, match=r"^Attempting to unscale FP16 gradients\..*O2"):
        scaler.step(optimizer)


def test_construction_and_update_arguments():
    with pytest.raises(AssertionError, match="The growth factor must be > 1.0."):
        amp.GradScaler(growth_factor=1.0)
    with pytest.raises(ValueError, match="The backoff factor must be < 1.0."):
        amp.GradScaler(backoff_factor=1.0)
    assert not amp.GradScaler(growth_factor=0.5, enabled=False).is_enabled()
    scaler = amp.GradScaler("cuda", 8.0)  # torch.amp's form; the device comes from the tensors
    assert scaler.get_scale() == 8.0
    out = scaler.scale(torch.ones(2))
    assert out.device.type == "cpu" and out.tolist() == [8.0, 8.0]
    scaler.update(4)  # an int works (torch 2.13 raises AttributeError)
    assert scaler.get_scale() == 4.0
    scaler.update(torch.tensor(2.0))
    assert scaler.get_scale() == 2.0
    with pytest.raises(AssertionError, match="new_scale should be a float or a 1-element"):
        scaler.update(torch.ones(2))
    with pytest.raises(ValueError, match="outputs must be a Tensor or an iterable of Tensors"):
        scaler.scale(3.0)
    with pytest.raises(RuntimeError, match="Invalid device string"):
        amp.GradScaler("not a real device")


def test_default_scaler_works_on_cpu_where_torchs_disables_itself():
    with pytest.warns(UserWarning, match="CUDA is not available"):
        assert not torch.amp.GradScaler().is_enabled()
    assert torch.amp.GradScaler("cpu").is_enabled()  # named: docs/differences-and-limits.md
    scaler = amp.GradScaler()
    assert scaler.is_enabled() and scaler.scale(torch.ones(())).item() == 65536.0


def test_state_dict_round_trip_with_torch_and_pickle():
    ours = amp.GradScaler(init_scale=3.0, growth_factor=4.0, backoff_factor=0.5, growth_interval=2)
    theirs = torch.amp.GradScaler("cpu")
    theirs.load_state_dict(ours.state_dict())
    assert theirs.state_dict() == ours.state_dict()
    ours.scale(torch.ones(()))
    ours._growth_tracker.fill_(7)
    back = amp.GradScaler()
    back.load_state_dict(theirs.state_dict())
    assert back.state_dict() == {
        "scale": 3.0,
        "growth_factor": 4.0,
        "backoff_factor": 0.5,
        "growth_interval": 2,
        "_growth_tracker": 0,
    }
    with pytest.raises(RuntimeError, match="The source state dict is empty"):
        back.load_state_dict({})
    assert amp.GradScaler(enabled=False).state_dict() == {}
    unpickled = pickle.loads(pickle.dumps(ours))
    assert unpickled.get_scale() == 3.0 and unpickled._get_growth_tracker() == 7
    assert unpickled.scale(torch.tensor(4.0)).item() == 12.0
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ours.scale(model(torch.ones(2)).sum()).backward()
    ours.unscale_(optimizer)
    with pytest.raises(
        AssertionError, match="may only be pickled at the beginning of an iteration"
    ):
        pickle.dumps(ours)


def test_disabled_scaler_passes_everything_through():
    scaler = amp.GradScaler(enabled=False)
    loss = torch.ones((), requires_grad=True)
    assert scaler.scale(loss) is loss
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(2)).sum().backward()
    scaler.unscale_(optimizer)
    assert scaler.step(optimizer) is None and scaler.get_scale() == 1.0
    scaler.update()


def test_grad_scaler_on_an_o2_optimizer_says_what_to_use():
    model, optimizer = linear_o2(lr=0.1)
    try:
        scaler = amp.GradScaler()
        scaler.scale(model(torch.randn(3, 4)).float().mean()).backward()
        with pytest.raises(RuntimeError, match="only amp.scale_loss fills"):
            scaler.step(optimizer)
    finally:
        amp.deinitialize()


# -- getters and setters, side by side with torch.amp.GradScaler ------------------------------------

GETTERS = ("get_scale", "get_growth_factor", "get_backoff_factor", "get_growth_interval")


def _both(**kwargs):
    """(amp's, torch's) scaler made with the same arguments."""
    return amp.GradScaler(**kwargs), torch.amp.GradScaler("cpu", **kwargs)


def _answer(scaler, name, *args):
    """What `scaler.name(*args)` gives: ("value", result) or ("raises", exception type)."""
    try:
        return "value", getattr(scaler, name)(*args)
    except Exception as error:  # the behaviour under test
        return "raises", type(error)


def _steps(scaler, count=5, overflow_at=1):
    """`count` steps of a small model, an inf injected at `overflow_at`; after each update, the
    scale, the growth tracker and every getter's answer."""
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trace = []
    for step in range(count):
        optimizer.zero_grad()
        scaler.scale(model(torch.ones(3, 2)).sum()).backward()
        if step == overflow_at:
            model.weight.grad[0, 0] = float("inf")
        scaler.step(optimizer)
        scaler.update()
        trace.append([scaler._get_growth_tracker()] + [getattr(scaler, g)() for g in GETTERS])
    return trace, model


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        SCALER_ARGS,
        dict(init_scale=3.0, growth_factor=4.0, backoff_factor=0.25, growth_interval=7),
    ],
    ids=["defaults", "test-arguments", "others"],
)
def test_getters_answer_as_torchs_before_and_after_steps(kwargs):
    ours, theirs = _both(**kwargs)
    for name in GETTERS + ("is_enabled",):
        assert _answer(ours, name) == _answer(theirs, name), name
        assert type(getattr(ours, name)()) is type(getattr(theirs, name)()), name
    assert ours.get_scale() == kwargs.get("init_scale", 2.0**16)
    (trace_ours, _), (trace_theirs, _) = _steps(ours), _steps(theirs)
    assert trace_ours == trace_theirs


@pytest.mark.parametrize(
    "setter, value",
    [("set_growth_factor", 4.0), ("set_backoff_factor", 0.25), ("set_growth_interval", 1)],
)
@pytest.mark.parametrize("when", ["before the first step", "after two steps"])
def test_setters_change_the_next_update_as_torchs_do(setter, value, when):
    traces = []
    for scaler in _both(init_scale=128.0, growth_interval=2):
        trace, model = _steps(scaler, count=2) if when == "after two steps" else ([], None)
        getattr(scaler, setter)(value)
        assert getattr(scaler, "g" + setter[1:])() == value
        more, model = _steps(scaler, count=6, overflow_at=3)
        traces.append((trace + more, [p.detach().clone() for p in model.parameters()]))
    (ours, our_params), (theirs, their_params) = traces
    assert ours == theirs
    assert all(torch.equal(a, b) for a, b in zip(our_params, their_params))
    untouched, _ = _steps(
        amp.GradScaler(init_scale=128.0, growth_interval=2), count=6, overflow_at=3
    )
    assert [row[1] for row in ours[-6:]] != [row[1] for row in untouched]  # the setter told


def test_a_disabled_scaler_answers_as_torchs():
    ours, theirs = _both(enabled=False, **SCALER_ARGS)
    for name in GETTERS + ("is_enabled", "state_dict"):
        assert _answer(ours, name) == _answer(theirs, name), name
    assert ours.get_scale() == 1.0 and ours.is_enabled() is False and ours.state_dict() == {}
    for setter, value in (
        ("set_growth_factor", 4.0),
        ("set_backoff_factor", 0.25),
        ("set_growth_interval", 3),
        ("load_state_dict", dict(_both(**SCALER_ARGS)[1].state_dict(), scale=8.0)),
    ):
        assert _answer(ours, setter, value) == _answer(theirs, setter, value), setter
    assert ours.get_scale() == theirs.get_scale() == 1.0  # a load into a disabled scaler: no-op
    assert ours.state_dict() == theirs.state_dict() == {}


@pytest.mark.parametrize("into", ["amp", "torch"])
@pytest.mark.parametrize("source", ["amp", "torch"])
def test_state_dict_has_torchs_five_keys_and_round_trips_into_a_fresh_scaler(source, into):
    make = {"amp": amp.GradScaler, "torch": lambda **kw: torch.amp.GradScaler("cpu", **kw)}
    arguments = dict(init_scale=64.0, growth_factor=4.0, backoff_factor=0.25, growth_interval=3)
    first = make[source](**arguments)
    _steps(first, count=5, overflow_at=1)  # the growth tracker mid-interval
    saved = first.state_dict()
    assert list(saved) == [
        "scale",
        "growth_factor",
        "backoff_factor",
        "growth_interval",
        "_growth_tracker",
    ]
    assert saved == {
        "scale": 64.0 * 0.25 * 4.0,
        "growth_factor": 4.0,
        "backoff_factor": 0.25,
        "growth_interval": 3,
        "_growth_tracker": 0,
    }
    fresh = make[into]()
    fresh.load_state_dict(saved)
    assert fresh.state_dict() == saved
    assert [fresh.get_scale(), fresh.get_growth_factor()] == [saved["scale"], 4.0]
    assert [fresh.get_backoff_factor(), fresh.get_growth_interval()] == [0.25, 3]
    # Both go on identically: the loaded state is the one the next updates use.
    (went_on, _), (loaded, _) = _steps(first, count=4, overflow_at=2), _steps(fresh, 4, 2)
    assert went_on == loaded


def test_is_torchs_grad_scaler_with_torchs_signature_and_amps_positional_form():
    assert issubclass(amp.GradScaler, torch.amp.GradScaler)
    ours = inspect.signature(amp.GradScaler).parameters
    theirs = inspect.signature(torch.amp.GradScaler).parameters
    assert list(ours) == list(theirs)
    assert ours["device"].default is None  # the device comes from the tensors scaled
    assert [p.default for p in list(ours.values())[1:]] == [
        p.default for p in list(theirs.values())[1:]
    ]
    scaler = amp.GradScaler(8.0, 4.0, 0.25, 3, True)  # amp's (torch.cuda.amp's) positional form
    assert (scaler.get_scale(), scaler.get_growth_factor()) == (8.0, 4.0)
    assert (scaler.get_backoff_factor(), scaler.get_growth_interval()) == (0.25, 3)
    scaler = amp.GradScaler("cpu", 8.0, 4.0)  # torch's
    assert (scaler.get_scale(), scaler.get_growth_factor()) == (8.0, 4.0)
    with pytest.raises(TypeError, match="multiple values"):
        amp.GradScaler(8.0, init_scale=2.0)
    with pytest.raises(TypeError, match="unexpected keyword"):
        amp.GradScaler(scale=2.0)


def test_docstrings_say_where_it_synchronises():
    assert "does not incur a CPU-GPU sync" in amp.GradScaler.unscale_.__doc__  # torch's own
    for method in (amp.GradScaler.step, amp.GradScaler.update, amp.GradScaler.scale):
        assert "sync" in method.__doc__, method.__name__

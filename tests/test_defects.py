"""Regression tests for the defects a hostile test pass found (issue 22), one or more per item."""

import pytest
import torch
from torch.nn.utils import parametrize, prune

import amp
from amp._state import amp_state


class _Identity(torch.nn.Module):
    def forward(self, weight):
        return weight


def _move(module, how):
    """Move `module.weight` the way parametrize / prune do; return its new state-dict key."""
    if how == "parametrize":
        parametrize.register_parametrization(module, "weight", _Identity())
        return "parametrizations.weight.original"
    prune.identity(module, "weight")
    return "weight_orig"


def _moved_weight(module, how):
    if how == "parametrize":
        return module.parametrizations.weight.original
    return module.weight_orig


def _o2_model(optimizer=torch.optim.SGD):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    optimizer = optimizer(model.parameters(), lr=0.1)
    return amp.initialize(model, optimizer, opt_level="O2", loss_scale=128.0, verbosity=0)


def _master_of(optimizer, param):
    master = amp_state.masters[id(param)]
    assert any(p is master for p in amp.master_params(optimizer))  # the one the optimizer steps
    return master


# -- item 1: a parameter moved after initialize (parametrize, prune) -------------------------------


@pytest.mark.parametrize("how", ["parametrize", "prune"])
def test_item01_moved_parameter_state_dict_is_its_master(how):
    model, optimizer = _o2_model()
    weight = model[0].weight
    master = _master_of(optimizer, weight)
    master.data.add_(1e-4)  # a value FP16 cannot hold: a rounded copy would differ
    with torch.no_grad():
        weight.copy_(master)
    key = "0." + _move(model[0], how)
    state = model.state_dict()
    assert state[key].dtype is torch.float32
    assert torch.equal(state[key], master)
    assert torch.equal(model[0].state_dict()[key[2:]], master)  # at the submodule's level too
    amp.deinitialize()


@pytest.mark.parametrize("how", ["parametrize", "prune"])
def test_item01_load_into_moved_parameter_reaches_its_master(how):
    model, optimizer = _o2_model()
    key = "0." + _move(model[0], how)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state[key] = torch.full_like(state[key], 0.25)
    model.load_state_dict(state)
    weight = _moved_weight(model[0], how)
    for param in amp.master_params(optimizer):
        param.grad = torch.zeros_like(param)
    optimizer.step()  # a zero-gradient step: the loaded weights must stay
    assert torch.equal(_master_of(optimizer, weight), torch.full((4, 4), 0.25))
    assert torch.equal(weight.float(), torch.full((4, 4), 0.25))
    assert torch.equal(model.state_dict()[key], torch.full((4, 4), 0.25))
    amp.deinitialize()


@pytest.mark.parametrize("how", ["parametrize", "prune"])
def test_item01_moved_parameter_trains_and_comes_back_fp32(how):
    """An outside write to the moved FP16 weight reaches its master at the next step, training
    goes on, and amp.deinitialize() gives the moved parameter its master's FP32 value."""
    model, optimizer = _o2_model()
    _move(model[0], how)
    weight = _moved_weight(model[0], how)
    with torch.no_grad():
        weight.fill_(0.5)  # outside write, as a mask or a broadcast would make
    for param in amp.master_params(optimizer):
        param.grad = torch.zeros_like(param)
    optimizer.step()
    master = _master_of(optimizer, weight)
    assert torch.equal(master, torch.full((4, 4), 0.5))
    loss = model(torch.randn(3, 4)).float().sum()
    with amp.scale_loss(loss, optimizer) as scaled:
        scaled.backward()
    optimizer.step()
    assert not torch.equal(master, torch.full((4, 4), 0.5))
    expected = master.detach().clone()
    amp.deinitialize()
    assert weight.dtype is torch.float32
    assert torch.equal(weight, expected)
    # The hooks amp put on the module parametrize made are gone with the rest.
    plist = model[0].parametrizations.weight if how == "parametrize" else model[0]
    assert not plist._state_dict_pre_hooks and not plist._load_state_dict_pre_hooks


def test_item01_parametrization_removed_again_is_followed_back():
    model, optimizer = _o2_model()
    weight = model[0].weight
    master = _master_of(optimizer, weight)
    master.data.add_(1e-4)
    with torch.no_grad():
        weight.copy_(master)
    _move(model[0], "parametrize")
    assert torch.equal(model.state_dict()["0.parametrizations.weight.original"], master)
    parametrize.remove_parametrizations(model[0], "weight", leave_parametrized=False)
    state = model.state_dict()
    assert sorted(state) == ["0.bias", "0.weight", "1.bias", "1.weight"]
    assert torch.equal(state["0.weight"], master)
    state["0.weight"] = torch.full((4, 4), 0.25)
    model.load_state_dict(state)
    assert torch.equal(master, torch.full((4, 4), 0.25))
    amp.deinitialize()
    assert weight.dtype is torch.float32 and torch.equal(weight, torch.full((4, 4), 0.25))


# -- item 2: one parameter shared by two models ----------------------------------------------------


def test_item02_parameter_shared_between_models_has_one_master_in_both_state_dicts():
    torch.manual_seed(0)
    encoder = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    decoder = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    decoder[1].weight = encoder[0].weight
    params = list({id(p): p for m in (encoder, decoder) for p in m.parameters()}.values())
    optimizer = torch.optim.Adam(params, lr=0.1)
    (encoder, decoder), optimizer = amp.initialize(
        [encoder, decoder], optimizer, opt_level="O2", verbosity=0
    )
    shared = encoder[0].weight
    for _ in range(3):
        loss = decoder(encoder(torch.randn(2, 4))).float().pow(2).sum()
        with amp.scale_loss(loss, optimizer) as scaled:
            scaled.backward()
        optimizer.step()
        optimizer.zero_grad()
    master = _master_of(optimizer, shared)
    assert torch.equal(encoder.state_dict()["0.weight"], master)
    assert torch.equal(decoder.state_dict()["1.weight"], master)
    # A write through either state dict is the master's, and reaches both models' forward.
    decoder.state_dict()["1.weight"].fill_(0.125)
    decoder(torch.randn(1, 4))
    assert torch.equal(shared.float(), torch.full((4, 4), 0.125))
    assert torch.equal(encoder.state_dict()["0.weight"], torch.full((4, 4), 0.125))
    amp.deinitialize()
    assert shared.dtype is torch.float32 and torch.equal(shared, torch.full((4, 4), 0.125))


# -- item 4: a thread inside torch's own autocast region when O1 starts elsewhere ------------------


def test_item04_thread_in_torch_region_is_cast_once_by_torch_then_joins_o1():
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
        seen["after"] = torch.mm(a, a).dtype  # torch's region is over: O1 casts here too

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
    assert torch.equal(seen["under O1"], seen["torch alone"])  # 2e10, not inf
    assert seen["dtype"] is torch.bfloat16 and seen["enabled"]
    assert seen["after"] is torch.float16


# -- item 3: a failed initialize changes nothing ---------------------------------------------------


def _trained_adam(model):
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    for _ in range(2):
        model(torch.randn(3, 4)).sum().backward()
        optimizer.step()
    return optimizer


def _everything(models, optimizer):
    """What a failed initialize must leave as it was: objects by identity, values bit for bit."""
    params = [p for model in models for p in model.parameters()]
    return {
        "params": [(p, p.dtype, p.data_ptr(), p.detach().clone(), p.grad) for p in params],
        "grads": [None if p.grad is None else p.grad.clone() for p in params],
        "attributes": dict(vars(optimizer)),
        "groups": [(group, dict(group), list(group["params"])) for group in optimizer.param_groups],
        "state": [
            (key, value, {k: (v, v.clone()) for k, v in value.items()})
            for key, value in optimizer.state.items()
        ],
        "torch": (
            torch.mm, torch.nn.functional.linear, torch._C._nn.linear, torch.is_autocast_enabled
        ),
    }


def _assert_unchanged(before, after):
    for (p, dtype, ptr, value, grad), (q, dtype2, ptr2, value2, grad2) in zip(
        before["params"], after["params"]
    ):
        assert p is q and dtype2 is dtype is torch.float32 and ptr2 == ptr
        assert torch.equal(value2, value) and grad2 is grad
    for a, b in zip(before["grads"], after["grads"]):
        assert (a is None and b is None) or torch.equal(a, b)
    assert after["attributes"].keys() == before["attributes"].keys()
    assert all(after["attributes"][k] is v for k, v in before["attributes"].items())
    for (group, items, params), (group2, items2, params2) in zip(before["groups"], after["groups"]):
        assert group2 is group and items2.keys() == items.keys()
        assert all(a is b for a, b in zip(params, params2)) and len(params) == len(params2)
    assert len(before["state"]) == len(after["state"])
    for (key, value, items), (key2, value2, items2) in zip(before["state"], after["state"]):
        assert key2 is key and value2 is value and items2.keys() == items.keys()
        for name, (tensor, copy) in items.items():
            assert items2[name][0] is tensor and torch.equal(items2[name][1], copy)
            assert items2[name][1].dtype is copy.dtype
    assert all(a is b for a, b in zip(before["torch"], after["torch"]))


@pytest.mark.parametrize("opt_level", ["O0", "O2", "O3"])
def test_item03_torchscript_model_is_refused_before_anything_changes(opt_level):
    torch.manual_seed(0)
    plain = torch.nn.Linear(4, 4)
    scripted = torch.jit.script(torch.nn.Linear(4, 4))
    optimizer = torch.optim.Adam(list(plain.parameters()) + list(scripted.parameters()), lr=0.1)
    for _ in range(2):
        (plain(torch.randn(3, 4)).sum() + scripted(torch.randn(3, 4)).sum()).backward()
        optimizer.step()
    before = _everything([plain, scripted], optimizer)
    with pytest.raises(RuntimeError, match="models\\[1\\] is a TorchScript module"):
        amp.initialize([plain, scripted], optimizer, opt_level=opt_level, verbosity=0)
    _assert_unchanged(before, _everything([plain, scripted], optimizer))
    assert not amp_state.initialized


@pytest.mark.parametrize("opt_level", ["O1", "O2", "O3"])
def test_item03_initialize_failing_late_puts_everything_back_exactly(opt_level, monkeypatch):
    """A failure after the models were cast (here: the last step of initialize raises) leaves
    weights, gradients, optimizer state and groups, and torch exactly as they were: O3 keeps no
    FP32 copy, so an undo alone would give the weights back rounded to FP16."""
    from amp.weights import engines

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    optimizer = _trained_adam(model)
    model(torch.randn(3, 4)).sum().backward()  # gradients waiting too
    buffers = {name: (b, b.clone()) for name, b in model.named_buffers()}
    before = _everything([model], optimizer)

    def fail(*args, **kwargs):
        raise RuntimeError("injected failure")

    monkeypatch.setattr(engines, "watch_parameters", fail)
    with pytest.raises(RuntimeError, match="injected failure"):
        amp.initialize(model, optimizer, opt_level=opt_level, verbosity=0)
    monkeypatch.undo()
    _assert_unchanged(before, _everything([model], optimizer))
    for name, buffer in model.named_buffers():
        assert buffer is buffers[name][0] and torch.equal(buffer, buffers[name][1])
    assert not amp_state.initialized and not amp_state.torch_patches.installed
    model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level, verbosity=0)
    amp.deinitialize()


# -- item 6: an O2 optimizer load that cannot copy a master changes nothing ------------------------


class _Uncopyable(torch.Tensor):
    """A master weight that passes every check and still cannot be copied from."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.copy_:
            raise RuntimeError("this tensor cannot be copied")
        return super().__torch_function__(func, types, args, kwargs or {})


def _o2_adam_two_steps():
    import copy

    model, optimizer = _o2_model(torch.optim.Adam)

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
def test_item06_o2_optimizer_load_with_unusable_master_changes_nothing(bad):
    model, optimizer, saved = _o2_adam_two_steps()
    masters = dict(saved["amp_master_params"])
    value = masters[0]
    if bad == "meta":
        masters[0] = value.to("meta")
    elif bad == "sparse":
        masters[0] = value.to_sparse()
    else:
        masters[0] = value.as_subclass(_Uncopyable)
    saved["amp_master_params"] = masters
    state = {param: {k: v.clone() for k, v in s.items()} for param, s in optimizer.state.items()}
    params = [p.detach().clone() for p in amp.master_params(optimizer)]
    with pytest.raises((ValueError, RuntimeError), match="meta|sparse|cannot be copied"):
        optimizer.load_state_dict(saved)
    assert all(float(s["step"]) == 2 for s in optimizer.state.values())
    for param, entries in state.items():
        assert all(torch.equal(optimizer.state[param][k], v) for k, v in entries.items())
    assert all(torch.equal(p, q) for p, q in zip(amp.master_params(optimizer), params))
    amp.deinitialize()


# -- item 7: duplicate scaler keys, a loss scale too large for a float -----------------------------


def test_item07_two_keys_for_one_scaler_are_refused():
    _o2_model()
    before = amp.state_dict()
    with pytest.raises(RuntimeError, match="'loss_scaler0' and 'loss_scaler00' both name"):
        amp.load_state_dict(
            {
                "loss_scaler0": {"loss_scale": 128.0, "unskipped": 0},
                "loss_scaler00": {"loss_scale": 128.0, "unskipped": 3},
            }
        )
    assert amp.state_dict() == before
    amp.deinitialize()


@pytest.mark.parametrize(
    "scale", [10**400, -(10**400), 10**5000], ids=["1e400", "-1e400", "1e5000"]
)
def test_item07_huge_int_loss_scale_gets_amps_error(scale):
    model, optimizer = amp.initialize(
        torch.nn.Linear(2, 2), torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1),
        opt_level="O1", verbosity=0,
    )
    before = amp.state_dict()
    with pytest.raises(ValueError, match="int of .* bits"):
        amp.load_state_dict({"loss_scaler0": {"loss_scale": scale, "unskipped": 0}})
    with pytest.raises(ValueError, match="int of .* bits"):
        amp._amp_state.loss_scalers[0]._loss_scale = scale
    assert amp.state_dict() == before
    amp.deinitialize()


# -- item 8: a static checkpoint resumed with a dynamic scaler -------------------------------------


def _scaled_step(model, optimizer, overflow=False):
    loss = model(torch.ones(2, 4)).float().sum()
    with amp.scale_loss(loss, optimizer) as scaled:
        scaled.backward()
        if overflow:  # in the scaled gradients, not the loss (a non-finite loss keeps the scale)
            next(model.parameters()).grad[0, 0] = float("inf")
    optimizer.step()
    optimizer.zero_grad()


def test_item08_static_checkpoint_starts_a_dynamic_scaler_at_its_scale(caplog):
    source, optimizer = _o2_model()  # loss_scale=128.0: static
    _scaled_step(source, optimizer)
    saved = amp.state_dict()
    assert saved["loss_scaler0"]["dynamic"] is False
    amp.deinitialize()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    model, optimizer = amp.initialize(
        model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2", loss_scale="dynamic"
    )
    with caplog.at_level("INFO", logger="amp"):
        amp.load_state_dict(saved)
    assert "comes from a static loss scale" in caplog.text
    assert amp.state_dict()["loss_scaler0"] == {
        "loss_scale": 128.0, "unskipped": 0, "dynamic": True
    }
    _scaled_step(model, optimizer, overflow=True)  # an overflow: dynamic backs off
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == 64.0
    _scaled_step(model, optimizer)
    assert amp.state_dict()["loss_scaler0"]["unskipped"] == 1
    amp.deinitialize()


def test_item08_static_checkpoint_outside_the_dynamic_bounds_is_refused():
    model = torch.nn.Linear(4, 2)
    amp.initialize(
        model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O1", verbosity=0,
        max_loss_scale=1024.0,
    )
    before = amp.state_dict()
    with pytest.raises(ValueError, match="outside min_loss_scale=None and max_loss_scale=1024.0"):
        amp.load_state_dict(
            {"loss_scaler0": {"loss_scale": 4096.0, "unskipped": 0, "dynamic": False}}
        )
    assert amp.state_dict() == before
    amp.deinitialize()


def test_item08_dynamic_checkpoint_into_a_static_run_stays_refused():
    model = torch.nn.Linear(4, 2)
    amp.initialize(
        model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O1", verbosity=0,
        loss_scale=128.0,
    )
    entry = {"loss_scale": 128.0, "unskipped": 0, "dynamic": True}
    with pytest.raises(ValueError, match="from a dynamic loss scaler, but this run's is static"):
        amp.load_state_dict({"loss_scaler0": entry})
    amp.deinitialize()


# -- item 5: apex's _unskipped written out of range ------------------------------------------------


@pytest.mark.parametrize("after_first_step", [False, True])
@pytest.mark.parametrize("value", [2**31, 2000, -1, 1.5])
def test_item05_unskipped_write_out_of_range_is_refused_and_changes_nothing(
    value, after_first_step
):
    model = torch.nn.Linear(4, 2)
    model, optimizer = amp.initialize(
        model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O1", verbosity=0
    )
    if after_first_step:
        _scaled_step(model, optimizer)
    before = amp.state_dict()
    with pytest.raises(ValueError, match="_unskipped"):
        amp._amp_state.loss_scalers[0]._unskipped = value
    assert amp.state_dict() == before
    _scaled_step(model, optimizer)  # scale_loss still works, and the state round-trips
    amp.load_state_dict(amp.state_dict())
    amp._amp_state.loss_scalers[0]._loss_scale = 8.0
    amp._amp_state.loss_scalers[0]._unskipped = 1999  # the largest count: it grows next step
    _scaled_step(model, optimizer)
    assert amp.state_dict()["loss_scaler0"] == {"loss_scale": 16.0, "unskipped": 0, "dynamic": True}
    amp.deinitialize()


def test_item05_apex_static_count_into_a_dynamic_run_starts_counting_from_zero():
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, optimizer, opt_level="O1", verbosity=0)
    amp.load_state_dict({"loss_scaler0": {"loss_scale": 128.0, "unskipped": 50000}})  # apex O3
    expected = {"loss_scale": 128.0, "unskipped": 0, "dynamic": True}
    assert amp.state_dict()["loss_scaler0"] == expected
    with pytest.raises(ValueError, match="growth interval"):  # amp's own dynamic dict: damaged
        amp.load_state_dict(
            {"loss_scaler0": {"loss_scale": 128.0, "unskipped": 5000, "dynamic": True}}
        )
    amp.deinitialize()


# -- item 9: torch's C bindings, and an invalid device string --------------------------------------


def _table_kinds():
    from amp import lists

    return {(entry.namespace, entry.name): entry.kind for entry in lists.entries()}


def test_item09_c_bindings_take_their_functions_policy_and_are_restored():
    from amp import lists

    bindings = lists.bindings()
    originals = {binding: getattr(torch._C._nn, binding[1]) for binding in bindings}
    kinds = _table_kinds()
    with amp.autocast(dtype=torch.bfloat16):
        for (_, name), source in bindings.items():
            assert getattr(torch._C._nn, name).__amp_kind__ == kinds[source], name
        x = torch.randn(2, 3, 4, 4, 4)
        assert torch._C._nn.linear(torch.randn(2, 4), torch.randn(3, 4)).dtype is torch.bfloat16
        assert torch._C._nn.softplus(x.bfloat16()).dtype is torch.float32
        assert torch._C._nn.upsample_nearest3d(x.bfloat16(), [8, 8, 8]).dtype is torch.float32
        assert torch._C._nn.avg_pool3d(x.bfloat16(), 2).dtype is torch.float32
        with pytest.raises(NotImplementedError, match="BCEWithLogitsLoss"):
            torch._C._nn.binary_cross_entropy(x.bfloat16().sigmoid(), x.bfloat16().sigmoid())
    amp.deinitialize()
    assert all(getattr(torch._C._nn, name) is originals[(path, name)] for path, name in bindings)


def test_item09_a_registration_of_the_function_rules_its_binding_too(registrations):
    amp.register_half_function(torch.nn.functional, "mse_loss")
    x = torch.randn(4, 4)
    with amp.autocast(dtype=torch.bfloat16):
        assert torch._C._nn.mse_loss(x, x).dtype is torch.bfloat16
    amp.deinitialize()


def test_item09_autocast_with_an_invalid_device_string_raises_torchs_error():
    with pytest.raises(RuntimeError, match="Invalid device string: 'not a real device'"):
        torch.autocast("not a real device")
    with pytest.raises(RuntimeError, match="Invalid device string: 'not a real device'"):
        amp.autocast("not a real device")
    with pytest.raises(RuntimeError, match="unsupported device_type 'xpu'"):
        amp.autocast("xpu")

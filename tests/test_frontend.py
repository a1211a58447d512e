"""The front door (amp/frontend.py): amp.initialize's return shapes and refusals (nothing
changed when it raises or fails halfway), amp.deinitialize, amp.master_params and the progress
messages. amp.state_dict / load_state_dict: tests/scaling/test_checkpoint.py."""

import copy
import io
import logging
import pickle

import pytest
import torch

import amp
from amp._state import amp_state
from helpers import OPT_LEVELS
from helpers.models import make_model


def bn_model(seed=0):
    """make_model with batch norm and three outputs."""
    return make_model(seed, batch_norm=True, outputs=3)


def make_pair(seed=0, lr=0.1):
    model = bn_model(seed)
    return model, torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)


def snapshot(model, optimizer):
    """Everything initialize could modify, by value and identity."""
    return {
        "params": [(p, p.dtype, p.detach().clone()) for p in model.parameters()],
        "buffers": [(name, b.dtype, b.clone()) for name, b in model.named_buffers()],
        "groups": [list(group["params"]) for group in optimizer.param_groups],
        "optimizer_dict": dict(vars(optimizer)),
        "hooks": [dict(m._forward_hooks) for m in model.modules()]
        + [dict(m._forward_pre_hooks) for m in model.modules()]
        + [dict(m._state_dict_hooks) for m in model.modules()],
    }


def assert_unchanged(model, optimizer, before):
    after = snapshot(model, optimizer)
    for (p0, d0, v0), (p1, d1, v1) in zip(before["params"], after["params"]):
        assert p0 is p1 and d0 == d1 and torch.equal(v0, v1)
    for (n0, d0, v0), (n1, d1, v1) in zip(before["buffers"], after["buffers"]):
        assert n0 == n1 and d0 == d1 and torch.equal(v0, v1)
    assert all(
        all(a is b for a, b in zip(g0, g1)) for g0, g1 in zip(before["groups"], after["groups"])
    )
    assert after["optimizer_dict"].keys() == before["optimizer_dict"].keys()
    assert after["hooks"] == before["hooks"]


# -- return shapes -------------------------------------------------------------------------------


def test_single_model_single_optimizer():
    model, optimizer = make_pair()
    result = amp.initialize(model, optimizer, verbosity=0)
    assert isinstance(result, tuple) and result[0] is model and result[1] is optimizer
    amp.deinitialize()


def test_single_model_no_optimizer():
    model = bn_model()
    assert amp.initialize(model, verbosity=0) is model
    amp.deinitialize()


def test_list_of_models_list_of_optimizers():
    m0, o0 = make_pair(0)
    m1, o1 = make_pair(1)
    models, optimizers = amp.initialize([m0, m1], [o0, o1], verbosity=0)
    assert models == [m0, m1] and optimizers == [o0, o1]
    amp.deinitialize()


def test_single_model_list_of_optimizers():
    model = bn_model()
    o0 = torch.optim.SGD(list(model.parameters())[:2], lr=0.1)
    o1 = torch.optim.SGD(list(model.parameters())[2:], lr=0.1)
    result_model, result_optimizers = amp.initialize(model, [o0, o1], verbosity=0)
    assert result_model is model and result_optimizers == [o0, o1]
    amp.deinitialize()


def test_list_of_models_single_optimizer():
    m0, m1 = bn_model(0), bn_model(1)
    optimizer = torch.optim.SGD(list(m0.parameters()) + list(m1.parameters()), lr=0.1)
    models, result_optimizer = amp.initialize([m0, m1], optimizer, verbosity=0)
    assert models == [m0, m1] and result_optimizer is optimizer
    amp.deinitialize()
    assert amp.initialize([m0, m1], verbosity=0) == [m0, m1]
    amp.deinitialize()


# -- enabled=False -------------------------------------------------------------------------------


def test_disabled_returns_arguments_and_makes_everything_a_no_op():
    model, optimizer = make_pair()
    before = snapshot(model, optimizer)
    result = amp.initialize(model, (optimizer,), enabled=False, opt_level="O2")
    assert result[0] is model and result[1] == (optimizer,)
    assert_unchanged(model, optimizer, before)
    loss = model(torch.randn(4, 4)).sum()
    with amp.scale_loss(loss, optimizer) as scaled:
        assert scaled is loss
    assert amp.state_dict() == {}
    amp.load_state_dict({"loss_scaler0": {"loss_scale": 8.0, "unskipped": 0}})
    assert list(amp.master_params(optimizer)) == list(model.parameters())
    assert torch.nn.functional.linear is torch._C._nn.linear
    amp.deinitialize()


# -- errors, and nothing modified when raised -----------------------------------------------------


def _initialize_error(model, optimizer, error, match, **kwargs):
    before = snapshot(model, optimizer)
    with pytest.raises(error, match=match):
        amp.initialize(model, optimizer, **{"verbosity": 0, **kwargs})
    assert_unchanged(model, optimizer, before)
    assert not amp_state.initialized


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(opt_level="o2"), RuntimeError, "letter O"),
        (
            dict(opt_level="O1", keep_batchnorm_fp32=True),
            RuntimeError,
            "keep_batchnorm_fp32 should be None",
        ),
        (
            dict(opt_level="O2", patch_torch_functions=True),
            RuntimeError,
            "patch_torch_functions=True",
        ),
        (dict(opt_level="O2", loss_scale="huge"), ValueError, "loss_scale"),
        (dict(opt_level="O2", dtype=torch.float32), ValueError, "float16 or torch.bfloat16"),
        (dict(num_losses=0), ValueError, "num_losses"),
        (dict(verbosity=-1), ValueError, "verbosity"),
        (dict(verbosity=7), ValueError, "verbosity must be 0, 1 or 2; got 7"),
        (dict(verbosity=True), ValueError, "verbosity must be 0, 1 or 2"),
        (dict(cast_model_outputs="float32"), ValueError, "cast_model_outputs"),
        (dict(min_loss_scale=4.0, max_loss_scale=2.0), ValueError, "min_loss_scale"),
        (dict(max_loss_scale=-1.0), ValueError, "max_loss_scale"),
        (dict(enabled="yes"), TypeError, "enabled"),
    ],
)
def test_bad_arguments_modify_nothing(kwargs, error, match):
    model, optimizer = make_pair()
    _initialize_error(model, optimizer, error, match, **kwargs)


@pytest.mark.parametrize("wrapper", [torch.nn.DataParallel])
def test_parallel_wrapped_model_is_refused(wrapper):
    model, optimizer = make_pair()
    with pytest.raises(RuntimeError, match="Parallel wrappers should only be applied to the model"):
        amp.initialize(wrapper(model), optimizer, verbosity=0)


@pytest.mark.parametrize(
    "opt_level, dtype, says",
    [
        ("O0", None, "O0 trains it in FP32"),
        ("O1", None, "O1 keeps it in FP32 and runs the listed ops in low precision"),
        ("O2", None, "O2 casts it to torch.float16 for you"),
        ("O3", torch.bfloat16, "O3 casts it to torch.bfloat16 for you"),
    ],
    ids=["O0", "O1", "O2", "O3-bf16"],
)
def test_low_precision_model_is_refused_saying_what_the_level_does(opt_level, dtype, says):
    model, optimizer = make_pair()
    model[0].half()
    _initialize_error(
        model,
        optimizer,
        RuntimeError,
        r"do not need to call \.half\(\)(.|\n)*: " + says + r"\.$",
        opt_level=opt_level,
        dtype=dtype,
    )


def test_wrong_types_are_refused():
    model, optimizer = make_pair()
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        amp.initialize(model, object(), verbosity=0)
    with pytest.raises(TypeError, match="nn.Module"):
        amp.initialize("model", optimizer, verbosity=0)
    with pytest.raises(TypeError, match="not a tuple"):
        amp.initialize((model,), optimizer, verbosity=0)


def test_parameter_in_two_optimizers_is_refused_with_master_weights():
    model = bn_model()
    o0 = torch.optim.SGD(model.parameters(), lr=0.1)
    o1 = torch.optim.SGD(list(model.parameters())[:1], lr=0.1)
    before = snapshot(model, o0)
    with pytest.raises(ValueError, match="a parameter appears in two optimizers.*one FP32 master"):
        amp.initialize(model, [o0, o1], opt_level="O2", verbosity=0)
    assert_unchanged(model, o0, before)


@pytest.mark.parametrize("opt_level", ["O0", "O1", "O3"])
def test_optimizers_sharing_parameters_each_unscale_check_and_skip_their_own(opt_level):
    """Without master weights each optimizer steps the model's parameters: two may share them
    (Lightning's test_multiple_optimizers_manual_amp), each through its own scale_loss."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    both = list(model.parameters())
    first = torch.optim.SGD(both, lr=0.1)
    second = torch.optim.SGD(both[2:], lr=0.1)  # the last layer in both
    dtype = torch.bfloat16 if opt_level == "O3" else torch.float16
    model, (first, second) = amp.initialize(
        model, [first, second], opt_level=opt_level, dtype=dtype, loss_scale="dynamic", verbosity=0
    )
    x = torch.randn(8, 4).to(next(model.parameters()).dtype)
    try:
        for optimizer, poisoned in ((first, False), (second, False), (second, True), (first, True)):
            expected = torch.autograd.grad(model(x).float().pow(2).mean(), both)
            optimizer.zero_grad()
            out = model(x)
            if poisoned:
                out.register_hook(lambda grad: torch.full_like(grad, float("inf")))
            with amp.scale_loss(out.float().pow(2).mean(), optimizer) as scaled:
                scaled.backward()
            stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
            if not poisoned:  # unscaled once, as an unscaled backward makes them
                for param, grad in zip(both, expected):
                    if id(param) in stepped:
                        torch.testing.assert_close(param.grad, grad)
            before = [p.detach().clone() for p in both]
            optimizer.step()
            changed = [not torch.equal(p, b) for p, b in zip(both, before)]
            assert changed == [id(p) in stepped and not poisoned for p in both]
    finally:
        amp.deinitialize()


@pytest.mark.parametrize("accumulate", [False, True])
def test_one_block_over_optimizers_sharing_parameters_unscales_them_once(accumulate):
    """scale_loss(loss, [first, second]) where both step the last layer: its gradient is
    unscaled once (also an accumulation's sum), and an overflow skips both steps."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    both = list(model.parameters())
    first = torch.optim.SGD(both, lr=0.1)
    second = torch.optim.SGD(both[2:], lr=0.1)
    model, (first, second) = amp.initialize(
        model, [first, second], opt_level="O1", loss_scale="dynamic", verbosity=0
    )
    x = torch.randn(8, 4)
    passes = 2 if accumulate else 1
    try:
        for poisoned in (False, True):
            expected = torch.autograd.grad(model(x).pow(2).mean() * passes, both)
            for index in range(passes):
                out = model(x)
                if poisoned:
                    out.register_hook(lambda grad: torch.full_like(grad, float("inf")))
                last = index == passes - 1
                with amp.scale_loss(out.pow(2).mean(), [first, second], delay_unscale=not last) as s:
                    s.backward()
            if not poisoned:
                for param, grad in zip(both, expected):
                    torch.testing.assert_close(param.grad, grad)
            before = [p.detach().clone() for p in both]
            first.step()
            second.step()
            changed = [not torch.equal(p, b) for p, b in zip(both, before)]
            assert changed == [not poisoned] * len(both)
            first.zero_grad()
    finally:
        amp.deinitialize()


def test_second_initialize_is_refused_until_deinitialize():
    model, optimizer = make_pair()
    amp.initialize(model, optimizer, verbosity=0)
    other_model, other_optimizer = make_pair(1)
    before = snapshot(other_model, other_optimizer)
    with pytest.raises(RuntimeError, match=r"Call amp.deinitialize\(\) first"):
        amp.initialize(other_model, other_optimizer, verbosity=0)
    assert_unchanged(other_model, other_optimizer, before)
    amp.deinitialize()
    amp.initialize(other_model, other_optimizer, verbosity=0)
    amp.deinitialize()


def test_optimizer_already_processed_is_refused():
    model, optimizer = make_pair()
    with pytest.raises(RuntimeError, match="should only be passed through amp.initialize once"):
        amp.initialize(model, [optimizer, optimizer], verbosity=0)
    vars(optimizer)["_amp_record"] = object()  # as left by an amp that lost its state
    try:
        with pytest.raises(RuntimeError, match="should only be passed through amp.initialize once"):
            amp.initialize(model, optimizer, verbosity=0)
    finally:
        del vars(optimizer)["_amp_record"]


def test_failure_halfway_rolls_everything_back(monkeypatch):
    model, optimizer = make_pair()
    before = snapshot(model, optimizer)

    def explode(*args, **kwargs):
        raise MemoryError("simulated")

    monkeypatch.setattr(amp.frontend, "LossScaler", explode)
    with pytest.raises(MemoryError):
        amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
    assert_unchanged(model, optimizer, before)
    assert not amp_state.initialized


# -- deinitialize ------------------------------------------------------------------------------


@pytest.mark.parametrize("opt_level", OPT_LEVELS)
def test_deinitialize_round_trip_is_exact(opt_level):
    model, optimizer = make_pair()
    model.register_buffer("table", torch.randn(5))  # a plain FP32 buffer, cast under O2/O3
    before = snapshot(model, optimizer)
    torch_attributes = {name: getattr(torch, name) for name in dir(torch)}
    tensor_attributes = dict(vars(torch.Tensor))
    amp.initialize(model, optimizer, opt_level=opt_level, verbosity=0)
    amp.deinitialize()
    if opt_level == "O3":
        # O3 keeps no FP32 copy of the parameters: they come back as their FP16 values, upcast.
        for (param, _, value), now in zip(before["params"], model.parameters()):
            assert param is now and now.dtype is torch.float32
            expected = value.half().float()
            assert torch.equal(now.detach(), expected)
        before["params"] = [(p, p.dtype, p.detach().clone()) for p in model.parameters()]
    assert_unchanged(model, optimizer, before)
    assert all(getattr(torch, name) is value for name, value in torch_attributes.items())
    assert dict(vars(torch.Tensor)) == tensor_attributes
    assert not amp_state.initialized and amp_state.optimizers == [] and amp_state.rows == []


@pytest.mark.parametrize("opt_level", OPT_LEVELS)
def test_after_deinitialize_training_is_plain_pytorch(opt_level):
    model, optimizer = make_pair()
    reference_model, reference_optimizer = make_pair()
    amp.initialize(model, optimizer, opt_level=opt_level, verbosity=0)
    x = torch.randn(8, 4)
    with amp.scale_loss(model(x).square().mean(), optimizer) as scaled:
        scaled.backward()
    optimizer.step()
    optimizer.zero_grad()
    amp.deinitialize()
    assert all(p.dtype is torch.float32 for p in model.parameters())
    assert type(optimizer).step is optimizer.step.__func__
    reference_model.load_state_dict(copy.deepcopy(model.state_dict()))
    # A deep copy: load_state_dict shares state tensors that need no conversion.
    reference_optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    for m, o in ((model, optimizer), (reference_model, reference_optimizer)):
        m(x).square().mean().backward()
        o.step()
    for p, q in zip(model.parameters(), reference_model.parameters()):
        assert torch.equal(p, q)


def test_o2_deinitialize_restores_fp32_weights_from_masters():
    model, optimizer = make_pair()
    amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
    for _ in range(3):
        with amp.scale_loss(model(torch.randn(8, 4)).square().mean(), optimizer) as scaled:
            scaled.backward()
        optimizer.step()
        optimizer.zero_grad()
    masters = [m.detach().clone() for m in amp.master_params(optimizer)]
    amp.deinitialize()
    for param, master in zip(model.parameters(), masters):
        assert param.dtype is torch.float32
        assert torch.equal(param, master)
    assert list(optimizer.param_groups[0]["params"]) == list(model.parameters())
    assert all(p in optimizer.state for p in model.parameters())


def test_deinitialize_without_initialize_is_a_no_op():
    """Nothing to undo: amp's state, torch's attributes, a model and its optimizer stay exactly
    as they were, and amp.initialize works afterwards."""
    model, optimizer = make_pair()
    before = snapshot(model, optimizer)
    torch_attributes = {name: getattr(torch, name) for name in dir(torch)}
    tensor_attributes = dict(vars(torch.Tensor))
    functional_attributes = dict(vars(torch.nn.functional))
    amp.deinitialize()
    amp.deinitialize()
    assert all(getattr(torch, name) is value for name, value in torch_attributes.items())
    assert vars(torch.Tensor).keys() == tensor_attributes.keys()
    assert all(vars(torch.Tensor)[name] is value for name, value in tensor_attributes.items())
    assert vars(torch.nn.functional).keys() == functional_attributes.keys()
    assert all(
        vars(torch.nn.functional)[name] is value for name, value in functional_attributes.items()
    )
    assert_unchanged(model, optimizer, before)
    assert type(optimizer).step is optimizer.step.__func__ and "_amp_record" not in vars(optimizer)
    assert not amp_state.initialized and amp_state.optimizers == [] and amp_state.rows == []
    assert amp._amp_state.loss_scalers == () and amp._amp_state.opt_properties.enabled is False
    with pytest.raises(RuntimeError, match="amp.initialize"):
        amp.state_dict()
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
    try:
        assert model[0].weight.dtype is torch.float16
        with amp.scale_loss(model(torch.randn(8, 4)).float().square().mean(), optimizer) as scaled:
            scaled.backward()
        optimizer.step()
        assert amp.state_dict()["loss_scaler0"]["unskipped"] == 1
    finally:
        amp.deinitialize()


def test_deepcopy_and_pickle_of_initialized_objects():
    model, optimizer = make_pair()
    amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
    model_copy = copy.deepcopy(model)
    assert model_copy(torch.randn(2, 4)).dtype is torch.float32  # hooks travel with the copy
    optimizer_copy = pickle.loads(pickle.dumps(optimizer))
    assert "_amp_record" not in vars(optimizer_copy)
    amp.deinitialize()


# -- master_params, logging ---------------------------------------------------------------------


def test_master_params_are_fp32_masters_under_o2():
    model, optimizer = make_pair()
    amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
    masters = list(amp.master_params(optimizer))
    assert len(masters) == len(list(model.parameters()))
    assert all(m.dtype is torch.float32 for m in masters)
    for master, (name, param) in zip(masters, model.named_parameters()):
        # Batch norm stays FP32 under O2 and is stepped directly; the rest steps FP32 copies.
        assert (master is param) == name.startswith("1.")
    with pytest.raises(TypeError, match="expects an optimizer"):
        amp.master_params(model)
    amp.deinitialize()


def _captured(verbosity, opt_level="O2", **options):
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logger = logging.getLogger("amp")
    logger.addHandler(handler)
    try:
        model, optimizer = make_pair()
        amp.initialize(model, optimizer, opt_level=opt_level, verbosity=verbosity, **options)
        amp.deinitialize()
    finally:
        logger.removeHandler(handler)
    return stream.getvalue()


def test_progress_messages_go_through_logging_and_verbosity_zero_silences():
    text = _captured(1)
    assert (
        "Selected optimization level O2:  FP16 training with FP32 batchnorm and FP32 master weights."
        in text
    )
    assert f"{'master_weights':22} : True" in text
    assert _captured(0) == ""


@pytest.mark.parametrize(
    "opt_level, line",
    [
        ("O2", "O2:  BF16 training with FP32 batchnorm and FP32 master weights."),
        ("O3", "O3:  Pure BF16 training."),
    ],
)
def test_the_selected_level_names_the_dtype_in_use(opt_level, line):
    text = _captured(1, opt_level, dtype=torch.bfloat16)
    assert f"Selected optimization level {line}" in text
    assert "FP16" not in text


# -- a failed initialize changes nothing ---------------------------------------------------------


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
            torch.mm,
            torch.nn.functional.linear,
            torch._C._nn.linear,
            torch.is_autocast_enabled,
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
        for name, (tensor, saved) in items.items():
            assert items2[name][0] is tensor and torch.equal(items2[name][1], saved)
            assert items2[name][1].dtype is saved.dtype
    assert all(a is b for a, b in zip(before["torch"], after["torch"]))


@pytest.mark.parametrize("opt_level", ["O0", "O2", "O3"])
def test_a_torchscript_model_is_refused_before_anything_changes(opt_level):
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
def test_initialize_failing_late_puts_everything_back_exactly(opt_level, monkeypatch):
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

    monkeypatch.setattr(engines, "anchor", fail)
    with pytest.raises(RuntimeError, match="injected failure"):
        amp.initialize(model, optimizer, opt_level=opt_level, verbosity=0)
    monkeypatch.undo()
    _assert_unchanged(before, _everything([model], optimizer))
    for name, buffer in model.named_buffers():
        assert buffer is buffers[name][0] and torch.equal(buffer, buffers[name][1])
    assert not amp_state.initialized and not amp_state.torch_patches.installed
    model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level, verbosity=0)
    amp.deinitialize()

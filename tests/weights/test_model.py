"""The model at O0/O2/O3 (amp/weights/model.py): weight casting, batch norm, forward input/output
casting, FP32 state dicts that hold the masters (also for parameters moved or shared after
initialize), copies and saves of a cast model."""

import copy
import io

import pytest
import torch
from torch.nn.utils import parametrize, prune

import amp
from helpers import DTYPES
from helpers.models import Batch, Pair, make_model
from helpers.o2 import static_o2
from helpers.state import step_cleanly


# -- forward casting ---------------------------------------------------------------------------------


class Recorder(torch.nn.Module):
    """Returns a nest of tensors and records the dtypes it was called with."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(3, 3)
        self.seen = []

    def forward(self, x, extra=None, *, batch=None):
        self.seen.append(
            (x.dtype, extra[0].dtype if extra else None, batch.image.dtype if batch else None)
        )
        y = self.linear(x)
        return {"out": y, "pair": Pair(y, torch.arange(2)), "list": [y.sum()]}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_o2_casts_inputs_and_outputs_through_nests(dtype):
    model = Recorder()
    amp.initialize(
        model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2", dtype=dtype, verbosity=0
    )
    try:
        out = model(
            torch.randn(2, 3), [torch.randn(2)], batch=Batch(torch.randn(2), torch.arange(2))
        )
        assert model.seen == [(dtype, dtype, dtype)]
        assert out["out"].dtype is torch.float32 and type(out["pair"]) is Pair
        assert out["pair"].second.dtype is torch.int64 and out["list"][0].dtype is torch.float32
    finally:
        amp.deinitialize()


def test_cast_model_outputs_and_o0_input_casting():
    model = Recorder()
    amp.initialize(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        opt_level="O2",
        cast_model_outputs=torch.float16,
        verbosity=0,
    )
    try:
        assert model(torch.randn(2, 3))["out"].dtype is torch.float16
    finally:
        amp.deinitialize()
    model = Recorder()
    amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O0", verbosity=0)
    try:
        model(torch.randn(2, 3, dtype=torch.bfloat16))
        assert model.seen == [(torch.float32, None, None)]
    finally:
        amp.deinitialize()


def test_o1_with_cast_model_outputs_casts_outputs_only():
    model = Recorder()
    amp.initialize(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        opt_level="O1",
        cast_model_outputs=torch.float16,
        verbosity=0,
    )
    try:
        out = model(torch.randn(2, 3))
        assert model.seen == [(torch.float32, None, None)] and out["out"].dtype is torch.float16
    finally:
        amp.deinitialize()


def test_user_hooks_see_their_own_inputs_and_cast_outputs():
    model = Recorder()
    seen = []
    model.register_forward_pre_hook(lambda module, args: seen.append(("pre", args[0].dtype)))
    model.register_forward_hook(
        lambda module, args, output: seen.append(("post", output["out"].dtype))
    )
    amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2", verbosity=0)
    try:
        model(torch.randn(2, 3))
    finally:
        amp.deinitialize()
    assert seen == [("pre", torch.float32), ("post", torch.float32)]


def test_data_parallel_replicas_cast_too():
    model = Recorder()
    amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2", verbosity=0)
    try:
        replica = model._replicate_for_data_parallel()  # what DataParallel makes per device
        out = replica(torch.randn(2, 3))
        assert replica.seen[-1][0] is torch.float16 and out["out"].dtype is torch.float32
        assert copy.deepcopy(model)(torch.randn(2, 3))["out"].dtype is torch.float32
    finally:
        amp.deinitialize()


# -- weights ------------------------------------------------------------------------------------------


def _convnet():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3),
        torch.nn.BatchNorm2d(4),
        torch.nn.ReLU(),
        torch.nn.Flatten(),
        torch.nn.Linear(4 * 6 * 6, 2),
    )


@pytest.mark.parametrize(
    "opt_level,keep_bn,bn_dtype",
    [
        ("O2", None, torch.float32),
        ("O2", False, torch.float16),
        ("O3", None, torch.float16),
        ("O3", True, torch.float32),
    ],
)
def test_batch_norm_precision(opt_level, keep_bn, bn_dtype):
    model = _convnet()
    amp.initialize(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        opt_level=opt_level,
        keep_batchnorm_fp32=keep_bn,
        verbosity=0,
    )
    try:
        assert model[0].weight.dtype is torch.float16 and model[4].weight.dtype is torch.float16
        assert model[1].weight.dtype is bn_dtype and model[1].running_mean.dtype is bn_dtype
        assert model[1].num_batches_tracked.dtype is torch.int64
        out = model(torch.randn(2, 3, 8, 8))
        assert out.dtype is torch.float32 and torch.isfinite(out).all()
    finally:
        amp.deinitialize()


@pytest.mark.parametrize("opt_level", ["O2", "O3"])
def test_state_dict_is_fp32_at_every_level(opt_level):
    model = _convnet()
    amp.initialize(
        model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level=opt_level, verbosity=0
    )
    try:
        for module in [model, model[0], model[1]]:
            for key, value in module.state_dict().items():
                if value.is_floating_point():
                    assert value.dtype is torch.float32, key
        live = model.state_dict(keep_vars=True)
        assert live["0.weight"] is model[0].weight  # keep_vars gives the parameters themselves
    finally:
        amp.deinitialize()


def test_loading_a_model_state_dict_refreshes_the_masters():
    source = _convnet()
    with torch.no_grad():
        for param in source.parameters():
            param.add_(torch.randn_like(param) * 1e-3)
    wanted = copy.deepcopy(source.state_dict())
    model = _convnet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
    try:
        model.load_state_dict(wanted)
        masters = dict(zip([k for k, _ in model.named_parameters()], amp.master_params(optimizer)))
        for name, master in masters.items():
            assert torch.equal(master, wanted[name])  # full precision, not rounded through FP16
        assert torch.equal(model.state_dict()["4.weight"], wanted["4.weight"])
        with pytest.raises(RuntimeError, match="size mismatch"):
            bad = dict(wanted, **{"4.weight": torch.zeros(3, 3)})
            model.load_state_dict(bad)
        assert torch.equal(masters["4.weight"], wanted["4.weight"])
    finally:
        amp.deinitialize()


def test_rnn_module_under_o2():
    model = torch.nn.LSTM(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
    try:
        output, (h, c) = model(torch.randn(5, 2, 4))
        assert output.dtype is torch.float32 and model.weight_ih_l0.dtype is torch.float16
        with amp.scale_loss(output.mean(), optimizer) as scaled:
            scaled.backward()
        optimizer.step()
    finally:
        amp.deinitialize()
    assert all(p.dtype is torch.float32 for p in model.parameters())


def test_o2_frozen_parameters_and_buffers_keep_their_fp32_values():
    model = make_model()
    model.register_buffer("table", torch.linspace(0, 1, 7) / 3)  # not exact in FP16
    model[0].requires_grad_(False)  # frozen, and left out of the optimizer
    exact = copy.deepcopy(model.state_dict())
    optimizer = torch.optim.SGD(model[2].parameters(), lr=0.1)
    amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
    try:
        state = model.state_dict()
        for key in ("0.weight", "0.bias", "table"):
            assert state[key].dtype is torch.float32 and torch.equal(state[key], exact[key]), key
        step_cleanly(model, optimizer)
    finally:
        amp.deinitialize()
    for key in ("0.weight", "0.bias", "table"):
        assert torch.equal(model.state_dict()[key], exact[key]), key


class ModelEmaV2:
    """timm's ModelEmaV2 (timm/utils/model_ema.py), reduced to what it does to the model."""

    def __init__(self, model, decay):
        self.module = copy.deepcopy(model)
        self.decay = decay

    @torch.no_grad()
    def update(self, model):
        for ema_v, model_v in zip(self.module.state_dict().values(), model.state_dict().values()):
            ema_v.copy_(self.decay * ema_v + (1.0 - self.decay) * model_v)


@pytest.mark.parametrize("opt_level", ["O2", "O3"])
def test_updates_through_the_state_dict_reach_the_model(trained, opt_level):
    model, optimizer = trained(opt_level)
    x = torch.randn(3, 4)
    # the model itself: an in-place write through state_dict() changes what it computes with
    for value in model.state_dict().values():
        value.fill_(0.5)
    reference = make_model().half()
    for value in reference.state_dict().values():
        value.fill_(0.5)
    assert torch.equal(model(x), reference(x.half()).float())
    if opt_level == "O2":
        step_cleanly(model, optimizer)  # masters and model stay in step
        for param, master in zip(model.parameters(), amp.master_params(optimizer)):
            assert torch.equal(param, master.half())
    # timm's EMA on a deepcopy of the initialized model follows the model
    ema = ModelEmaV2(model, decay=0.5)
    start = ema.module(x).clone()
    for step in range(3):
        step_cleanly(model, optimizer, step)
        ema.update(model)
    assert not torch.equal(ema.module(x), start)
    expected = copy.deepcopy(ema.module.state_dict())
    for key, value in ema.module.state_dict().items():
        assert value.dtype is torch.float32 and torch.equal(value, expected[key])
    weight = ema.module[0].weight
    assert torch.equal(weight, ema.module.state_dict()["0.weight"].to(weight.dtype))


@pytest.mark.parametrize("opt_level", ["O2", "O3"])
def test_torch_save_of_a_cast_model_keeps_its_hooks(trained, opt_level):
    model, optimizer = trained(opt_level)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    copy_of_model = torch.load(buffer, weights_only=False)
    x = torch.randn(2, 4)
    assert copy_of_model(x).dtype is torch.float32  # the hooks came along
    assert torch.equal(copy_of_model(x), model(x))


# -- a parameter moved after initialize (parametrize, prune), or shared by two models -----------------


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


def _first_master(optimizer):
    """The master of the model's first parameter (amp.master_params keeps the optimizer's order)."""
    return next(iter(amp.master_params(optimizer)))


@pytest.mark.parametrize("how", ["parametrize", "prune"])
def test_a_moved_parameters_state_dict_entry_is_its_master(how):
    model, optimizer = static_o2()
    weight = model[0].weight
    master = _first_master(optimizer)
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
def test_a_load_into_a_moved_parameter_reaches_its_master(how):
    model, optimizer = static_o2()
    key = "0." + _move(model[0], how)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state[key] = torch.full_like(state[key], 0.25)
    model.load_state_dict(state)
    weight = _moved_weight(model[0], how)
    for param in amp.master_params(optimizer):
        param.grad = torch.zeros_like(param)
    optimizer.step()  # a zero-gradient step: the loaded weights must stay
    assert torch.equal(_first_master(optimizer), torch.full((4, 4), 0.25))
    assert torch.equal(weight.float(), torch.full((4, 4), 0.25))
    assert torch.equal(model.state_dict()[key], torch.full((4, 4), 0.25))
    amp.deinitialize()


@pytest.mark.parametrize("how", ["parametrize", "prune"])
def test_a_moved_parameter_trains_and_comes_back_fp32(how):
    """An outside write to the moved FP16 weight reaches its master at the next step, training
    goes on, and amp.deinitialize() gives the moved parameter its master's FP32 value."""
    model, optimizer = static_o2()
    _move(model[0], how)
    weight = _moved_weight(model[0], how)
    with torch.no_grad():
        weight.fill_(0.5)  # outside write, as a mask or a broadcast would make
    for param in amp.master_params(optimizer):
        param.grad = torch.zeros_like(param)
    optimizer.step()
    master = _first_master(optimizer)
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


def test_a_parametrization_removed_again_is_followed_back():
    model, optimizer = static_o2()
    weight = model[0].weight
    master = _first_master(optimizer)
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


def test_a_parameter_shared_between_models_has_one_master_in_both_state_dicts():
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
    master = _first_master(optimizer)
    assert torch.equal(encoder.state_dict()["0.weight"], master)
    assert torch.equal(decoder.state_dict()["1.weight"], master)
    # A write through either state dict is the master's, and reaches both models' forward.
    decoder.state_dict()["1.weight"].fill_(0.125)
    decoder(torch.randn(1, 4))
    assert torch.equal(shared.float(), torch.full((4, 4), 0.125))
    assert torch.equal(encoder.state_dict()["0.weight"], torch.full((4, 4), 0.125))
    amp.deinitialize()
    assert shared.dtype is torch.float32 and torch.equal(shared, torch.full((4, 4), 0.125))

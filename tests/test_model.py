"""O0/O2/O3 models: weight casting, batch norm, forward input/output casting, FP32 state dicts."""

import collections
import copy
import dataclasses

import pytest
import torch

import amp
from amp.casting.casts import cast_tree
from conftest import DTYPES

Pair = collections.namedtuple("Pair", "first second")


@dataclasses.dataclass
class Batch:
    image: torch.Tensor
    label: torch.Tensor
    note: str = "x"


@dataclasses.dataclass(frozen=True)
class FrozenBatch:
    image: torch.Tensor


class Movable:
    """A custom batch type with a .to() method."""

    def __init__(self, tensor):
        self.tensor = tensor

    def to(self, dtype):
        return Movable(self.tensor.to(dtype))


# -- cast_tree ----------------------------------------------------------------------------------------


def test_cast_tree_preserves_container_types():
    f, i, d = torch.randn(2), torch.arange(2), torch.randn(2, dtype=torch.float64)
    tree = {
        "tuple": (f, i),
        "list": [f, [f, "text"]],
        "named": Pair(f, i),
        "ordered": collections.OrderedDict(a=f),
        "default": collections.defaultdict(list, a=f),
        "batch": Batch(f, i),
        "frozen": FrozenBatch(f),
        "movable": Movable(f),
        "double": d,
        "module": torch.nn.Linear(2, 2),
        "none": None,
    }
    cast = cast_tree(tree, torch.float16)
    assert type(cast) is dict
    assert type(cast["tuple"]) is tuple and cast["tuple"][0].dtype is torch.float16
    assert cast["tuple"][1] is i  # integers untouched
    assert (
        type(cast["list"]) is list
        and cast["list"][1][0].dtype is torch.float16
        and cast["list"][1][1] == "text"
    )
    assert type(cast["named"]) is Pair and cast["named"].first.dtype is torch.float16
    assert (
        type(cast["ordered"]) is collections.OrderedDict
        and cast["ordered"]["a"].dtype is torch.float16
    )
    assert (
        type(cast["default"]) is collections.defaultdict and cast["default"].default_factory is list
    )
    assert type(cast["batch"]) is Batch and cast["batch"].image.dtype is torch.float16
    assert cast["batch"].label is i and cast["batch"].note == "x"
    assert (
        cast["frozen"].image.dtype is torch.float16 and tree["frozen"].image.dtype is torch.float32
    )
    assert cast["movable"].tensor.dtype is torch.float16
    assert cast["double"] is d  # float64 is asked for deliberately
    assert cast["module"] is tree["module"] and tree["module"].weight.dtype is torch.float32


def test_cast_tree_returns_unchanged_values_as_the_same_objects():
    tree = ([torch.arange(3)], {"a": torch.randn(2, dtype=torch.float16)})
    assert cast_tree(tree, torch.float16) is tree


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

"""Where an inf/NaN started (amp/diagnostics/origin.py): amp watches the step after a skip, names
the module, removes its hooks; a watch no step ends holds a bounded number of checks."""

import gc
import json
import logging
import warnings

import pytest
import torch
from torch.nn.modules import module as nn_module

import amp
from amp._state import amp_state
from helpers import TESTS
from helpers.models import make_model, overflowing_net
from helpers.ranks import run_two_ranks


def global_hooks():
    return len(nn_module._global_forward_hooks) + len(nn_module._global_forward_pre_hooks)


def tensor_hooks(model):
    return sum(len(p._backward_hooks or {}) for p in model.parameters())


class Body(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.act = torch.nn.ReLU(inplace=True)  # module backward hooks would break on this

    def forward(self, x):
        return self.act(self.lin(x))


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(4, 8)
        self.body = Body()
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x):
        return self.head(self.body(self.inp(x)))


def net(seed=0):
    torch.manual_seed(seed)
    return Net()


def data(step):
    generator = torch.Generator().manual_seed(step)
    return torch.randn(16, 4, generator=generator), torch.randn(16, 1, generator=generator)


def train(model, optimizer, steps, loss_fn=None, loss_id=0):
    reports = []
    for step in range(steps):
        optimizer.zero_grad()
        x, y = data(step)
        out = model(x)
        loss = loss_fn(out, y) if loss_fn else ((out.float() - y) ** 2).mean()
        with amp.scale_loss(loss, optimizer, loss_id=loss_id) as scaled:
            scaled.backward()
        optimizer.step()
        reports.append(amp.last_overflow())
    return reports


def blow_up(linear, factor=1e5):
    with torch.no_grad():
        linear.weight.mul_(factor)


@pytest.mark.parametrize("opt_level", ["O1", "O2", "O3"])
def test_a_forward_overflow_is_traced_to_its_module_at_every_level(opt_level):
    model = net()
    blow_up(model.body.lin)  # FP32 is fine, float16 overflows in body.lin
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp.initialize(
        model, optimizer, opt_level=opt_level, loss_scale="dynamic", verbosity=0
    )
    try:
        with pytest.warns(amp.NonFiniteLossWarning):
            first, second, third = train(model, optimizer, 3)
        assert first.origin is None  # nothing was watched before the first skip
        for report in (second, third):
            origin = report.origin
            assert (origin.module, origin.phase, origin.op) == ("body.lin", "forward", "Linear")
            assert origin.dtype is torch.float16 and origin.kind == "inf"
    finally:
        amp.deinitialize()


def test_the_origin_inside_one_layer_of_a_transformer():
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0)
    model = torch.nn.TransformerEncoder(layer, 3, enable_nested_tensor=False)
    blow_up(model.layers[1].linear2, 1e6)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O1", verbosity=0)
    try:
        reports = []
        with pytest.warns(amp.NonFiniteLossWarning, match="layers.1.linear2"):
            for step in range(2):
                optimizer.zero_grad()
                x = torch.randn(5, 3, 16, generator=torch.Generator().manual_seed(step))
                loss = model(x).float().pow(2).mean()
                with amp.scale_loss(loss, optimizer) as scaled:
                    scaled.backward()
                optimizer.step()
                reports.append(amp.last_overflow())
    finally:
        amp.deinitialize()
    origin = reports[1].origin
    assert (origin.module, origin.phase, origin.op) == ("layers.1.linear2", "forward", "Linear")


class Spike(torch.autograd.Function):
    """Identity forward; a backward that overflows."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * 1e30


class Spiky(torch.nn.Module):
    def forward(self, x):
        return Spike.apply(x)


def test_a_backward_only_overflow_from_a_custom_autograd_function():
    model = net()
    model.body.act = Spiky()  # forward finite, backward inf: the loss stays finite
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O1", verbosity=0)
    try:
        first, second = train(model, optimizer, 2)
        scale = amp.state_dict()["loss_scaler0"]["loss_scale"]
    finally:
        amp.deinitialize()
    assert not first.nonfinite_loss and first.origin is None
    origin = second.origin
    assert (origin.module, origin.phase, origin.op) == ("body.act", "backward", "Spiky")
    assert origin.kind == "inf" and origin.dtype is torch.float16  # body.lin ran in float16
    assert scale == 2.0**16 / 4  # a gradient overflow still backs off, twice


def test_nothing_is_installed_before_a_skip_and_no_hook_is_left_behind():
    model = net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp.initialize(
        model, optimizer, opt_level="O1", verbosity=0, max_loss_scale=2.0**8
    )
    kept = []
    model.body.lin.register_forward_hook(lambda m, a, out: kept.append(out))
    try:
        train(model, optimizer, 2)
        assert global_hooks() == 0 and tensor_hooks(model) == 0
        assert not amp_state.origin_watch.armed
        blow_up(model.body.lin)
        train(model, optimizer, 1)  # skipped: armed for the next step only
        assert amp_state.origin_watch.armed and global_hooks() == 2
        optimizer.zero_grad()
        with torch.no_grad():
            model.body.lin.weight.div_(1e5)
        kept.clear()
        with pytest.warns(amp.NonFiniteLossWarning, match="at one step"):
            train(model, optimizer, 1)  # the watched step, clean: the watch ends with it
        assert amp.last_overflow().origin is None
        assert global_hooks() == 0 and tensor_hooks(model) == 0
        assert all(not out._backward_hooks for out in kept)
        blow_up(model.body.lin)
        train(model, optimizer, 1)
        assert global_hooks() == 2
    finally:
        amp.deinitialize()  # while armed: deinitialize removes the hooks too
    assert global_hooks() == 0 and tensor_hooks(model) == 0


def test_several_models_and_losses():
    torch.manual_seed(0)
    first = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))
    second = net(1)
    blow_up(second.head, 1e6)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (first, second)]
    models, optimizers = amp.initialize(
        [first, second], optimizers, opt_level="O2", num_losses=2, verbosity=0
    )
    try:
        with pytest.warns(amp.NonFiniteLossWarning):
            for step in range(2):
                x, y = data(step)
                for loss_id, (model, optimizer) in enumerate(zip(models, optimizers)):
                    optimizer.zero_grad()
                    loss = ((model(x).float() - y) ** 2).mean()
                    with amp.scale_loss(loss, optimizer, loss_id=loss_id) as scaled:
                        scaled.backward()
                    optimizer.step()
        report = amp.last_overflow()
    finally:
        amp.deinitialize()
    assert report.loss_id == 1
    assert (report.origin.module, report.origin.op) == ("head", "Linear")


def test_verbosity_one_names_the_origin_once_known(caplog):
    model = net()
    blow_up(model.body.lin)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O1", verbosity=1)
    try:
        with caplog.at_level(logging.INFO, logger="amp"), pytest.warns(amp.NonFiniteLossWarning):
            caplog.clear()
            train(model, optimizer, 2)
    finally:
        amp.deinitialize()
    skips = [r.message for r in caplog.records if "Skipping step" in r.message]
    assert len(skips) == 2
    assert "body.lin" not in skips[0]
    assert (
        "it started in the output of module 'body.lin' in forward (Linear, float16, inf)"
        in skips[1]
    )


def grad_scaler_run(scaler_class, steps=4):
    model = net()
    blow_up(model.body.lin, 1e6)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = scaler_class()
    scales, reports = [], []
    for step in range(steps):
        optimizer.zero_grad()
        x, y = data(step)
        with amp.autocast(dtype=torch.float16):
            out = model(x)
        loss = ((out.float() - y) ** 2).mean()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        scales.append(scaler.get_scale())
        reports.append(amp.last_overflow())
    return model, scales, reports


def test_grad_scaler_reports_the_origin_and_stays_identical_to_torch():
    ours, our_scales, reports = grad_scaler_run(amp.GradScaler)
    assert global_hooks() == 2  # the last step skipped: the next one would be watched
    amp_state.origin_watch.disarm()
    theirs, their_scales, _ = grad_scaler_run(lambda: torch.amp.GradScaler("cpu"))
    assert our_scales == their_scales == [2.0**15, 2.0**14, 2.0**13, 2.0**12]
    for a, b in zip(ours.parameters(), theirs.parameters()):
        assert torch.equal(a, b)
    assert reports[0].loss_id is None and reports[0].origin is None
    assert "param_groups[0]['params'][2]" in reports[0].params  # body.lin.weight, by position
    assert reports[0].loss_scale == 2.0**15
    origin = reports[1].origin
    assert (origin.module, origin.phase, origin.dtype) == ("body.lin", "forward", torch.float16)


def test_a_grad_scaler_dropped_after_a_skip_leaves_no_hook_and_no_stale_watch():
    """The last step of a GradScaler run skipped, then the scaler went (the run ended): nobody
    will step to end that watch. Its hooks go at the next module call, and a later run is
    watched from its own first skip (a stale watch made its second step unwatched)."""
    grad_scaler_run(amp.GradScaler)  # the scaler is dropped on return
    assert amp_state.origin_watch.armed and global_hooks() == 2
    net()(torch.randn(2, 4))  # evaluation after the run: the watch sees its owners are gone
    assert not amp_state.origin_watch.armed and global_hooks() == 0
    grad_scaler_run(amp.GradScaler)
    test_a_forward_overflow_is_traced_to_its_module_at_every_level("O1")


def test_under_ddp_each_rank_names_its_own_origin(tmp_path):
    """Two gloo processes: rank 1's input overflows in layer "0", rank 0's does not. Both skip
    and keep the scale (rank 1's loss is not finite); each names what it saw."""
    run_two_ranks(TESTS / "helpers" / "origin_ddp_rank.py", tmp_path)
    rank0, rank1 = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert rank0["scales"] == rank1["scales"] == [2.0**16] * 3  # kept on both ranks
    assert rank1["origins"] == [None, None, ["0", "forward", "inf"]]
    assert rank0["origins"] == [None, None, None]  # its own forward and backward were finite
    assert len(rank1["warnings"]) == 1 and "module '0'" in rank1["warnings"][0]


def test_the_watch_stays_out_of_the_users_trace():
    model = net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O1", verbosity=0)
    try:
        with amp.trace() as plain:
            model(data(0)[0])
        x, y = data(0)
        with amp.scale_loss(((model(x).float() - y) ** 2).mean(), optimizer) as scaled:
            scaled.backward()
            model.head.weight.grad.view(-1)[0] = float("inf")  # skipped: the next step is watched
        optimizer.step()
        assert global_hooks() == 2
        with amp.trace() as watched:
            model(data(0)[0])
    finally:
        amp.deinitialize()
    assert watched.ops() == plain.ops()


# -- a watch that no step ends ---------------------------------------------------------------------


def _skip_last_step(opt_level="O1"):
    """Train two steps, the last one skipped (loss * inf): the watch is armed, no step follows."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level, verbosity=0)
    x = torch.randn(16, 4)
    for factor in (1.0, float("inf")):
        optimizer.zero_grad()
        loss = model(x).float().pow(2).mean() * factor
        with amp.scale_loss(loss, optimizer) as scaled:
            scaled.backward()
        optimizer.step()
    assert amp.last_overflow() is not None and amp_state.origin_watch.armed
    return model, optimizer, x


def _watched_step_overflowing_in_the_last_layer(model, optimizer, x, after_backward=None):
    """The watched step, in which float16 overflows in the last layer ("2"); `after_backward()`
    runs between backward and step. Returns the origin amp found."""
    with torch.no_grad():
        model[2].weight.mul_(1e6)
    optimizer.zero_grad()
    loss = model(x).float().pow(2).mean()
    with amp.scale_loss(loss, optimizer) as scaled:
        scaled.backward()  # the checks are read inside backward's hooks
    if after_backward is not None:
        after_backward()
    with pytest.warns(
        amp.NonFiniteLossWarning, match="It started in the output of module '2' in forward"
    ):  # the watched step's loss is not finite
        optimizer.step()
    return amp.last_overflow().origin


def _live_tensors():
    gc.collect()
    # By type: isinstance reads __class__, and torch's deprecated `torch.distributed.reduce_op`
    # object, among gc's objects, warns when read so.
    return sum(issubclass(type(o), torch.Tensor) for o in gc.get_objects())


@pytest.mark.usefixtures("deinitialized")
def test_evaluation_after_a_skipped_last_step_holds_a_bounded_number_of_checks():
    model, _, x = _skip_last_step()
    model.eval()
    with torch.no_grad():
        model(x)
        before = _live_tensors()
        for _ in range(1500):  # 4 module outputs each: 6000 checks
            model(x)
        held = _live_tensors() - before
    assert amp_state.origin_watch.armed  # still watching, holding at most 4096 checks
    assert held < 4096, held


@pytest.mark.usefixtures("deinitialized")
def test_checks_read_without_a_step_keep_the_first_bad_one_and_stop_watching(monkeypatch):
    from amp.diagnostics import origin
    from torch.nn.modules import module as nn_module

    monkeypatch.setattr(origin, "_HELD", 8)
    model, optimizer, x = _skip_last_step("O2")
    with torch.no_grad():
        for _ in range(5):  # 20 clean checks: read and dropped twice, still watching
            model(x)
    assert amp_state.origin_watch.armed and len(nn_module._global_forward_hooks) == 1

    def hooks_are_gone():  # found inside backward: nothing more is watched
        assert len(nn_module._global_forward_hooks) == 0
        assert not any(p._backward_hooks for p in model.parameters())

    found = _watched_step_overflowing_in_the_last_layer(model, optimizer, x, hooks_are_gone)
    assert (found.module, found.phase) == ("2", "forward")


@pytest.mark.usefixtures("deinitialized")
def test_an_audit_between_a_skip_and_the_watched_step_is_not_taken_for_that_step():
    model, optimizer, x = _skip_last_step()  # the next step is watched
    # What the warning advises: audit, here on a batch that overflows the first layer.
    amp.audit(lambda: model(x * 1e5).float().pow(2).mean(), model)
    found = _watched_step_overflowing_in_the_last_layer(model, optimizer, x)
    assert (found.module, found.phase) == ("2", "forward")


# -- fp32_modules at O2/O3: a kept module whose output overflows the model dtype -------------------


@pytest.mark.usefixtures("deinitialized")
@pytest.mark.parametrize("opt_level", ["O2", "O3"])
def test_a_kept_modules_output_that_overflows_when_cast_back_is_named_as_the_origin(opt_level):
    model, x, y = overflowing_net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer = amp.initialize(
        model,
        optimizer,
        opt_level=opt_level,
        loss_scale="dynamic",
        verbosity=0,
        fp32_modules=["body"],
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", amp.NonFiniteLossWarning)
        for _ in range(2):
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x).float(), y)
            with amp.scale_loss(loss, optimizer) as scaled:
                scaled.backward()
            optimizer.step()
    found = amp.last_overflow().origin
    # Not 'norm', which only received the inf: 'body' in float16, after the cast back.
    assert (found.module, found.phase, found.dtype) == ("body", "forward", torch.float16)


def test_the_overflow_origin_names_the_fp8_layer():
    """float16 at O2 + float8: an FP8 matmul's float16 output overflows; amp skips the step,
    watches the next one and names the layer."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.Linear(32, 16)
    )
    with torch.no_grad():
        model[2].weight.mul_(3e4)  # its output is beyond float16's 65504
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    model, optimizer = amp.initialize(
        model, optimizer, opt_level="O2", float8="tensorwise", verbosity=0
    )
    x = torch.randn(16, 16) * 10
    try:
        with pytest.warns(amp.NonFiniteLossWarning, match="module '2' in forward"):
            for _ in range(2):
                with amp.trace() as trace:
                    loss = model(x).float().square().mean()
                with amp.scale_loss(loss, optimizer) as scaled:
                    scaled.backward()
                optimizer.step()
                optimizer.zero_grad()
        report = amp.last_overflow()
    finally:
        amp.deinitialize()
    assert [r.ran_in for r in trace.records][:2] == [torch.float8_e4m3fn] * 2
    origin = report.origin
    assert (origin.module, origin.phase, origin.op) == ("2", "forward", "Linear")
    assert origin.dtype is torch.float16 and origin.kind == "inf"

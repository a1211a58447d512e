"""The Lightning 2 precision plugin (amp/lightning/plugin.py), AmpPrecision in
lightning.pytorch.Trainer: the same training as amp by hand, bit for bit."""

import os
import sys
import warnings

from types import SimpleNamespace

import pytest
import torch

import amp

pytest.importorskip("lightning.pytorch")  # installed by `make test` (the `lightning` extra)

sys.path.insert(0, os.path.dirname(__file__))

import lightning.pytorch as L  # noqa: E402
from amp.lightning import AmpPrecision  # noqa: E402
from lightning_helpers import (  # noqa: E402
    BATCH,
    BATCHES,
    Capture,
    FarBehind,
    Regressor,
    WaitsPerStep,
    amp_loop,
    assert_same_tensors,
    data,
    loader,
    make_net,
    poison,
    trainer,
)

LEVELS = [
    ("O1", torch.float16),
    ("O1", torch.bfloat16),
    ("O2", torch.float16),
    ("O2", torch.bfloat16),
    ("O3", torch.bfloat16),  # with a dynamic loss scale, so that the overflow is skipped
]


@pytest.mark.parametrize("opt_level,dtype", LEVELS)
def test_trainer_trains_as_amp_by_hand_and_skips_an_overflow(opt_level, dtype):
    plugin = AmpPrecision(opt_level=opt_level, dtype=dtype, verbosity=0, loss_scale="dynamic")
    model, capture = Regressor(overflow_at={1}), Capture()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(plugin, [capture], max_steps=BATCHES).fit(model, loader())
    expected = amp_loop(opt_level, dtype, BATCHES, overflow_at={1}, loss_scale="dynamic")

    assert model.losses == expected["losses"]
    assert_same_tensors(capture.weights, expected["weights"])  # FP32 state dict (masters at O2)
    assert_same_tensors(capture.low, expected["low"])  # the weights the model computes with
    assert_same_tensors(capture.optimizer, expected["optimizer"])
    assert capture.plugin["amp"]["loss_scaler0"]["loss_scale"] == expected["scale"]
    # The injected overflow skipped its step, visibly; the model computed in dtype meanwhile.
    assert plugin.skipped_steps >= 1 and capture.overflow is not None
    assert capture.plugin["skipped_steps"] == plugin.skipped_steps
    weight = {"O1": torch.float32, "O2": dtype, "O3": dtype}[opt_level]
    master = torch.float32 if opt_level != "O3" else dtype
    assert set(model.seen) == {(weight, master)}
    # The step schedule follows the Trainer's steps, skipped ones too, without torch's warning
    # that the scheduler stepped before the optimizer.
    assert capture.lr == pytest.approx(1e-2 * 0.9**BATCHES)
    assert not [w for w in caught if "lr_scheduler.step()" in str(w.message)]
    # Teardown undid amp: FP32 weights again, equal to the masters at O2.
    assert model.net[0].weight.dtype is torch.float32
    if opt_level == "O2":
        assert torch.equal(model.net[0].weight, capture.weights["0.weight"])


def test_a_skipped_step_changes_nothing_and_says_so(caplog):
    plugin = AmpPrecision(opt_level="O2", dtype=torch.bfloat16, verbosity=1)
    before = {}

    class Watch(Capture):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            if batch_idx == 2:
                before["masters"] = [
                    p.detach().clone() for p in plugin.main_params(trainer.optimizers[0])
                ]
                before["state"] = {
                    k: v.clone() for k, v in trainer.optimizers[0].state_dict()["state"][0].items()
                }

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if batch_idx == 2:
                assert plugin.last_step_skipped
                masters = [p.detach() for p in plugin.main_params(trainer.optimizers[0])]
                assert all(torch.equal(a, b) for a, b in zip(masters, before["masters"]))
                state = trainer.optimizers[0].state_dict()["state"][0]
                assert all(torch.equal(state[k], v) for k, v in before["state"].items())
            else:
                assert not plugin.last_step_skipped

    watch = Watch()
    with caplog.at_level("INFO", logger="amp"):
        trainer(plugin, [watch], max_steps=BATCHES).fit(Regressor(overflow_at={2}), loader())
    assert plugin.skipped_steps == 1
    assert "Gradient overflow.  Skipping step" in caplog.text
    assert watch.overflow.params == (
        "net.0.weight",
        "net.0.bias",
        "net.1.weight",
        "net.1.bias",
        "net.3.weight",
        "net.3.bias",
    )


def test_next_to_lightnings_bf16_mixed():
    """O1 bf16 casts the same ops as torch.autocast here: the losses agree closely; after an
    overflow bf16-mixed trains on NaN while amp skips the step and goes on."""
    runs = {}
    for name, kwargs in (
        ("amp O1", dict(plugin=AmpPrecision("O1", torch.bfloat16, verbosity=0))),
        ("amp O2", dict(plugin=AmpPrecision("O2", torch.bfloat16, verbosity=0))),
        ("bf16-mixed", dict(precision="bf16-mixed")),
    ):
        clean, broken = Regressor(), Regressor(overflow_at={1})
        trainer(max_steps=BATCHES, **kwargs).fit(clean, loader())
        trainer(max_steps=BATCHES, **kwargs).fit(broken, loader())
        runs[name] = (clean.losses, broken.losses)
    torch.testing.assert_close(runs["amp O1"][0], runs["bf16-mixed"][0], rtol=2e-2, atol=0)
    torch.testing.assert_close(runs["amp O2"][0], runs["bf16-mixed"][0], rtol=5e-2, atol=0)
    assert all(torch.isfinite(torch.tensor(runs["amp O2"][1])))
    assert torch.isnan(torch.tensor(runs["bf16-mixed"][1][-1]))


def test_gradient_clipping_clips_the_fp32_masters(monkeypatch):
    clipped = []
    original = torch.nn.utils.clip_grad_norm_

    def spy(parameters, *args, **kwargs):
        parameters = list(parameters)
        clipped.append([p.dtype for p in parameters])
        return original(parameters, *args, **kwargs)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", spy)
    plugin = AmpPrecision("O2", torch.bfloat16, verbosity=0)
    model, capture = Regressor(), Capture()
    trainer(plugin, [capture], max_steps=2, gradient_clip_val=0.05).fit(model, loader())
    assert clipped and all(dtypes == [torch.float32] * 6 for dtypes in clipped)
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", original)
    expected = amp_loop("O2", torch.bfloat16, 2, clip=0.05)
    assert_same_tensors(capture.weights, expected["weights"])


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_gradient_accumulation(opt_level):
    plugin = AmpPrecision(opt_level, torch.float16, verbosity=0)
    model, capture = Regressor(overflow_at={1}), Capture()
    run = trainer(plugin, [capture], max_steps=2, accumulate_grad_batches=2)
    run.fit(model, loader())
    expected = amp_loop(opt_level, torch.float16, 2, overflow_at={1}, accumulate=2)
    assert model.losses == expected["losses"]
    assert_same_tensors(capture.weights, expected["weights"])
    assert_same_tensors(capture.optimizer, expected["optimizer"])
    assert run.global_step == 2 and capture.lr == pytest.approx(1e-2 * 0.9**2)


@pytest.mark.parametrize(
    "opt_level,saved", [("O2", "on_train_end"), ("O2", "after fit"), ("O1", "after fit")]
)
def test_resume_from_a_lightning_checkpoint_is_bit_exact(tmp_path, opt_level, saved):
    """Two epochs straight, or one, a checkpoint, and the second in a fresh Trainer: the same
    model, masters, optimizer state and loss scale, bit for bit (an overflow in each half). The
    checkpoint is saved in a callback, or by `trainer.save_checkpoint` after `fit` (teardown has
    undone amp then; the plugin keeps amp's state, as "16-mixed" keeps its GradScaler's)."""

    def plugin():
        return AmpPrecision(opt_level, torch.float16, verbosity=0)

    straight = Capture()
    trainer(plugin(), [straight], max_epochs=2).fit(Regressor(overflow_at={1, 5}), loader())

    class SaveAtEnd(Capture):
        def on_train_end(self, trainer, module):
            if saved == "on_train_end":
                trainer.save_checkpoint(tmp_path / "half.ckpt")

    first = trainer(plugin(), [SaveAtEnd()], max_epochs=1)
    first.fit(Regressor(overflow_at={1, 5}), loader())
    if saved == "after fit":
        first.save_checkpoint(tmp_path / "half.ckpt")
    checkpoint = torch.load(tmp_path / "half.ckpt", weights_only=True)
    # Two steps skipped in the first epoch (the first, at 65536, and the injected overflow).
    assert checkpoint["AmpPrecision"]["amp"]["loss_scaler0"]["loss_scale"] == 16384.0
    assert checkpoint["AmpPrecision"]["skipped_steps"] == 2
    assert checkpoint["state_dict"]["net.0.weight"].dtype is torch.float32

    resumed = Capture()
    model = Regressor(overflow_at={1, 5})
    resumed_plugin = plugin()
    trainer(resumed_plugin, [resumed], max_epochs=2).fit(
        model, loader(), ckpt_path=tmp_path / "half.ckpt"
    )
    assert_same_tensors(resumed.weights, straight.weights)
    assert_same_tensors(resumed.low, straight.low)
    assert_same_tensors(resumed.masters, straight.masters)
    assert_same_tensors(resumed.optimizer, straight.optimizer)
    assert resumed.plugin == straight.plugin
    assert resumed_plugin.skipped_steps == straight.plugin["skipped_steps"] >= 2
    # After fit the plugin still holds the state the run ended with, as a checkpoint shows it.
    assert resumed_plugin.state_dict() == straight.plugin


def test_compact_state_trains_as_amp_by_hand_and_resumes_bit_exact(tmp_path):
    """master_weights="compact" and optimizer_state="int8" reach amp.initialize through the
    plugin: the Trainer (an overflow skipped, Lightning's clipping on the masters) trains as amp
    by hand, and a run resumed from a checkpoint ends as the straight run, bit for bit."""
    options = dict(master_weights="compact", optimizer_state="int8", loss_scale="dynamic")

    def plugin():
        return AmpPrecision("O2", torch.bfloat16, verbosity=0, **options)

    def run(callbacks, **kwargs):
        return trainer(plugin(), callbacks, gradient_clip_val=0.05, **kwargs)

    model, capture = Regressor(overflow_at={1}), Capture()
    run([capture], max_steps=BATCHES).fit(model, loader())
    expected = amp_loop("O2", torch.bfloat16, BATCHES, overflow_at={1}, clip=0.05, **options)
    assert model.losses == expected["losses"]
    assert_same_tensors(capture.weights, expected["weights"])
    assert_same_tensors(capture.low, expected["low"])
    assert_same_tensors(capture.optimizer, expected["optimizer"])
    # the net's rows (8 and 16 elements) are no blocks of 32: FP32 moments under "int8"
    assert set(capture.optimizer["state"][0]) == {"exp_avg", "exp_avg_sq", "step", "master_correction"}
    assert capture.plugin["skipped_steps"] >= 1

    straight = Capture()
    run([straight], max_epochs=2).fit(Regressor(overflow_at={1, 5}), loader())
    first = run([Capture()], max_epochs=1)
    first.fit(Regressor(overflow_at={1, 5}), loader())
    first.save_checkpoint(tmp_path / "half.ckpt")
    resumed = Capture()
    run([resumed], max_epochs=2).fit(
        Regressor(overflow_at={1, 5}), loader(), ckpt_path=tmp_path / "half.ckpt"
    )
    assert_same_tensors(resumed.weights, straight.weights)
    assert_same_tensors(resumed.low, straight.low)
    assert_same_tensors(resumed.optimizer, straight.optimizer)
    assert resumed.plugin == straight.plugin


def test_validate_alone_casts_the_model_and_gives_it_back():
    seen = []

    class Evaluated(Regressor):
        def validation_step(self, batch, batch_idx):
            seen.append((self.net[0].weight.dtype, batch[0].dtype, self(batch[0]).dtype))

    model = Evaluated()
    trainer(AmpPrecision("O2", torch.bfloat16, verbosity=0)).validate(model, loader())
    assert set(seen) == {(torch.bfloat16, torch.bfloat16, torch.float32)}
    assert model.net[0].weight.dtype is torch.float32


def test_manual_optimization_with_two_optimizers_and_two_loss_scalers():
    class TwoParts(Regressor):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            x, y = batch
            first, second = self.optimizers()
            for optimizer, loss_id in ((first, 0), (second, 1)):
                optimizer.zero_grad()
                out = self(x)
                if loss_id == 1 and batch_idx == 1:
                    poison(out)
                loss = torch.nn.functional.mse_loss(out, y)
                self.manual_backward(loss, loss_id=loss_id)
                optimizer.step()
                self.losses.append(loss.item())

        def configure_optimizers(self):
            return (
                torch.optim.SGD(self.net[:2].parameters(), lr=1e-2),
                torch.optim.SGD(self.net[3].parameters(), lr=1e-2),
            )

    plugin = AmpPrecision("O2", torch.bfloat16, num_losses=2, verbosity=0)
    model, capture = TwoParts(), Capture()
    trainer(plugin, [capture], max_epochs=1).fit(model, loader())
    assert plugin.skipped_steps == 1 and capture.overflow.loss_id == 1
    scalers = capture.plugin["amp"]
    assert scalers["loss_scaler0"]["loss_scale"] == 65536.0
    assert scalers["loss_scaler1"]["loss_scale"] == 32768.0
    assert all(torch.isfinite(torch.tensor(model.losses)))


class GAN(L.LightningModule):
    """A generator and a discriminator, each with its optimizer, trained by hand in
    training_step as Lightning's GAN examples do; at the steps in `poison_d_at` an inf reaches the
    discriminator's weight gradient in the generator's backward (its step never uses it)."""

    def __init__(self, toggle=False, poison_d_at=()):
        super().__init__()
        self.automatic_optimization = False
        torch.manual_seed(3)
        self.generator = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh())
        self.discriminator = torch.nn.Sequential(
            torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1)
        )
        self.toggle, self.poison_d_at, self.losses = toggle, set(poison_d_at), []

    def training_step(self, batch, batch_idx):
        g_opt, d_opt = self.optimizers()
        def backward(loss, optimizer):
            self.manual_backward(loss)  # no optimizer named

        def clip(optimizer):
            self.clip_gradients(optimizer, gradient_clip_val=0.05, gradient_clip_algorithm="norm")

        self.losses.extend(gan_step(self, batch[0], batch_idx, g_opt, d_opt, backward, clip))

    def configure_optimizers(self):
        return (
            torch.optim.AdamW(self.generator.parameters(), lr=1e-2),
            torch.optim.AdamW(self.discriminator.parameters(), lr=1e-2),
        )


def gan_step(gan, real, step, g_opt, d_opt, backward, clip):
    """One generator step then one discriminator step, its gradients clipped by `clip`;
    `backward(loss, optimizer)`: the plugin's manual_backward, or amp.scale_loss on the optimizer
    whose step follows."""
    noise = torch.randn(real.shape[0], 4, generator=torch.Generator().manual_seed(step))
    if gan.toggle:
        gan.toggle_optimizer(g_opt)
    g_opt.zero_grad()
    fake = gan.generator(noise)
    loss_g = torch.nn.functional.softplus(-gan.discriminator(fake)).mean()
    hook = None
    if step in gan.poison_d_at:
        weight = gan.discriminator[0].weight
        hook = weight.register_hook(lambda grad: torch.full_like(grad, float("inf")))
    backward(loss_g, g_opt)
    if hook is not None:
        hook.remove()
    g_opt.step()
    if gan.toggle:
        gan.untoggle_optimizer(g_opt)
        gan.toggle_optimizer(d_opt)
    d_opt.zero_grad()
    scores = gan.discriminator(torch.cat([fake.detach(), real]))
    loss_d = torch.nn.functional.softplus(scores * torch.tensor([[1.0]] * 8 + [[-1.0]] * 8)).mean()
    backward(loss_d, d_opt)
    clip(d_opt)
    d_opt.step()
    if gan.toggle:
        gan.untoggle_optimizer(d_opt)
    return [loss_g.item(), loss_d.item()]


@pytest.mark.parametrize("toggle", [False, True])
def test_manual_backward_is_checked_for_the_optimizer_whose_step_follows(toggle):
    """An inf in the discriminator's gradient during the generator's backward neither skips the
    generator's step nor halves the scale: as amp by hand (scale_loss(loss_g, g_opt)) and
    Lightning's "16-mixed", each optimizer's step checks its own gradients. Lightning's clipping
    before a step clips them unscaled."""
    poison = set() if toggle else {1}  # toggled, the discriminator gets no gradient there
    by_hand = GAN(toggle, poison)
    g_opt, d_opt = by_hand.configure_optimizers()
    _, (g_opt, d_opt) = amp.initialize(
        [by_hand.generator, by_hand.discriminator], [g_opt, d_opt], opt_level="O1", verbosity=0
    )
    try:
        by_hand._trainer = SimpleNamespace(optimizers=[g_opt, d_opt])  # for toggle_optimizer

        def scale_loss(loss, optimizer):
            with amp.scale_loss(loss, optimizer) as scaled:
                scaled.backward()

        def clip(optimizer):
            torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), 0.05)

        losses = []
        for step, (x, _) in enumerate(loader()):
            losses += gan_step(by_hand, x, step, g_opt, d_opt, scale_loss, clip)
        expected_scale = amp.state_dict()["loss_scaler0"]["loss_scale"]
    finally:
        by_hand._trainer = None
        amp.deinitialize()

    class Weights(L.Callback):
        def on_train_end(self, trainer, module):
            self.scale = trainer.precision_plugin.state_dict()["amp"]["loss_scaler0"]
            self.weights = {k: v.clone() for k, v in module.state_dict().items()}

    plugin = AmpPrecision("O1", torch.float16, verbosity=0)
    model, weights = GAN(toggle, poison), Weights()
    trainer(plugin, [weights], max_epochs=1).fit(model, loader())
    assert model.losses == losses
    assert_same_tensors(weights.weights, by_hand.state_dict())
    assert weights.scale["loss_scale"] == expected_scale == 65536.0
    assert plugin.skipped_steps == 0


class SharedParameters(L.LightningModule):
    """Lightning's test_multiple_optimizers_manual_amp: two optimizers over the same parameters,
    one backward for the first, two (retain_graph) for the second; an inf in the second's
    gradients at the steps in `poison_at`."""

    def __init__(self, poison_at=()):
        super().__init__()
        self.automatic_optimization = False
        torch.manual_seed(5)
        self.layer = torch.nn.Linear(8, 1)
        self.poison_at, self.steps = set(poison_at), []

    def training_step(self, batch, batch_idx):
        first, second = self.optimizers()
        self.steps.append(shared_step(self, batch, batch_idx, first, second, self.manual_backward))

    def configure_optimizers(self):
        return (
            torch.optim.SGD(self.layer.parameters(), lr=0.1),
            torch.optim.SGD(self.layer.parameters(), lr=0.1),
        )


def shared_step(module, batch, step, first, second, backward):
    """What the two optimizers did, stepped or not: `backward(loss, **kwargs)`."""
    x, y = batch
    before = module.layer.weight.detach().clone()
    loss = torch.nn.functional.mse_loss(module.layer(x), y)
    backward(loss)
    assert module.layer.weight.grad is not None
    first.step()
    first.zero_grad()
    stepped = not torch.equal(module.layer.weight, before)
    before = module.layer.weight.detach().clone()
    out = module.layer(x)
    if step in module.poison_at:
        poison(out)
    loss = torch.nn.functional.mse_loss(out, y)
    backward(loss, retain_graph=True)
    backward(loss)
    second.step()
    second.zero_grad()
    assert module.layer.weight.grad is None
    return stepped, not torch.equal(module.layer.weight, before)


def test_two_optimizers_over_the_same_parameters_at_o1():
    """Each optimizer's step unscales and checks the shared gradients once, as amp by hand
    (one scale_loss per optimizer) does, bit for bit; an inf skips the second's step only."""
    by_hand = SharedParameters(poison_at={1})
    first, second = by_hand.configure_optimizers()
    options = dict(max_loss_scale=128.0, verbosity=0)  # no overflow but the one injected
    _, (first, second) = amp.initialize(by_hand, [first, second], opt_level="O1", **options)
    steps = []
    try:
        for step, (x, y) in enumerate(loader()):
            weight = by_hand.layer.weight
            before = weight.detach().clone()
            with amp.scale_loss(torch.nn.functional.mse_loss(by_hand.layer(x), y), first) as s:
                s.backward()
            first.step()
            first.zero_grad()
            stepped, before = not torch.equal(weight, before), weight.detach().clone()
            out = by_hand.layer(x)
            if step == 1:
                poison(out)
            loss = torch.nn.functional.mse_loss(out, y)
            with amp.scale_loss(loss, second, delay_unscale=True) as s:
                s.backward(retain_graph=True)
            with amp.scale_loss(loss, second) as s:
                s.backward()
            second.step()
            second.zero_grad()
            steps.append((stepped, not torch.equal(weight, before)))
        expected = {k: v.clone() for k, v in by_hand.state_dict().items()}
        scale = amp.state_dict()["loss_scaler0"]["loss_scale"]
    finally:
        amp.deinitialize()
    plugin, model = AmpPrecision("O1", torch.float16, **options), SharedParameters({1})
    trainer(plugin, max_epochs=1).fit(model, loader())
    assert model.steps == steps == [(True, True), (True, False), (True, True), (True, True)]
    assert_same_tensors(model.state_dict(), expected)
    assert plugin.state_dict()["amp"]["loss_scaler0"]["loss_scale"] == scale == 64.0
    assert plugin.skipped_steps == 1


def test_what_amp_refuses_is_refused_with_amps_message(one_rank_group):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = Regressor()
    fully_shard(model.net, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float16))
    model._trainer = SimpleNamespace(state=SimpleNamespace(fn="fit"), strategy=None)
    optimizer = torch.optim.AdamW(model.parameters())
    plugin = AmpPrecision("O2", torch.bfloat16, verbosity=0)  # FSDP2 would cast to fp16 again
    with pytest.raises(RuntimeError, match=r"computes in torch.float16 .* two casts"):
        plugin.connect(model, [optimizer], [])
    assert plugin.state_dict() == {}
    plugin.teardown()  # what the Trainer does after a failed set-up: nothing to undo


def test_an_lbfgs_step_is_refused():
    with pytest.raises(TypeError, match=r"LBFGS"):
        plugin = AmpPrecision("O1", verbosity=0)
        plugin._trainer_base = object
        plugin.optimizer_step(torch.optim.LBFGS([torch.nn.Parameter(torch.ones(1))]), None, print)


def test_pytorch_lightning_trainer_takes_the_same_plugin():
    """The package `pytorch_lightning` (a second copy of Lightning 2 that `lightning` installs
    beside itself) takes the same AmpPrecision object, and trains as amp by hand."""
    pl = pytest.importorskip("pytorch_lightning")

    class Classic(pl.LightningModule):
        training_step = Regressor.training_step
        forward = Regressor.forward
        configure_optimizers = Regressor.configure_optimizers

        def __init__(self):
            super().__init__()
            self.net, self.overflow_at, self.lr, self.schedule = Regressor().net, {1}, 1e-2, True
            self.losses, self.seen = [], []

    class Capture(pl.Callback):
        def on_train_end(self, trainer, module):
            self.weights = {k: v.clone() for k, v in module.net.state_dict().items()}
            self.skipped = trainer.precision_plugin.skipped_steps

    plugin, capture, model = AmpPrecision("O2", torch.bfloat16, verbosity=0), Capture(), Classic()
    pl.Trainer(
        accelerator="cpu",
        max_steps=BATCHES,
        plugins=[plugin],
        callbacks=[capture],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    ).fit(model, loader())
    expected = amp_loop("O2", torch.bfloat16, BATCHES, overflow_at={1})
    assert model.losses == expected["losses"] and capture.skipped == 1
    assert_same_tensors(capture.weights, expected["weights"])


def _waits_by_hand(opt_level, steps, overflow_at, far):
    """The host's waits in each step of the same training written by hand with amp."""
    net = make_net()
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
    net, optimizer = amp.initialize(net, optimizer, opt_level=opt_level, verbosity=0)
    x, y = data(steps)
    per_step = []
    try:
        for step in range(steps):
            before = far.waits
            rows = slice(step % BATCHES * BATCH, (step % BATCHES + 1) * BATCH)
            xb = x[rows].half() if opt_level == "O2" else x[rows]
            out = net(xb)
            if step in overflow_at:
                poison(out)
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(out, y[rows].to(out.dtype))
            with amp.scale_loss(loss, optimizer) as scaled:
                scaled.backward()
            optimizer.step()
            per_step.append(far.waits - before)
    finally:
        amp.deinitialize()
    return per_step


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_a_step_waits_for_the_device_no_more_than_amp_by_hand(monkeypatch, opt_level):
    """Whether a step was skipped is learned when the host next needs it (a logging step, the
    end of an epoch, skipped_steps read, a checkpoint), not at every step: on a device far
    behind the host the plugin's steps wait exactly as often as amp's own steps by hand."""
    far = FarBehind(monkeypatch)
    by_hand = _waits_by_hand(opt_level, 2 * BATCHES, {1}, far)
    plugin = AmpPrecision(opt_level, torch.float16, verbosity=0)
    waits = WaitsPerStep(far)
    trainer(plugin, [waits], max_epochs=2).fit(Regressor(overflow_at={1}, schedule=False), loader())
    assert waits.per_step == by_hand
    assert plugin.skipped_steps == 2  # learned now: the first step (at 65536) and the overflow

    # With log=True the plugin waits at the steps the Trainer writes logs at, and the epochs' last.
    plugin = AmpPrecision(opt_level, torch.float16, verbosity=0, log=True)
    waits = WaitsPerStep(far)
    run = trainer(plugin, [waits], max_epochs=2, log_every_n_steps=3)
    run.fit(Regressor(overflow_at={1}, schedule=False), loader())
    logged = {2, 5} | {3, 7}  # every third step; the last of each epoch
    more = [step for step, (a, b) in enumerate(zip(waits.per_step, by_hand)) if a > b]
    assert set(more) <= logged and run.callback_metrics["amp/skipped_steps"].item() == 2.0

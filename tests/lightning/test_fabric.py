"""amp.lightning.setup for Fabric (amp/lightning/fabric.py) with AmpPrecision: amp by hand, bit
for bit."""

import copy
import os
import sys

import pytest
import torch

pytest.importorskip("lightning.pytorch")  # installed by `make test` (the `lightning` extra)

sys.path.insert(0, os.path.dirname(__file__))

import amp.lightning  # noqa: E402
from amp.lightning import AmpPrecision  # noqa: E402
from lightning.fabric import Fabric  # noqa: E402
from lightning_helpers import (  # noqa: E402
    BATCH,
    BATCHES,
    amp_loop,
    assert_same_tensors,
    loader,
    make_net,
    poison,
)


def fabric_run(opt_level, dtype, steps=range(BATCHES), overflow_at=(), resume=None, save=None):
    """Train with Fabric (steps of one pass over loader()); save or resume a checkpoint."""
    precision = AmpPrecision(opt_level, dtype, verbosity=0)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[precision])
    net = make_net()
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
    model, optimizer = amp.lightning.setup(fabric, net, optimizer)
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "amp": precision}
    try:
        if resume is not None:
            fabric.load(resume, state)
        losses, seen, outputs = [], set(), set()
        batches = list(loader())
        for step in steps:
            x, y = batches[step]
            optimizer.zero_grad()
            out = model(x)
            outputs.add(out.dtype)
            if step in overflow_at:
                poison(out)
            loss = torch.nn.functional.mse_loss(out, y)
            fabric.backward(loss)
            optimizer.step()
            scheduler.step()
            losses.append(loss.item())
            seen.add((net[0].weight.dtype, next(precision.main_params(optimizer)).dtype))
        if save is not None:
            fabric.save(save, state)
        result = dict(
            losses=losses,
            seen=seen,
            outputs=outputs,
            weights={k: v.clone() for k, v in net.state_dict().items()},
            low=[p.detach().clone() for p in net.parameters()],
            optimizer=optimizer.state_dict(),
            plugin=precision.state_dict(),
            scale=amp.state_dict()["loss_scaler0"]["loss_scale"],
        )
    finally:
        precision.teardown()
    return result


@pytest.mark.parametrize(
    "opt_level,dtype",
    [("O1", torch.float16), ("O1", torch.bfloat16), ("O2", torch.float16), ("O2", torch.bfloat16)],
)
def test_fabric_trains_as_amp_by_hand_and_skips_an_overflow(opt_level, dtype):
    run = fabric_run(opt_level, dtype, overflow_at={1})
    expected = amp_loop(opt_level, dtype, BATCHES, overflow_at={1}, cast_targets=False)
    assert run["losses"] == expected["losses"]
    assert_same_tensors(run["weights"], expected["weights"])
    assert_same_tensors(run["low"], expected["low"])
    assert_same_tensors(run["optimizer"], expected["optimizer"])
    assert run["scale"] == expected["scale"] and run["plugin"]["skipped_steps"] >= 1
    assert run["seen"] == {(torch.float32 if opt_level == "O1" else dtype, torch.float32)}
    assert run["outputs"] == {torch.float32}  # as from Lightning's mixed plugins, O1 too


def test_fabric_resume_is_bit_exact(tmp_path):
    straight = fabric_run("O2", torch.float16, overflow_at={1, 3})
    fabric_run("O2", torch.float16, steps=range(2), overflow_at={1}, save=tmp_path / "half.ckpt")
    resumed = fabric_run(
        "O2", torch.float16, steps=range(2, BATCHES), overflow_at={3}, resume=tmp_path / "half.ckpt"
    )
    assert resumed["losses"] == straight["losses"][2:]
    for key in ("weights", "low", "optimizer"):
        assert_same_tensors(resumed[key], straight[key])
    assert resumed["plugin"] == straight["plugin"]


def test_fabric_setup_without_amp_says_what_to_call():
    precision = AmpPrecision("O2", verbosity=0)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[precision])
    net = make_net()
    with pytest.raises(RuntimeError, match=r"amp.lightning.setup\(fabric, model, optimizer\)"):
        fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    plain = Fabric(accelerator="cpu", devices=1)
    with pytest.raises(TypeError, match="not AmpPrecision"):
        amp.lightning.setup(plain, net, torch.optim.SGD(net.parameters(), lr=0.1))


def test_importing_amp_or_amp_lightning_does_not_import_lightning():
    import subprocess

    code = (
        "import sys, amp, amp.lightning; "
        "assert not any(m.split('.')[0] in ('lightning', 'pytorch_lightning', "
        "'lightning_fabric') for m in sys.modules), sorted(sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]


def test_one_plugin_object_is_every_installed_lightnings_precision():
    plugin = AmpPrecision("O2", torch.float16)
    import lightning.fabric.plugins as fabric_plugins
    import lightning.pytorch.plugins as trainer_plugins

    assert isinstance(plugin, (trainer_plugins.Precision, fabric_plugins.Precision))
    pl = pytest.importorskip("pytorch_lightning")
    import lightning_fabric

    assert isinstance(plugin, pl.plugins.Precision)
    assert isinstance(plugin, lightning_fabric.plugins.Precision)
    assert plugin.precision == "16-mixed"
    assert AmpPrecision("O3").precision == "bf16-true" and AmpPrecision("O0").precision == "32-true"


def test_state_loaded_before_setup_is_applied_at_setup():
    precision = AmpPrecision("O2", torch.float16, verbosity=0)
    precision.load_state_dict(
        {"amp": {"loss_scaler0": {"loss_scale": 512.0, "unskipped": 7}}, "skipped_steps": 3}
    )
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[precision])
    net = make_net()
    amp.lightning.setup(fabric, net, torch.optim.SGD(net.parameters(), lr=0.1))
    try:
        state = precision.state_dict()
        assert state["amp"]["loss_scaler0"]["loss_scale"] == 512.0
        assert state["amp"]["loss_scaler0"]["unskipped"] == 7 and state["skipped_steps"] == 3
    finally:
        precision.teardown()
    assert precision.state_dict() == state  # kept after teardown, for a checkpoint saved then


def _gan(seed=3):
    torch.manual_seed(seed)
    generator = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh())
    discriminator = torch.nn.Sequential(
        torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1)
    )
    return (
        generator,
        discriminator,
        torch.optim.AdamW(generator.parameters(), lr=1e-2),
        torch.optim.AdamW(discriminator.parameters(), lr=1e-2),
    )


def _dcgan_steps(generator, discriminator, g_opt, d_opt, backward, inputs, outputs):
    """Lightning's DCGAN Fabric example in small: the discriminator's step, then the
    generator's, whose backward at step 1 puts an inf into the discriminator's weight gradient
    (its step never uses it). `inputs` / `outputs`: Fabric's casts (amp by hand)."""
    sign = torch.tensor([[1.0]] * BATCH + [[-1.0]] * BATCH)
    losses = []
    for step, (real, _) in enumerate(loader()):
        noise = torch.randn(BATCH, 4, generator=torch.Generator().manual_seed(step))
        d_opt.zero_grad()
        fake = outputs(generator(inputs(noise)))
        scores = outputs(discriminator(inputs(torch.cat([fake.detach(), real]))))
        loss_d = torch.nn.functional.softplus(scores * sign).mean()
        backward(loss_d, d_opt)
        d_opt.step()
        g_opt.zero_grad()
        loss_g = torch.nn.functional.softplus(-outputs(discriminator(inputs(fake)))).mean()
        hook = None
        if step == 1:
            weight = getattr(discriminator, "module", discriminator)[0].weight  # in Fabric's
            hook = weight.register_hook(lambda grad: torch.full_like(grad, float("inf")))
        backward(loss_g, g_opt)
        if hook is not None:
            hook.remove()
        g_opt.step()
        losses += [loss_d.item(), loss_g.item()]
    return losses


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_models_set_up_one_after_another_train_as_amp_by_hand(opt_level):
    """Lightning's DCGAN Fabric example sets up each model with its optimizer in turn:
    amp.initialize runs again with both at the second, and they train as amp by hand with both
    in one amp.initialize, bit for bit; an inf in the discriminator's gradient during the
    generator's backward skips nothing (each step checks its own optimizer's gradients)."""
    generator, discriminator, g_opt, d_opt = _gan()
    models, (g_opt, d_opt) = amp.initialize(
        [generator, discriminator], [g_opt, d_opt], opt_level=opt_level, verbosity=0
    )
    low = torch.float16 if opt_level == "O2" else None
    try:

        def scale_loss(loss, optimizer):
            with amp.scale_loss(loss, optimizer) as scaled:
                scaled.backward()

        expected = _dcgan_steps(
            generator,
            discriminator,
            g_opt,
            d_opt,
            scale_loss,
            lambda x: x.to(low) if low else x,
            lambda y: y.float(),
        )
        weights = [copy.deepcopy(m.state_dict()) for m in models]
        scale = amp.state_dict()["loss_scaler0"]["loss_scale"]
    finally:
        amp.deinitialize()

    precision = AmpPrecision(opt_level, torch.float16, verbosity=0)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[precision])
    generator, discriminator, g_opt, d_opt = _gan()
    g_model, g_opt = amp.lightning.setup(fabric, generator, g_opt)
    d_model, d_opt = amp.lightning.setup(fabric, discriminator, d_opt)
    try:
        assert discriminator[0].weight.dtype == generator[0].weight.dtype == (low or torch.float32)
        losses = _dcgan_steps(
            g_model,
            d_model,
            g_opt,
            d_opt,
            lambda loss, optimizer: fabric.backward(loss),
            lambda x: x,
            lambda y: y,
        )
        assert losses == expected
        assert_same_tensors([generator.state_dict(), discriminator.state_dict()], weights)
        assert precision.state_dict()["amp"]["loss_scaler0"]["loss_scale"] == scale == 65536.0
        assert precision.skipped_steps == 0
    finally:
        precision.teardown()

"""amp.lightning.setup for Fabric (amp/lightning/fabric.py) with AmpPrecision: amp by hand, bit
for bit."""

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

"""amp inside Lightning 2: AmpPrecision in the Trainer and in Fabric, next to Lightning's own bf16-mixed.

A small LightningModule (a regression MLP on synthetic data) trains with each variant; at one step
an inf gradient is injected (`--overflow-step`, -1 for none). Printed for each: the losses, the
dtype of the weights and of what the optimizer steps (amp's FP32 masters at O2), the steps skipped
and the loss scale. Then a Lightning checkpoint taken halfway resumes bit for bit, and Fabric
trains the same way through `amp.lightning.setup`.

    python examples/lightning.py
    python examples/lightning.py --steps 20 --overflow-step -1
"""

import copy
import logging
import os
import sys
import tempfile

import torch

# This file is named lightning.py: `import lightning` must find the package, not this script (run
# as a script, its folder is sys.path[0]). Imported as `lightning` itself, because examples/ is on
# sys.path (tests/test_examples.py puts it there), it hands over to the package: the import returns
# what sys.modules holds once this file has run.
_HERE = os.path.dirname(os.path.abspath(__file__))
if __name__ == "lightning":
    del sys.modules[__name__]
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
try:
    import lightning.pytorch as L
    from lightning.fabric import Fabric
except ImportError:  # pragma: no cover - the message is the point
    sys.exit(
        "This example needs Lightning: pip install 'amp[lightning]' (or pip install lightning)."
    )
sys.path.insert(0, _HERE)
from common import device_argument  # noqa: E402
from common import parser as example_parser  # noqa: E402

import amp  # noqa: E402
import amp.lightning  # noqa: E402

from amp.lightning import AmpPrecision  # noqa: E402

VARIANTS = {
    "bf16-mixed (Lightning)": dict(precision="bf16-mixed"),
    "amp O1 bf16": dict(opt_level="O1", dtype=torch.bfloat16),
    "amp O2 bf16": dict(opt_level="O2", dtype=torch.bfloat16),
    "amp O1 fp16": dict(opt_level="O1", dtype=torch.float16),
    "amp O2 fp16": dict(opt_level="O2", dtype=torch.float16),
    "amp O2 compact int8": dict(
        opt_level="O2", dtype=torch.bfloat16, master_weights="compact", optimizer_state="int8"
    ),
}
RESUMED = ("amp O1 bf16", "amp O2 fp16", "amp O2 compact int8")


def make_data(batches=3, batch=16, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(batches * batch, 32, generator=generator)
    w = torch.randn(32, 1, generator=generator)
    return torch.utils.data.TensorDataset(
        x, x @ w + 0.1 * torch.randn(len(x), 1, generator=generator)
    )


def make_net(seed=1):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.LayerNorm(64), torch.nn.GELU(), torch.nn.Linear(64, 1)
    )


class Regression(L.LightningModule):
    """MSE regression; an inf gradient at `overflow_step` (a finite loss whose backward overflows)."""

    def __init__(self, overflow_step=-1):
        super().__init__()
        self.net = make_net()
        self.overflow_step = overflow_step
        self.losses, self.dtypes = [], None

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self(x)
        if self.global_step == self.overflow_step:
            out.register_hook(lambda grad: torch.full_like(grad, float("inf")))
        loss = torch.nn.functional.mse_loss(out, y)
        self.losses.append(loss.item())
        stepped = next(iter(self.trainer.precision_plugin.main_params(self.trainer.optimizers[0])))
        self.dtypes = (self.net[0].weight.dtype, stepped.dtype)
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=2e-2)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.97**step)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }


class End(L.Callback):
    """What a run ends with, read before the Trainer tears amp down."""

    def __init__(self, save=None):
        self.save = save

    def on_train_end(self, trainer, module):
        plugin = trainer.precision_plugin
        self.state = {k: v.clone() for k, v in module.state_dict().items()}
        self.optimizer = copy.deepcopy(trainer.optimizers[0].state_dict())
        self.amp = copy.deepcopy(plugin.state_dict()) if isinstance(plugin, AmpPrecision) else {}
        if self.save:
            trainer.save_checkpoint(self.save)


def trainer(args, plugin_or_precision, callbacks, **kwargs):
    options = dict(
        accelerator=args.device,
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    options.update(kwargs)
    return L.Trainer(callbacks=callbacks, **plugin_or_precision, **options)


def compare_variants(args, data):
    print(f"Trainer, {args.steps} steps, inf gradient injected at step {args.overflow_step}:")
    header = f"  {'variant':<24} {'losses (first, 3 last)':<34} {'weights':<9} {'stepped':<9} skipped  scale"
    print(header)
    for name, options in VARIANTS.items():
        model, end = Regression(args.overflow_step), End()
        if "precision" in options:
            chosen, plugin = options, None
        else:
            plugin = AmpPrecision(**options, verbosity=0)
            chosen = dict(plugins=[plugin])
        loader = torch.utils.data.DataLoader(data, batch_size=16)
        trainer(args, chosen, [end], max_steps=args.steps).fit(model, loader)
        losses = ", ".join(f"{loss:.3g}" for loss in [model.losses[0]] + model.losses[-3:])
        weights, stepped = (str(d).replace("torch.", "") for d in model.dtypes)
        skipped = plugin.skipped_steps if plugin else "-"
        scale = end.amp["amp"]["loss_scaler0"]["loss_scale"] if plugin else "-"
        print(f"  {name:<24} {losses:<34} {weights:<9} {stepped:<9} {skipped!s:<8} {scale}")


def resume(args, data, folder):
    # Whole epochs (3 steps each): a loader without state restarts its epoch on resume.
    epochs = max(2, args.steps // 3)
    half = epochs // 2
    print(
        f"\nResume: {half} epochs, a Lightning checkpoint, then a fresh Trainer to {epochs} epochs:"
    )
    overflow_steps = args.overflow_step
    same = True
    for name in RESUMED:

        def run(epochs, save=None, ckpt=None, options=VARIANTS[name]):
            end = End(save)
            loader = torch.utils.data.DataLoader(data, batch_size=16)
            plugin = AmpPrecision(**options, verbosity=0)
            run_trainer = trainer(args, dict(plugins=[plugin]), [end], max_epochs=epochs)
            run_trainer.fit(Regression(overflow_steps), loader, ckpt_path=ckpt)
            return end

        straight = run(epochs)
        path = os.path.join(folder, f"half-{name.replace(' ', '-')}.ckpt")
        run(half, save=path)
        resumed = run(epochs, ckpt=path)
        same_model = all(torch.equal(straight.state[k], resumed.state[k]) for k in straight.state)
        same_optimizer = _same(straight.optimizer, resumed.optimizer)
        print(
            f"  {name}: model (FP32 values) bit-identical: {same_model}; optimizer state (with "
            f"masters): {same_optimizer}; amp state: {straight.amp == resumed.amp} "
            f"({straight.amp['amp']})"
        )
        same = same and same_model and same_optimizer and straight.amp == resumed.amp
    return same


def fabric(args, data):
    print(
        f"\nFabric, amp O2 bf16 through amp.lightning.setup, inf gradient at step {args.overflow_step}:"
    )
    precision = AmpPrecision("O2", torch.bfloat16, verbosity=0)
    fabric = Fabric(accelerator=args.device, devices=1, plugins=[precision])
    net = make_net()
    model, optimizer = amp.lightning.setup(
        fabric, net, torch.optim.AdamW(net.parameters(), lr=2e-2)
    )
    loader = fabric.setup_dataloaders(torch.utils.data.DataLoader(data, batch_size=16))
    losses = []
    try:
        batches = [batch for _ in range(args.steps) for batch in loader][: args.steps]
        for step, (x, y) in enumerate(batches):
            optimizer.zero_grad()
            out = model(x)
            if step == args.overflow_step:
                out.register_hook(lambda grad: torch.full_like(grad, float("inf")))
            loss = torch.nn.functional.mse_loss(out, y)
            fabric.backward(loss)
            optimizer.step()
            losses.append(loss.item())
        stepped = next(iter(precision.main_params(optimizer))).dtype
        print(
            f"  losses {losses[0]:.3g} ... {losses[-1]:.3g}; weights {net[0].weight.dtype}, stepped "
            f"{stepped}; skipped {precision.skipped_steps}; {amp.last_overflow()}"
        )
    finally:
        precision.teardown()
    return losses


def _same(a, b):
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return a == b


def main(argv=None):
    parser = example_parser(__doc__)
    device_argument(parser)
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps per run")
    parser.add_argument("--overflow-step", type=int, default=3, help="step with an inf gradient")
    args = parser.parse_args(argv)
    for name in ("lightning.pytorch", "lightning.fabric"):  # "GPU available: False", tips
        logging.getLogger(name).setLevel(logging.WARNING)
    data = make_data()  # 3 batches an epoch: the checkpoint of `resume` falls between epochs
    compare_variants(args, data)
    with tempfile.TemporaryDirectory() as folder:
        resumed = resume(args, data, folder)
    fabric(args, data)
    return resumed


if __name__ == "__main__":
    main()

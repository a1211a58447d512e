"""A tiny LightningModule, its data, and the hand-written amp loop it must match bit for bit."""

import copy

import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, TensorDataset

import amp

BATCH = 8
BATCHES = 4  # one epoch


def data(batches=BATCHES, batch=BATCH, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(batches * batch, 8, generator=generator)
    y = x.sum(1, keepdim=True) + 0.1 * torch.randn(batches * batch, 1, generator=generator)
    return x, y


def loader(batches=BATCHES, batch=BATCH):
    return DataLoader(TensorDataset(*data(batches, batch)), batch_size=batch, shuffle=False)


def make_net(seed=1):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.ReLU(), torch.nn.Linear(16, 1)
    )


def poison(output):
    """Make every gradient behind `output` inf: an overflow with a finite loss."""
    output.register_hook(lambda grad: torch.full_like(grad, float("inf")))


class Regressor(L.LightningModule):
    """Linear-LayerNorm-ReLU-Linear regression; an inf gradient at the steps in `overflow_at`."""

    def __init__(self, overflow_at=(), lr=1e-2, schedule=True):
        super().__init__()
        self.net = make_net()
        self.overflow_at = set(overflow_at)
        self.lr = lr
        self.schedule = schedule
        self.losses = []
        self.seen = []  # (weight dtype, master dtype) inside training_step

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self(x)
        if self.global_step in self.overflow_at:
            poison(out)
        loss = torch.nn.functional.mse_loss(out, y)
        self.losses.append(loss.item())
        masters = list(self.trainer.precision_plugin.main_params(self.trainer.optimizers[0]))
        self.seen.append((self.net[0].weight.dtype, masters[0].dtype))
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr)
        if not self.schedule:
            return optimizer
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }


class Capture(L.Callback):
    """What a run ends with, taken before the Trainer tears amp down."""

    def on_train_end(self, trainer, module):
        optimizer = trainer.optimizers[0]
        self.weights = {k: v.clone() for k, v in module.net.state_dict().items()}
        self.low = [p.detach().clone() for p in module.net.parameters()]
        self.masters = [p.detach().clone() for p in trainer.precision_plugin.main_params(optimizer)]
        self.optimizer = copy.deepcopy(optimizer.state_dict())
        self.plugin = copy.deepcopy(trainer.precision_plugin.state_dict())
        self.lr = optimizer.param_groups[0]["lr"]
        self.overflow = amp.last_overflow()


class FarBehind:
    """amp's overflow checks as on a GPU far behind the host: the copy of a check's state reaches
    the host only when the host waits for it (`Check.arrived(wait=True)`). `waits` counts those
    waits; `at_steps` records it at every step of a Trainer run (a Callback)."""

    def __init__(self, monkeypatch):
        from amp.scaling.device_scale import Check

        self.waits = 0
        far = self

        class Event:  # a CUDA event that has not completed until synchronized
            def query(self):
                return False

            def synchronize(self):
                far.waits += 1

        def post(check, host):
            host[0].copy_(check.state)
            check.host = host
            check.host_scale.unread.append(check)
            check.event = Event()

        monkeypatch.setattr(Check, "post", post)


class WaitsPerStep(L.Callback):
    """The host's waits for the device in each training batch (FarBehind's count)."""

    def __init__(self, far):
        self.far, self.per_step = far, []

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.before = self.far.waits

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.per_step.append(self.far.waits - self.before)


def trainer(plugin=None, callbacks=(), **kwargs):
    options = dict(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    options.update(kwargs)
    if plugin is not None:
        options["plugins"] = [plugin]
    return L.Trainer(callbacks=list(callbacks), **options)


def amp_loop(
    opt_level,
    dtype,
    steps,
    overflow_at=(),
    accumulate=1,
    lr=1e-2,
    clip=None,
    cast_targets=True,
    **kwargs,
):
    """The same training written by hand with amp: what the plugin must reproduce exactly."""
    net = make_net()
    optimizer = torch.optim.AdamW(net.parameters(), lr=lr)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
    net, optimizer = amp.initialize(
        net, optimizer, opt_level=opt_level, dtype=dtype, verbosity=0, **kwargs
    )
    x, y = data(max(BATCHES, steps * accumulate))  # the rows loader() gives
    losses = []
    try:
        for step in range(steps):
            optimizer.zero_grad()
            for micro in range(accumulate):
                rows = slice(
                    (step * accumulate + micro) * BATCH, (step * accumulate + micro + 1) * BATCH
                )
                xb, yb = x[rows], y[rows]
                if opt_level in ("O2", "O3"):
                    xb = xb.to(dtype)  # the plugin's convert_input: the Trainer's whole batch
                    yb = yb.to(dtype) if cast_targets else yb  # Fabric's model inputs only
                out = net(xb)
                if step in overflow_at:
                    poison(out)
                loss = torch.nn.functional.mse_loss(out, yb)
                losses.append(loss.item())
                with amp.scale_loss(loss / accumulate, optimizer) as scaled:
                    scaled.backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), clip)
            optimizer.step()
            scheduler.step()
        weights = {k: v.clone() for k, v in net.state_dict().items()}
        low = [p.detach().clone() for p in net.parameters()]
        state = copy.deepcopy(optimizer.state_dict())
        scale = amp.state_dict()["loss_scaler0"]["loss_scale"]
    finally:
        amp.deinitialize()
    return dict(losses=losses, weights=weights, low=low, optimizer=state, scale=scale)


def assert_same_tensors(a, b):
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            assert_same_tensors(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same_tensors(x, y)
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), (a, b)
    else:
        assert a == b, (a, b)

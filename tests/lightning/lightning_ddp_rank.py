"""One rank of the two-rank gloo tests: the Trainer and Fabric under DDP with AmpPrecision.

Run as `python lightning_ddp_rank.py OUT` with RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT set (as torchrun sets them). Each rank trains on its own half of every batch, with an
inf gradient on rank 1 only at one step, accumulating two micro-batches per step, and saves
what it ended with to OUT/<scenario>-rank<r>.pt.
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))

import amp  # noqa: E402
import amp.lightning  # noqa: E402
import lightning.pytorch as L  # noqa: E402
from amp.lightning import AmpPrecision  # noqa: E402
from lightning.fabric import Fabric  # noqa: E402
from lightning_helpers import Capture, Regressor, data, loader, make_net, poison  # noqa: E402

from helpers import ranks  # noqa: E402

RANK = int(os.environ["RANK"])
OVERFLOW_STEP = 1


class RankRegressor(Regressor):
    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self(x)
        if RANK == 1 and self.global_step == OVERFLOW_STEP:
            poison(out)
        loss = torch.nn.functional.mse_loss(out, y)
        self.losses.append(loss.item())
        return loss


def trainer_run(out):
    plugin = AmpPrecision("O2", torch.float16, max_loss_scale=2.0**10, verbosity=0)
    model, capture = RankRegressor(), Capture()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        plugins=[plugin],
        callbacks=[capture],
        max_epochs=1,
        accumulate_grad_batches=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, loader(batches=16))
    torch.save(
        dict(
            losses=model.losses,
            weights=capture.weights,
            masters=capture.masters,
            optimizer=capture.optimizer,
            plugin=capture.plugin,
            steps=trainer.global_step,
            initial=make_net().state_dict(),
        ),
        os.path.join(out, f"trainer-rank{RANK}.pt"),
    )


def fabric_run(out):
    precision = AmpPrecision("O2", torch.bfloat16, verbosity=0)
    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp", plugins=[precision])
    fabric.launch()
    net = make_net()
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
    model, optimizer = amp.lightning.setup(fabric, net, optimizer)
    x, y = data(batches=8)
    losses = []
    try:
        for step in range(4):
            optimizer.zero_grad()
            for micro in range(2):
                rows = slice(
                    ((step * 2 + micro) * 2 + RANK) * 4, ((step * 2 + micro) * 2 + RANK + 1) * 4
                )
                with fabric.no_backward_sync(model, enabled=micro == 0):
                    output = model(x[rows])
                    if RANK == 1 and step == OVERFLOW_STEP:
                        poison(output)
                    loss = torch.nn.functional.mse_loss(output, y[rows]) / 2
                    fabric.backward(loss)
                losses.append(loss.item())
            optimizer.step()
        result = dict(
            losses=losses,
            weights={k: v.clone() for k, v in net.state_dict().items()},
            masters=[p.detach().clone() for p in precision.main_params(optimizer)],
            optimizer=optimizer.state_dict(),
            plugin=precision.state_dict(),
            initial=make_net().state_dict(),
        )
    finally:
        precision.teardown()
    torch.save(result, os.path.join(out, f"fabric-rank{RANK}.pt"))


def fabric_two_models_run(out):
    """Two models set up one after the other (amp.initialize runs again at the second, and the
    first one's DDP wrapper is made again around its cast parameters), each with its optimizer;
    one backward, both steps, each checking its own gradients."""
    precision = AmpPrecision("O2", torch.float16, max_loss_scale=2.0**10, verbosity=0)
    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp", plugins=[precision])
    fabric.launch()
    net = make_net()
    encoder, head = net[:3], net[3]
    encoder_opt = torch.optim.AdamW(encoder.parameters(), lr=1e-2)
    head_opt = torch.optim.AdamW(head.parameters(), lr=1e-2)
    encoder_model, encoder_opt = amp.lightning.setup(fabric, encoder, encoder_opt)
    head_model, head_opt = amp.lightning.setup(fabric, head, head_opt)
    x, y = data(batches=8)
    losses = []
    try:
        for step in range(4):
            encoder_opt.zero_grad()
            head_opt.zero_grad()
            rows = slice((step * 2 + RANK) * 4, (step * 2 + RANK + 1) * 4)
            output = head_model(encoder_model(x[rows]))
            if RANK == 1 and step == OVERFLOW_STEP:
                poison(output)
            loss = torch.nn.functional.mse_loss(output, y[rows])
            fabric.backward(loss)
            encoder_opt.step()
            head_opt.step()
            losses.append(loss.item())
        result = dict(
            losses=losses,
            weights={k: v.clone() for k, v in net.state_dict().items()},
            masters=[
                p.detach().clone()
                for optimizer in (encoder_opt, head_opt)
                for p in precision.main_params(optimizer)
            ],
            optimizer=[encoder_opt.state_dict(), head_opt.state_dict()],
            plugin=precision.state_dict(),
            initial=make_net().state_dict(),
        )
    finally:
        precision.teardown()
    torch.save(result, os.path.join(out, f"fabric-two-models-rank{RANK}.pt"))


if __name__ == "__main__":
    trainer_run(sys.argv[1])
    fabric_run(sys.argv[1])
    fabric_two_models_run(sys.argv[1])
    ranks.leave()  # results written: no static destructors (gloo aborts in them)

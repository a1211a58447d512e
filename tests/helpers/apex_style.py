"""An apex-style training script, end to end, written as apex's README and L0 tests use the API
(tests/programs/test_apex_style_scripts.py and the resume test run it).

Two models, two optimizers (one wrapped LARC-style), two losses with their own scalers
(`num_losses=2`, `loss_id`), the second loss reaching both models; scales forced through
`amp._amp_state` as apex's L0 tests force them; the LR scheduler gated on `_unskipped` as in
transformers' apex examples; a checkpoint with `amp.state_dict()`.
"""

import io

import torch
import torch.nn.functional as F

import amp
from helpers.larc_like import TrustRatio
from helpers.models import make_model


def data(step):
    generator = torch.Generator().manual_seed(step % 2)  # two batches, seen again and again
    return torch.randn(32, 8, generator=generator), torch.randint(0, 4, (32,), generator=generator)


def run(
    opt_level,
    dtype,
    steps,
    save_at=None,
    resume=None,
    inject_at=None,
    use_amp=True,
    zero="optimizer",
):
    """The script. Returns what the tests look at; `resume` is a checkpoint to start from."""
    model0, model1 = (
        make_model(seed, inputs=8, hidden=16, outputs=4, batch_norm=True) for seed in (0, 1)
    )
    optimizer0 = TrustRatio(torch.optim.SGD(model0.parameters(), lr=0.5, momentum=0.5))
    optimizer1 = torch.optim.Adam(model1.parameters(), lr=1e-2, eps=1e-4)
    if use_amp:
        [model0, model1], [optimizer0, optimizer1] = amp.initialize(
            [model0, model1],
            [optimizer0, optimizer1],
            opt_level=opt_level,
            dtype=dtype,
            num_losses=2,
            verbosity=0,
        )
        amp._amp_state.loss_scalers[0]._loss_scale = 4.0  # as apex's L0 tests do
        amp._amp_state.loss_scalers[1]._loss_scale = 16.0
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer1, step_size=2, gamma=0.8)
    first = 0
    if resume is not None:
        checkpoint = torch.load(io.BytesIO(resume), weights_only=True)
        model0.load_state_dict(checkpoint["model0"])
        model1.load_state_dict(checkpoint["model1"])
        optimizer0.load_state_dict(checkpoint["optimizer0"])
        optimizer1.load_state_dict(checkpoint["optimizer1"])
        scheduler.load_state_dict(checkpoint["scheduler"])
        amp.load_state_dict(checkpoint["amp"])
        first = checkpoint["step"]
    losses, checkpoint_bytes = [], None
    try:
        for step in range(first, steps):
            x, y = data(step)
            loss0 = F.cross_entropy(model0(x), y)
            loss1 = F.cross_entropy(model1(x) + model0(x), y)
            if use_amp:
                with amp.scale_loss(loss0, optimizer0, loss_id=0) as scaled_loss:
                    scaled_loss.backward()
                with amp.scale_loss(loss1, [optimizer0, optimizer1], loss_id=1) as scaled_loss:
                    scaled_loss.backward()
                    if step == inject_at:
                        model1[3].weight.grad.view(-1)[0] = float("inf")
            else:
                loss0.backward()
                loss1.backward()
            optimizer0.step()
            optimizer1.step()
            if not use_amp or amp._amp_state.loss_scalers[1]._unskipped != 0:
                scheduler.step()
            if zero == "optimizer":
                optimizer0.zero_grad()
                optimizer1.zero_grad()
            elif zero == "model":
                model0.zero_grad()
                model1.zero_grad()
            else:  # as apex's L0 tests also do
                for param in list(model0.parameters()) + list(model1.parameters()):
                    param.grad = None
            losses.append(loss0.item() + loss1.item())
            if step + 1 == save_at:
                buffer = io.BytesIO()
                torch.save(
                    {
                        "model0": model0.state_dict(),
                        "model1": model1.state_dict(),
                        "optimizer0": optimizer0.state_dict(),
                        "optimizer1": optimizer1.state_dict(),
                        "scheduler": scheduler.state_dict(),
                        "amp": amp.state_dict() if use_amp else {},
                        "step": step + 1,
                    },
                    buffer,
                )
                checkpoint_bytes = buffer.getvalue()
        scales = [s.loss_scale() for s in amp._amp_state.loss_scalers] if use_amp else []
        return {
            "losses": losses,
            "state": {
                **{f"model0.{k}": v.clone() for k, v in model0.state_dict().items()},
                **{f"model1.{k}": v.clone() for k, v in model1.state_dict().items()},
            },
            "scales": scales,
            "scheduler steps": scheduler.last_epoch,
            "wrapper steps": optimizer0.steps_taken,
            "overflow": amp.last_overflow(),
            "checkpoint": checkpoint_bytes,
        }
    finally:
        if use_amp:
            amp.deinitialize()

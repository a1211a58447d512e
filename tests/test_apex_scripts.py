"""apex-style training scripts, end to end, written as apex's README and L0 tests use the API.

Two models, two optimizers (one wrapped LARC-style), two losses with their own scalers
(`num_losses=2`, `loss_id`), the second loss reaching both models; scales forced through
`amp._amp_state` as apex's L0 tests force them; the LR scheduler gated on `_unskipped` as in
transformers' apex examples; a checkpoint with `amp.state_dict()`; at O0-O3 in fp16 and bf16.
"""

import io

import pytest
import torch
import torch.nn.functional as F

import amp
from conftest import DTYPES, OPT_LEVELS
from larc_like import TrustRatio


def make_model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Linear(16, 4)
    )


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
    model0, model1 = make_model(0), make_model(1)
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


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("opt_level", OPT_LEVELS)
def test_apex_script_trains_and_resumes_bit_for_bit(opt_level, dtype):
    straight = run(opt_level, dtype, steps=8, save_at=4)
    assert all(map(torch.isfinite, map(torch.tensor, straight["losses"])))
    assert sum(straight["losses"][-2:]) < 0.9 * sum(straight["losses"][:2])
    assert straight["scheduler steps"] == 8 and straight["wrapper steps"] == 8
    assert straight["scales"] == [4.0, 16.0]  # the forced scales, used all along
    resumed = run(opt_level, dtype, steps=8, resume=straight["checkpoint"])
    for key, value in straight["state"].items():
        assert torch.equal(value, resumed["state"][key]), key
    assert resumed["scales"] == straight["scales"]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_apex_script_overflow_skips_the_step_of_both_optimizers_of_that_loss(opt_level, dtype):
    result = run(opt_level, dtype, steps=4, inject_at=2)
    assert result["wrapper steps"] == 3  # step 2 skipped, LARC-style wrapper included
    assert result["scales"] == [4.0, 8.0]  # only loss 1's scaler backed off
    assert result["scheduler steps"] == 3  # the _unskipped gate held the scheduler back once
    assert result["overflow"].loss_id == 1 and result["overflow"].params == ("model1.3.weight",)


def test_o0_script_is_plain_pytorch_bit_for_bit():
    """O0 with forced scales 4 and 16: scaling by powers of two and back changes no bit."""
    with_amp = run("O0", torch.float16, steps=4)
    plain = run("O0", None, steps=4, use_amp=False)
    for key, value in plain["state"].items():
        assert torch.equal(value, with_amp["state"][key]), key
    assert with_amp["losses"] == plain["losses"]


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_apex_script_zeroing_ways_agree(opt_level):
    """optimizer.zero_grad(), model.zero_grad() or grads set to None, as apex's L0 tests loop."""
    runs = [
        run(opt_level, torch.float16, steps=3, zero=way) for way in ("optimizer", "model", "none")
    ]
    for other in runs[1:]:
        for key, value in runs[0]["state"].items():
            assert torch.equal(value, other["state"][key]), key

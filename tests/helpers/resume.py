"""Training scripts that save a checkpoint and are resumed from it (tests/programs/test_resume.py).

Each entry of SCRIPTS is `train(opt_level, dtype, steps, save_at=None, checkpoint=None,
resume=None)`: it trains `steps` steps from scratch, saving `checkpoint` after step `save_at`, or
goes on from the checkpoint `resume` to step `steps`. It returns {"state": {name: tensor}} and,
where the script has them, the final amp state ("amp"), the losses and loss scales of each step it
ran ("losses", "scales").

    python resume.py SCRIPT OPT_LEVEL DTYPE STEPS CHECKPOINT RESULT   # resume in a fresh process
"""

import sys

import torch

import amp
from helpers import ROOT
from helpers.models import make_model

# "amp": overflows injected at these steps, on both sides of the checkpoint at step 4.
OVERFLOW_STEPS = (1, 5)


def _batch(step):
    generator = torch.Generator().manual_seed(1000 + step)
    return torch.randn(32, 4, generator=generator), torch.randn(32, 2, generator=generator)


def train_amp(opt_level, dtype, steps, save_at=None, checkpoint=None, resume=None):
    """amp's own API: batch norm, AdamW, a dynamic scale at every level that grows every two clean
    steps, and overflows before and after the checkpoint."""
    model = make_model(hidden=16, batch_norm=True)
    # eps 1e-3: O3 steps FP16 parameters, where Adam's default 1e-8 underflows to zero.
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01, eps=1e-3)
    overrides = {"loss_scale": "dynamic"} if opt_level in ("O0", "O3") else {}
    amp.initialize(model, optimizer, opt_level=opt_level, dtype=dtype, verbosity=0, **overrides)
    try:
        amp._state.amp_state.loss_scalers[0].growth_interval = 2
        first = 0
        if resume is not None:
            saved = torch.load(resume, weights_only=True)
            model.load_state_dict(saved["model"])
            optimizer.load_state_dict(saved["optimizer"])
            amp.load_state_dict(saved["amp"])
            first = saved["step"]
        losses, scales = [], []
        for step in range(first, steps):
            x, y = _batch(step)
            loss = ((model(x).float() - y) ** 2).mean()
            with amp.scale_loss(loss, optimizer) as scaled:
                scaled.backward()
                if step in OVERFLOW_STEPS:
                    model[0].weight.grad.view(-1)[0] = float("inf")
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
            scales.append(amp.state_dict()["loss_scaler0"]["loss_scale"])
            if step + 1 == save_at:
                torch.save(
                    {
                        "model": model.state_dict(),
                        "optimizer": optimizer.state_dict(),
                        "amp": amp.state_dict(),
                        "step": step + 1,
                    },
                    checkpoint,
                )
        state = {f"model.{k}": v.clone() for k, v in model.state_dict().items()}
        for index, master in enumerate(amp.master_params(optimizer)):
            state[f"master.{index}"] = master.detach().clone()
        return {"state": state, "amp": dict(amp.state_dict()), "losses": losses, "scales": scales}
    finally:
        amp.deinitialize()


def train_apex_style(opt_level, dtype, steps, save_at=None, checkpoint=None, resume=None):
    """helpers.apex_style: two models, a LARC-style wrapper, two losses, forced scales."""
    from helpers import apex_style

    result = apex_style.run(
        opt_level,
        dtype,
        steps,
        save_at=save_at,
        resume=None if resume is None else open(resume, "rb").read(),
    )
    if checkpoint is not None:
        with open(checkpoint, "wb") as file:
            file.write(result["checkpoint"])
    return {"state": result["state"], "amp": result["scales"], "losses": result["losses"]}


def train_apex_package(opt_level, dtype, steps, save_at=None, checkpoint=None, resume=None):
    """helpers/apex_scripts/two_models.py, every apex name from `import apex` (float16 only)."""
    from helpers.apex_scripts import two_models

    assert dtype is torch.float16
    argv = ["--opt-level", opt_level, "--steps", str(steps)]
    if resume is not None:
        argv += ["--resume", str(resume)]
    if save_at is not None:
        argv += ["--save-at", str(save_at), "--checkpoint", str(checkpoint)]
    result = two_models.main(argv)
    return {"state": result["params"], "losses": result["losses"], "scales": result["scales"]}


def train_example(opt_level, dtype, steps, save_at=None, checkpoint=None, resume=None):
    """examples/checkpoint.py's training function (digits, batch norm, AdamW)."""
    sys.path.insert(0, str(ROOT / "examples"))
    import checkpoint as example

    result = example.train(
        opt_level,
        str(dtype).split(".")[-1],
        "cpu",
        steps,
        load=resume,
        save=checkpoint,
        save_at=save_at,
    )
    return {"state": result["weights"], "losses": result["losses"]}


SCRIPTS = {
    "amp": train_amp,
    "apex-style": train_apex_style,
    "apex package": train_apex_package,
    "example": train_example,
}


if __name__ == "__main__":
    script, opt_level, dtype, steps, checkpoint, result = sys.argv[1:]
    found = SCRIPTS[script](opt_level, getattr(torch, dtype), int(steps), resume=checkpoint)
    torch.save(found, result)

"""Training that stops, saves, and resumes in another process (used by test_handle.py).

python resume_helper.py OPT_LEVEL CHECKPOINT RESULT   # resume from CHECKPOINT, write RESULT
"""

import sys

import torch

import amp

# Overflows injected at these steps, on both sides of the checkpoint at step 4.
OVERFLOW_STEPS = (1, 5)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(4, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Linear(16, 2)
    )


def _batch(step):
    generator = torch.Generator().manual_seed(1000 + step)
    return torch.randn(32, 4, generator=generator), torch.randn(32, 2, generator=generator)


def train(opt_level, steps, save_to=None, load_from=None):
    """Train `steps` (a range) at `opt_level`; return the final state as plain tensors."""
    model = _model()
    # eps 1e-3: O3 steps FP16 parameters, where Adam's default 1e-8 underflows to zero.
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01, eps=1e-3)
    overrides = {"loss_scale": "dynamic"} if opt_level in ("O0", "O3") else {}
    amp.initialize(model, optimizer, opt_level=opt_level, verbosity=0, **overrides)
    try:
        amp._state.amp_state.loss_scalers[0].growth_interval = 2
        if load_from is not None:
            checkpoint = torch.load(load_from, weights_only=True)
            model.load_state_dict(checkpoint["model"])
            optimizer.load_state_dict(checkpoint["optimizer"])
            amp.load_state_dict(checkpoint["amp"])
        for step in steps:
            x, y = _batch(step)
            loss = ((model(x).float() - y) ** 2).mean()
            with amp.scale_loss(loss, optimizer) as scaled:
                scaled.backward()
                if step in OVERFLOW_STEPS:
                    model[0].weight.grad.view(-1)[0] = float("inf")
            optimizer.step()
            optimizer.zero_grad()
        state = {
            "model": {k: v.clone() for k, v in model.state_dict().items()},
            "optimizer": optimizer.state_dict(),
            "amp": dict(amp.state_dict()),
            "masters": {
                str(i): m.detach().clone() for i, m in enumerate(amp.master_params(optimizer))
            },
        }
        if save_to is not None:
            torch.save(state, save_to)
        return state
    finally:
        amp.deinitialize()


if __name__ == "__main__":
    opt_level, checkpoint, result = sys.argv[1:]
    torch.save(train(opt_level, range(4, 8), load_from=checkpoint), result)

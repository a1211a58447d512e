"""An apex-era training script, written here in apex's style: two models, three losses with their
own loss scalers (`num_losses=3`, `loss_id`), apex's optimizers (LARC around FusedSGD, FusedAdam
or FusedLAMB), SyncBatchNorm conversion, FusedLayerNorm, `to_python_float`, the `_unskipped`
scheduler gate, and a checkpoint with `amp.state_dict()`; every apex name comes from `import apex`.

    python two_models.py --opt-level O2 --steps 6 [--save-at 3 --checkpoint ck.pt] [--resume ck.pt]

`main(argv)` returns what the tests compare: the losses, the final parameters and loss scales.
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

import apex
from apex import amp
from apex.amp._amp_state import _amp_state
from apex.fp16_utils import to_python_float
from apex.normalization import FusedLayerNorm
from apex.optimizers import FusedAdam, FusedLAMB, FusedSGD
from apex.parallel.LARC import LARC


def build(seed):
    torch.manual_seed(seed)
    classifier = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
    encoder = nn.Sequential(nn.Linear(8, 16), FusedLayerNorm(16), nn.Tanh(), nn.Linear(16, 4))
    return apex.parallel.convert_syncbn_model(classifier), encoder


def batch(step):
    generator = torch.Generator().manual_seed(step % 3)
    return torch.randn(32, 8, generator=generator), torch.randint(0, 4, (32,), generator=generator)


def parse(argv):
    parser = argparse.ArgumentParser()
    parser.add_argument("--opt-level", default="O1")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--optimizer", choices=["adam", "lamb"], default="adam")
    parser.add_argument("--save-at", type=int)
    parser.add_argument("--checkpoint")
    parser.add_argument("--resume")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse(argv)
    classifier, encoder = build(0)
    optimizer0 = LARC(FusedSGD(classifier.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4))
    second = FusedAdam if args.optimizer == "adam" else FusedLAMB
    optimizer1 = second(encoder.parameters(), lr=1e-2, weight_decay=0.01)
    [classifier, encoder], [optimizer0, optimizer1] = amp.initialize(
        [classifier, encoder],
        [optimizer0, optimizer1],
        opt_level=args.opt_level,
        num_losses=3,
        verbosity=0,
    )
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer1, step_size=2, gamma=0.5)
    first = 0
    if args.resume:
        checkpoint = torch.load(args.resume, weights_only=True)
        classifier.load_state_dict(checkpoint["classifier"])
        encoder.load_state_dict(checkpoint["encoder"])
        optimizer0.load_state_dict(checkpoint["optimizer0"])
        optimizer1.load_state_dict(checkpoint["optimizer1"])
        scheduler.load_state_dict(checkpoint["scheduler"])
        amp.load_state_dict(checkpoint["amp"])
        first = checkpoint["step"]
    losses, scales = [], []
    try:
        for step in range(first, args.steps):
            x, y = batch(step)
            logits0, logits1 = classifier(x), encoder(x)
            loss0 = F.cross_entropy(logits0, y)
            loss1 = F.cross_entropy(logits1, y)
            loss2 = F.mse_loss(logits1.float(), logits0.detach().float())
            optimizer0.zero_grad()
            optimizer1.zero_grad()
            with amp.scale_loss(loss0, optimizer0, loss_id=0) as scaled:
                scaled.backward()
            with amp.scale_loss(loss1, optimizer1, loss_id=1) as scaled:
                scaled.backward(retain_graph=True)  # loss2 goes through the encoder too
            with amp.scale_loss(loss2, optimizer1, loss_id=2) as scaled:
                scaled.backward()
            optimizer0.step()
            optimizer1.step()
            if _amp_state.loss_scalers[1]._unskipped != 0:
                scheduler.step()
            losses.append([to_python_float(loss) for loss in (loss0, loss1, loss2)])
            scales.append([scaler.loss_scale() for scaler in _amp_state.loss_scalers])
            if step + 1 == args.save_at:
                torch.save(
                    {
                        "classifier": classifier.state_dict(),
                        "encoder": encoder.state_dict(),
                        "optimizer0": optimizer0.state_dict(),
                        "optimizer1": optimizer1.state_dict(),
                        "scheduler": scheduler.state_dict(),
                        "amp": amp.state_dict(),
                        "step": step + 1,
                    },
                    args.checkpoint,
                )
        params = {
            f"{name}.{key}": value.detach().float().clone()
            for name, model in (("classifier", classifier), ("encoder", encoder))
            for key, value in model.state_dict().items()
        }
        return {"losses": losses, "scales": scales, "params": params}
    finally:
        amp.deinitialize()


if __name__ == "__main__":
    result = main()
    print(" ".join(f"{loss:.4f}" for loss in result["losses"][-1]))

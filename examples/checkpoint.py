"""Save a checkpoint mid-training, resume it in a fresh process, and check the result is bit-identical.

The order that matters: call amp.initialize first, then load the model, the optimizer (whose
state dict carries the FP32 master weights under O2) and amp's loss-scaler state. The script
prints the losses of both runs, what the checkpoint holds, and whether the resumed run ended
where the uninterrupted one did.

    python examples/checkpoint.py                    # O2, float16, CPU
    python examples/checkpoint.py --opt-level O1 --device cuda
"""

import argparse
import os
import subprocess
import sys
import tempfile

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from common import device_argument, dtype_argument, opt_level_argument, progress  # noqa: E402
from common import parser as example_parser  # noqa: E402
from demo import load_digits, make_model  # noqa: E402

import amp  # noqa: E402


def train(opt_level, dtype, device, steps, load=None, save=None, save_at=None):
    """Train up to step `steps`, from scratch or from the checkpoint `load`; save one to `save`
    after step `save_at`. Returns {"weights": the final state dict, "losses": one per step}."""
    train_x, train_y = load_digits(device)[:2]
    model = make_model().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, eps=1e-4)
    model, optimizer = amp.initialize(
        model, optimizer, opt_level=opt_level, dtype=getattr(torch, dtype), verbosity=0
    )
    losses = []
    try:
        first = 0
        if load is not None:
            checkpoint = torch.load(load, weights_only=True)
            model.load_state_dict(checkpoint["model"])
            optimizer.load_state_dict(checkpoint["optimizer"])
            amp.load_state_dict(checkpoint["amp"])
            first = checkpoint["step"]
        for step in progress(range(first, steps), desc="resumed" if load else "training"):
            index = torch.randint(
                0, len(train_x), (64,), generator=torch.Generator().manual_seed(step)
            ).to(device)
            loss = F.cross_entropy(model(train_x[index]), train_y[index])
            with amp.scale_loss(loss, optimizer) as scaled_loss:
                scaled_loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
            if save is not None and step + 1 == save_at:
                torch.save(
                    {
                        "model": model.state_dict(),
                        "optimizer": optimizer.state_dict(),
                        "amp": amp.state_dict(),
                        "step": step + 1,
                    },
                    save,
                )
        weights = {key: value.clone() for key, value in model.state_dict().items()}
        return {"weights": weights, "losses": losses}
    finally:
        amp.deinitialize()


def describe(path):
    """Lines saying what the checkpoint file at `path` holds."""
    checkpoint = torch.load(path, weights_only=True)
    model, optimizer = checkpoint["model"], checkpoint["optimizer"]
    dtypes = sorted({str(v.dtype).replace("torch.", "") for v in model.values()})
    values = sum(v.numel() for v in model.values() if v.is_floating_point())
    entries = optimizer["state"].values()
    keys = {key for entry in entries for key in entry}
    master_keys = sorted(key for key in keys if key.startswith("master"))
    state = sorted(keys - set(master_keys))
    masters = sum(1 for entry in entries if any(key in entry for key in master_keys))
    lines = [
        f"{os.path.basename(path)} ({os.path.getsize(path) / 1024:.0f} KiB) after step "
        f"{checkpoint['step']} holds:",
        f"  model      model.state_dict(): {len(model)} tensors ({', '.join(dtypes)}), "
        f"{values:,} values",
        f"  optimizer  optimizer.state_dict(): AdamW's state ({', '.join(state)}) of "
        f"{len(optimizer['state'])} parameters"
        + (
            f", and the master weights of {masters} of them ({', '.join(master_keys)})"
            if masters
            else ""
        ),
    ]
    for key, scaler in checkpoint["amp"].items():
        lines.append(f"  amp        amp.state_dict()[{key!r}]: {scaler}")
    lines.append(f"  step       {checkpoint['step']}")
    return lines


def loss_table(straight, resumed, resumed_from):
    """The two runs' losses at ten steps of training, side by side."""
    steps = len(straight)
    shown = sorted({1, resumed_from + 1} | {max(1, steps * k // 10) for k in range(1, 11)})
    lines = ["Losses:", "  step  " + "".join(f"{s:>8}" for s in shown)]
    lines.append("  loss  " + "".join(f"{straight[s - 1]:8.4f}" for s in shown) + "  uninterrupted")
    cells = [
        f"{resumed[s - resumed_from - 1]:8.4f}" if s > resumed_from else f"{'':8}" for s in shown
    ]
    lines.append("  loss  " + "".join(cells) + "  resumed in a fresh process")
    return lines


def main(argv=None):
    parser = example_parser(__doc__)
    device_argument(parser)
    opt_level_argument(parser, "O2")
    dtype_argument(parser)
    parser.add_argument(
        "--steps", type=int, default=100, help="training steps; the checkpoint is saved at half"
    )
    # CHECKPOINT:RESULT, for the child process that resumes
    parser.add_argument("--resume", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.resume:
        checkpoint, result = args.resume.split(":")
        torch.save(
            train(args.opt_level, args.dtype, args.device, args.steps, load=checkpoint), result
        )
        return None
    half = args.steps // 2
    print(
        f"{args.opt_level} {args.dtype} on {args.device}: {args.steps} steps uninterrupted; then "
        f"{half} steps saved to a checkpoint, resumed in a fresh process up to step {args.steps}."
    )
    with tempfile.TemporaryDirectory() as folder:
        checkpoint = os.path.join(folder, "checkpoint.pt")
        result = os.path.join(folder, "result.pt")
        uninterrupted = train(args.opt_level, args.dtype, args.device, args.steps)
        first_half = train(
            args.opt_level, args.dtype, args.device, half, save=checkpoint, save_at=half
        )
        print("\n".join(describe(checkpoint)))
        subprocess.run(
            [
                sys.executable,
                __file__,
                *("--opt-level", args.opt_level, "--dtype", args.dtype),
                *("--device", args.device, "--steps", str(args.steps)),
                *("--resume", f"{checkpoint}:{result}"),
            ],
            check=True,
        )
        resumed = torch.load(result, weights_only=True)
    print("\n".join(loss_table(uninterrupted["losses"], resumed["losses"], half)))
    same_losses = (
        first_half["losses"] + resumed["losses"] == uninterrupted["losses"]
    )  # every step's loss, before and after the checkpoint
    identical = all(
        torch.equal(resumed["weights"][key], value)
        for key, value in uninterrupted["weights"].items()
    )
    print(
        f"Every loss equal to the uninterrupted run's: {same_losses}; final weights bit-identical "
        f"to uninterrupted training: {identical}"
    )
    return identical and same_losses


if __name__ == "__main__":
    main()

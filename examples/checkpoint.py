"""Save a checkpoint mid-training, resume it in a fresh process, and check the result is bit-identical.

The order that matters: call amp.initialize first, then load the model, the optimizer (whose
state dict carries the FP32 master weights under O2) and amp's loss-scaler state.

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
from common import device_argument, progress  # noqa: E402
from demo import load_digits, make_model  # noqa: E402

import amp  # noqa: E402


def train(opt_level, dtype, device, steps, load=None, save=None, save_at=None):
    """Train `steps` steps from scratch or from `load`; save at `save_at`; return final weights."""
    train_x, train_y = load_digits(device)[:2]
    model = make_model().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, eps=1e-4)
    model, optimizer = amp.initialize(
        model, optimizer, opt_level=opt_level, dtype=getattr(torch, dtype), verbosity=0
    )
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
        return {key: value.clone() for key, value in model.state_dict().items()}
    finally:
        amp.deinitialize()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    device_argument(parser)
    parser.add_argument("--opt-level", default="O2", choices=["O0", "O1", "O2", "O3"])
    parser.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument(
        "--resume", help=argparse.SUPPRESS
    )  # CHECKPOINT:RESULT, for the child process
    args = parser.parse_args(argv)
    if args.resume:
        checkpoint, result = args.resume.split(":")
        torch.save(
            train(args.opt_level, args.dtype, args.device, args.steps, load=checkpoint), result
        )
        return None
    with tempfile.TemporaryDirectory() as folder:
        checkpoint, result = (
            os.path.join(folder, "checkpoint.pt"),
            os.path.join(folder, "result.pt"),
        )
        uninterrupted = train(args.opt_level, args.dtype, args.device, args.steps)
        train(
            args.opt_level,
            args.dtype,
            args.device,
            args.steps // 2,
            save=checkpoint,
            save_at=args.steps // 2,
        )
        subprocess.run(
            [
                sys.executable,
                __file__,
                "--opt-level",
                args.opt_level,
                "--dtype",
                args.dtype,
                "--device",
                args.device,
                "--steps",
                str(args.steps),
                "--resume",
                f"{checkpoint}:{result}",
            ],
            check=True,
        )
        resumed = torch.load(result, weights_only=True)
    identical = all(torch.equal(resumed[key], value) for key, value in uninterrupted.items())
    print(
        f"{args.opt_level} {args.dtype}: resumed at step {args.steps // 2} of {args.steps} in a fresh "
        f"process; final weights bit-identical to uninterrupted training: {identical}"
    )
    return identical


if __name__ == "__main__":
    main()

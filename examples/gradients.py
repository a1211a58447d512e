"""Working with gradients under amp: clipping, accumulation, and a gradient penalty.

  clipping      O2; gradients are unscaled when scale_loss exits, so clip amp.master_params
                (the FP32 masters), never model.parameters()
  accumulation  several micro-batches per step: delay_unscale=True on all but the last
  penalty       a gradient penalty (double backward), torch.amp style: amp.autocast + amp.GradScaler,
                the penalty built from unscaled gradients

Each trains a classifier on scikit-learn's digits (shipped with it) and prints its accuracy.

    python examples/gradients.py --technique clipping
    python examples/gradients.py --technique accumulation --device cuda
    python examples/gradients.py --technique penalty --dtype bfloat16
"""

import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from common import device_argument, dtype_argument, progress  # noqa: E402
from common import parser as example_parser  # noqa: E402
from demo import load_digits, make_model  # noqa: E402

import amp  # noqa: E402


def _batches(train_x, steps, batch, seed=1):
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        yield torch.randint(0, len(train_x), (batch,), generator=generator).to(train_x.device)


def clipping(model, optimizer, data, steps, dtype, max_norm=1.0):
    train_x, train_y = data
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", dtype=dtype, verbosity=0)
    try:
        for index in progress(_batches(train_x, steps, 64), total=steps, desc="clipping"):
            loss = F.cross_entropy(model(train_x[index]), train_y[index])
            with amp.scale_loss(loss, optimizer) as scaled_loss:
                scaled_loss.backward()
            torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), max_norm)
            optimizer.step()
            optimizer.zero_grad()
    finally:
        amp.deinitialize()


def accumulation(model, optimizer, data, steps, dtype, micro_batches=4):
    train_x, train_y = data
    model, optimizer = amp.initialize(model, optimizer, opt_level="O1", dtype=dtype, verbosity=0)
    try:
        batches = _batches(train_x, steps * micro_batches, 16)
        for _ in progress(range(steps), desc="accumulation"):
            for micro in range(micro_batches):
                index = next(batches)
                loss = F.cross_entropy(model(train_x[index]), train_y[index]) / micro_batches
                # Leave the gradients scaled until the last micro-batch; it unscales them all.
                with amp.scale_loss(
                    loss, optimizer, delay_unscale=micro < micro_batches - 1
                ) as scaled:
                    scaled.backward()
            optimizer.step()
            optimizer.zero_grad()
    finally:
        amp.deinitialize()


def penalty(model, optimizer, data, steps, dtype, weight=0.01):
    train_x, train_y = data
    scaler = amp.GradScaler()
    params = list(model.parameters())
    for index in progress(_batches(train_x, steps, 64), total=steps, desc="penalty"):
        with amp.autocast(dtype=dtype):
            loss = F.cross_entropy(model(train_x[index]), train_y[index])
        # Gradients of the scaled loss, kept in the graph; unscale them before the penalty.
        scaled_grads = torch.autograd.grad(scaler.scale(loss), params, create_graph=True)
        inv_scale = 1.0 / scaler.get_scale()
        grad_norm = torch.sqrt(sum((g * inv_scale).pow(2).sum() for g in scaled_grads))
        with amp.autocast(dtype=dtype):
            total = loss + weight * grad_norm
        scaler.scale(total).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()


TECHNIQUES = {"clipping": clipping, "accumulation": accumulation, "penalty": penalty}


def run(technique, dtype="float16", device="cpu", steps=200):
    train_x, train_y, test_x, test_y = load_digits(device)
    model = make_model().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, eps=1e-4)
    TECHNIQUES[technique](model, optimizer, (train_x, train_y), steps, getattr(torch, dtype))
    model.eval()
    with torch.no_grad():
        return (model(test_x).argmax(-1) == test_y).float().mean().item()


def main(argv=None):
    parser = example_parser(__doc__)
    device_argument(parser)
    parser.add_argument(
        "--technique",
        choices=sorted(TECHNIQUES),
        default="clipping",
        help="clipping: amp.master_params; accumulation: delay_unscale; penalty: a gradient "
        "penalty through autograd.grad",
    )
    dtype_argument(parser)
    parser.add_argument("--steps", type=int, default=200, help="training steps")
    args = parser.parse_args(argv)
    accuracy = run(args.technique, args.dtype, args.device, args.steps)
    print(f"{args.technique}: test accuracy {accuracy:.4f}")
    return accuracy


if __name__ == "__main__":
    main()

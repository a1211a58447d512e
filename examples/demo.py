"""Train a classifier on real handwritten digits at O0, O1, O2 and O3, in float16 and bfloat16.

The data is scikit-learn's digits set (1,797 8x8 images of 0-9 written by 43 people, shipped
inside scikit-learn: nothing is downloaded). Each configuration trains the same network from
the same initial weights; the script prints a table (test accuracy, final loss, time per step,
skipped steps, final loss scale) and saves a plot of the loss curves and loss-scale histories.

    python examples/demo.py                       # CPU, a couple of minutes
    python examples/demo.py --device cuda
    python examples/demo.py --epochs 5 --levels O0 O2 --dtypes bfloat16 --out /tmp/demo
"""

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from common import device_argument, progress  # noqa: E402

import amp  # noqa: E402


def load_digits(device):
    """(train_x, train_y, test_x, test_y): a fixed 80/20 split, pixels scaled to [0, 1]."""
    from sklearn.datasets import load_digits as sklearn_digits

    data = sklearn_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target, dtype=torch.int64)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    x, y = x[order].to(device), y[order].to(device)
    split = int(0.8 * len(x))
    return x[:split], y[:split], x[split:], y[split:]


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 256),
        torch.nn.BatchNorm1d(256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, 256),
        torch.nn.BatchNorm1d(256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, 10),
    )


def train(opt_level, dtype, device="cpu", epochs=20, batch_size=64, lr=3e-3, show_progress=False):
    """Train one configuration; return its results (and its loss and loss-scale histories)."""
    train_x, train_y, test_x, test_y = load_digits(device)
    model = make_model().to(device)
    # eps=1e-4: O3 steps the FP16 weights themselves, where Adam's default 1e-8 is zero.
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4, eps=1e-4)
    model, optimizer = amp.initialize(
        model, optimizer, opt_level=opt_level, dtype=dtype, verbosity=0
    )
    losses, scales, skipped, step_times = [], [], 0, []
    try:
        generator = torch.Generator().manual_seed(1)
        epochs_iter = range(epochs)
        if show_progress:
            epochs_iter = progress(epochs_iter, desc=f"{opt_level} {str(dtype).split('.')[-1]}")
        for _ in epochs_iter:
            model.train()
            order = torch.randperm(len(train_x), generator=generator).to(device)
            for start in range(0, len(order) - batch_size + 1, batch_size):
                index = order[start : start + batch_size]
                began = time.perf_counter()
                loss = F.cross_entropy(model(train_x[index]), train_y[index])
                with amp.scale_loss(loss, optimizer) as scaled_loss:
                    scaled_loss.backward()
                before = amp.last_overflow()
                optimizer.step()
                optimizer.zero_grad()
                if device == "cuda":
                    torch.cuda.synchronize()
                step_times.append(time.perf_counter() - began)
                skipped += amp.last_overflow() is not before
                losses.append(loss.item())
                scales.append(amp.state_dict()["loss_scaler0"]["loss_scale"])
        model.eval()
        with torch.no_grad():
            accuracy = (model(test_x).argmax(-1) == test_y).float().mean().item()
    finally:
        amp.deinitialize()
    step_times.sort()
    return {
        "level": opt_level,
        "dtype": "float32" if opt_level == "O0" else str(dtype).split(".")[-1],
        "accuracy": accuracy,
        "final loss": sum(losses[-20:]) / len(losses[-20:]),
        "ms per step": 1e3 * step_times[len(step_times) // 2],
        "skipped": skipped,
        "loss scale": scales[-1],
        "losses": losses,
        "scales": scales,
    }


def configurations(levels, dtypes):
    """O0 ignores the low-precision type, so it runs once."""
    for level in levels:
        for dtype in dtypes if level != "O0" else dtypes[:1]:
            yield level, dtype


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (loss_axes, scale_axes) = plt.subplots(1, 2, figsize=(12, 4.5))
    for result in results:
        label = f"{result['level']} {result['dtype']}"
        window = 10
        losses = result["losses"]
        smooth = [
            sum(losses[max(0, i - window) : i + 1]) / len(losses[max(0, i - window) : i + 1])
            for i in range(len(losses))
        ]
        loss_axes.plot(smooth, label=label, linewidth=1)
        scale_axes.plot(result["scales"], label=label, linewidth=1)
    loss_axes.set(
        title="training loss (moving average of 10 steps)",
        xlabel="step",
        ylabel="cross entropy",
        yscale="log",
    )
    scale_axes.set(title="loss scale", xlabel="step", ylabel="scale", yscale="log")
    loss_axes.legend(fontsize=8)
    scale_axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    device_argument(parser)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--levels", nargs="+", default=["O0", "O1", "O2", "O3"])
    parser.add_argument(
        "--dtypes", nargs="+", default=["float16", "bfloat16"], choices=["float16", "bfloat16"]
    )
    parser.add_argument(
        "--out", default=os.path.join(os.path.dirname(__file__), "out"), help="folder for the plot"
    )
    args = parser.parse_args(argv)
    dtypes = [getattr(torch, name) for name in args.dtypes]
    results = [
        train(level, dtype, args.device, args.epochs, show_progress=True)
        for level, dtype in configurations(args.levels, dtypes)
    ]
    columns = ["level", "dtype", "accuracy", "final loss", "ms per step", "skipped", "loss scale"]
    print(f"digits, {args.epochs} epochs on {args.device}")
    print("  ".join(f"{c:>11}" for c in columns))
    for result in results:
        cells = []
        for column in columns:
            value = result[column]
            cells.append(
                f"{value:>11.4f}"
                if isinstance(value, float) and column != "loss scale"
                else f"{value:>11}"
            )
        print("  ".join(cells))
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "demo.png")
    plot(results, path)
    print(f"plot: {path}")
    return results


if __name__ == "__main__":
    main()

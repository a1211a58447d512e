"""Does O2's compact state train as well as FP32 masters? The same model, data and seed trained with
exact masters, compact masters, compact masters + int8 moments, and bf16 weights without masters
(the control, which must lose), side by side: held-out loss curves (a table, and a plot with
--plot), and the memory each holds (benchmarks/compact_memory.py measures it against
torch.autocast).

    python benchmarks/compact_accuracy.py [--model char|gpt2-width] [--steps 300] [--lr 3e-4]
                                          [--every 50] [--seed 0] [--plot PATH]

The corpus is real text the machine has: the Python source files that ship with torch, read as
bytes (a character model, vocabulary 256), the last tenth held out. `char`: benchmarks/models.py's
GPT-2 at width 128, 2 layers, context 64, batch 32; `gpt2-width`: width 768 (GPT-2 small's), 12
heads, 2 layers, context 64, batch 8. AdamW (weight decay 0.01), bf16, O2 on the CPU; each step
draws its batch from a generator seeded with the step, the same for every variant.
"""

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
import amp  # noqa: E402
from harness import print_table  # noqa: E402
from models import GPT2  # noqa: E402

VARIANTS = {
    "exact masters": {},
    "compact": dict(master_weights="compact"),
    "compact + int8": dict(master_weights="compact", optimizer_state="int8"),
    "bf16, no masters": dict(master_weights=False),
}
MODELS = {  # (width, heads, layers, context, batch)
    "char": (128, 4, 2, 64, 32),
    "gpt2-width": (768, 12, 2, 64, 8),
}
HELD_OUT_BATCHES = 16


def corpus(limit=4_000_000):
    """(train, held out): uint8 tensors of torch's own .py files, in a fixed order."""
    root = os.path.dirname(torch.__file__)
    chunks, size = [], 0
    for folder, dirs, files in sorted(os.walk(root)):
        dirs.sort()
        for name in sorted(files):
            if name.endswith(".py") and size < limit:
                with open(os.path.join(folder, name), "rb") as source:
                    chunks.append(source.read())
                size += len(chunks[-1])
    data = torch.frombuffer(bytearray(b"".join(chunks)[:limit]), dtype=torch.uint8).long()
    split = len(data) * 9 // 10
    return data[:split], data[split:]


def batch(data, context, size, seed):
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(data) - context - 1, (size,), generator=generator)
    rows = torch.stack([data[start : start + context + 1] for start in starts.tolist()])
    return rows[:, :-1], rows[:, 1:]


def loss_of(model, tokens, targets):
    logits = model(tokens)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def train(name, shape, steps, lr, every, seed, data):
    """[(step, held-out loss)] of one variant."""
    width, heads, layers, context, size = shape
    train_data, held_out = data
    torch.manual_seed(seed)
    model = GPT2(256, context, width, layers, heads)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    model, optimizer = amp.initialize(
        model, optimizer, opt_level="O2", dtype=torch.bfloat16, verbosity=0, **VARIANTS[name]
    )
    evaluation = [batch(held_out, context, size, 10_000 + i) for i in range(HELD_OUT_BATCHES)]

    def held_out_loss():
        with torch.no_grad():
            return sum(loss_of(model, *b).item() for b in evaluation) / len(evaluation)

    curve = [(0, held_out_loss())]
    try:
        for step in range(1, steps + 1):
            optimizer.zero_grad(set_to_none=True)
            loss = loss_of(model, *batch(train_data, context, size, seed * 1_000_000 + step))
            with amp.scale_loss(loss, optimizer) as scaled:
                scaled.backward()
            optimizer.step()
            if step % every == 0 or step == steps:
                curve.append((step, held_out_loss()))
                print(f"  {name}: step {step}, held-out loss {curve[-1][1]:.4f}", flush=True)
    finally:
        amp.deinitialize()
    return curve


def plot(curves, title, path):
    """The held-out curves, and beside them each variant's difference to exact masters (the
    curves of the variants that hold overlap at the left's scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (losses, gaps) = plt.subplots(1, 2, figsize=(11, 4.2))
    reference = dict(curves.get("exact masters", []))
    for index, (name, curve) in enumerate(curves.items()):
        style = dict(label=name, linestyle="--" if "no masters" in name else "-", color=f"C{index}")
        losses.plot(*zip(*curve[1:]), **style)
        if reference and name != "exact masters":
            steps = [step for step, _ in curve[1:]]
            gaps.plot(
                steps,
                [value - reference[step] for step, value in curve[1:]],
                **style,
            )
    losses.set_ylabel("held-out loss (nats per byte)")
    gaps.set_ylabel("difference to exact masters (nats per byte)")
    gaps.axhline(0.0, color="black", linewidth=0.8)
    for axes in (losses, gaps):
        axes.set_xlabel("step")
        axes.grid(alpha=0.3)
        axes.legend()
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=list(MODELS), default="char")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--plot", metavar="PATH", help="also draw the curves into PATH (a PNG)")
    args = parser.parse_args(argv)
    data = corpus()
    curves = {}
    for name in args.variants:
        curves[name] = train(
            name, MODELS[args.model], args.steps, args.lr, args.every, args.seed, data
        )
    reference = dict(curves.get("exact masters", []))
    rows = []
    for index, (step, _) in enumerate(next(iter(curves.values()))):
        row = {"step": step}
        for name, curve in curves.items():
            value = curve[index][1]
            row[name] = f"{value:.4f}"
            if reference and name != "exact masters":
                row[name] += f" ({value - reference[step]:+.4f})"
        rows.append(row)
    title = (
        f"held-out loss, {args.model} model, {args.steps} steps, AdamW lr {args.lr}, bf16, "
        f"seed {args.seed} (difference to exact masters)"
    )
    print_table(title, rows, ["step", *curves])
    if args.plot:
        plot(curves, f"{args.model} model, AdamW lr {args.lr}, bf16", args.plot)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()

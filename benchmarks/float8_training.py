"""Loss curves of a small GPT-2 trained at O2 in bfloat16 and at O2 + float8, side by side, with
torchao's Float8Linear under O2 as the peer.

    python benchmarks/float8_training.py                      # CPU: 300 steps, about 20 minutes
    python benchmarks/float8_training.py --device cuda --steps 2000 --width 512 --layers 8

The model is benchmarks/models.py's GPT-2 (width 64, 4 layers, 4 heads by default; every
linear's features a multiple of 16, the head tied to the embedding and, at the text's 96-odd
characters, left in bfloat16 by both amp and torchao) on the character-level Python reference
text of examples/data, 16 x 64 tokens a step, AdamW with a one-cycle schedule and gradient
clipping on the FP32 masters. Every variant starts from the same weights and sees the same
batches:

  amp O2                 bfloat16, FP32 master weights
  amp O2 + float8        the same with float8="tensorwise"
  amp O2 + float8 rw     the same with float8="rowwise"
  torchao under O2       torchao's convert_to_float8_training (tensorwise) on the model, then
                         amp O2 without float8: the same FP8 linears by module swap (needs
                         torchao; amp never imports it). Its loss equals amp O2 + float8's,
                         step for step, when the two compute the same bits.

It prints the training loss averaged over each --every steps, and the held-out loss at the end.
"""

import argparse
import importlib.util
import math
import os
import sys

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))
import variants  # noqa: E402
from harness import print_table  # noqa: E402
from models import GPT2  # noqa: E402
from transformer_lm import batches, evaluate, load_text  # noqa: E402

import amp  # noqa: E402

VARIANTS = {
    "amp O2": dict(float8=None, torchao=False),
    "amp O2 + float8": dict(float8="tensorwise", torchao=False),
    "amp O2 + float8 rw": dict(float8="rowwise", torchao=False),
    "torchao under O2": dict(float8=None, torchao=True),
}


def train(name, device, steps, batch, length, width, layers, heads, lr):
    """The per-step training losses and the held-out loss of variant `name`."""
    options = VARIANTS[name]
    vocabulary, train_data, held_out = load_text(device)
    torch.manual_seed(0)
    model = GPT2(len(vocabulary), length, width, layers, heads).to(device)
    if options["torchao"]:
        model = variants.torchao_float8(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=steps)
    model, optimizer = amp.initialize(
        model,
        optimizer,
        opt_level="O2",
        dtype=torch.bfloat16,
        float8=options["float8"],
        verbosity=0,
    )
    generator = torch.Generator().manual_seed(1)
    stream = batches(train_data, batch, length, generator)
    losses = []
    try:
        for _ in range(steps):
            tokens, targets = next(stream)
            loss = F.cross_entropy(model(tokens).float().flatten(0, 1), targets.flatten())
            with amp.scale_loss(loss, optimizer) as scaled:
                scaled.backward()
            torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), 1.0)
            optimizer.step()
            optimizer.zero_grad()
            schedule.step()
            losses.append(loss.item())
        return losses, evaluate(model, held_out, length)
    finally:
        amp.deinitialize()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--every", type=int, default=25, help="steps per printed loss")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=None)
    args = parser.parse_args(argv)
    names = args.variants or [
        name
        for name, options in VARIANTS.items()
        if not options["torchao"] or importlib.util.find_spec("torchao") is not None
    ]
    results = {
        name: train(
            name,
            args.device,
            args.steps,
            args.batch,
            args.length,
            args.width,
            args.layers,
            args.heads,
            args.lr,
        )
        for name in names
    }
    rows = []
    for end in range(args.every, args.steps + 1, args.every):
        row = {"steps": f"{end - args.every + 1}-{end}"}
        for name in names:
            window = results[name][0][end - args.every : end]
            row[name] = sum(window) / len(window)
        rows.append(row)
    rows.append({"steps": "held-out", **{name: results[name][1] for name in names}})
    print_table(
        f"training loss (nats per character), GPT-2 width {args.width}, {args.layers} layers, "
        f"{args.batch} x {args.length} tokens a step, on {args.device}",
        rows,
        ["steps"] + names,
    )
    if "amp O2 + float8" in results and "torchao under O2" in results:
        same = results["amp O2 + float8"][0] == results["torchao under O2"][0]
        print(f"amp O2 + float8 and torchao under O2: the same loss at every step: {same}")
    reference = results.get("amp O2")
    if reference is not None:
        for name in names:
            if name != "amp O2":
                gap = results[name][1] - reference[1]
                print(
                    f"{name}: held-out loss {results[name][1]:.4f} "
                    f"({gap:+.4f} nats, perplexity x{math.exp(gap):.4f} against amp O2)"
                )
    return results


if __name__ == "__main__":
    main()

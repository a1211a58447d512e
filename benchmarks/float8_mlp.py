"""Issue 50's MLP stack on a GPU: amp O2 in bf16, amp O2 + float8 (tensorwise, rowwise) and
torchao's Float8Linear under amp O2, eager and compiled: step time against amp O2 bf16 eager.

    python benchmarks/float8_mlp.py                      # CUDA, compute capability 8.9+ (~90 s)
    python benchmarks/float8_mlp.py --modes eager        # eager only (~20 s)
    python benchmarks/float8_mlp.py --tiny --device cpu  # the same code at toy sizes

The stack is Llama 3 8B's MLP width: `--layers` blocks of LayerNorm, Linear 4096 -> 14336, SiLU,
Linear 14336 -> 4096 (no bias) with a residual, `--batch` x 2048 tokens, bf16, AdamW on amp O2's
masters, loss the mean square of the output. Variants, each built afresh from the same seed:

  amp O2 bf16            amp.initialize(opt_level="O2", dtype=torch.bfloat16)
  amp O2 + float8 ...    the same with float8="tensorwise" / "rowwise"
  torchao under amp O2   torchao's convert_to_float8_training (tensorwise), then amp O2 without
                         float8 (needs torchao; left out without it)

Compiled: each block's `compile()` (the blocks are alike: one graph). Each variant is warmed up
(`--warmup` steps, compilation included), then timed over `--steps` steps, CUDA synchronised at
both ends. Before timing, one layer (2048 tokens) checks on the device that the eager FP8 linear
computes the traced one's bits (output, both gradients; both recipes) and says whether its casts
ran on the float8*.cu kernels. Issue 50's goal on an H200: eager tensorwise at most 0.75x amp O2
bf16's step, rowwise at most 0.85x. On CPU (`--tiny`) the numbers only show that the script runs.
"""

import argparse
import gc
import importlib.util
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import variants  # noqa: E402
from harness import print_table  # noqa: E402

import amp  # noqa: E402
from amp.casting import float8, float8_eager  # noqa: E402
from amp.kernels import float8 as kernels8  # noqa: E402

SIZES = dict(hidden=4096, ffn=14336, length=2048)
TINY = dict(hidden=64, ffn=224, length=32)
BASELINE = ("amp O2 bf16", "eager")
GOALS = {"amp O2 + float8 tensorwise": 0.75, "amp O2 + float8 rowwise": 0.85}


class Block(nn.Module):
    def __init__(self, hidden, ffn):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x):
        return x + self.down(F.silu(self.up(self.norm(x))))


def make_model(layers, sizes, device):
    torch.manual_seed(0)
    with torch.device(device):
        model = nn.Sequential(*(Block(sizes["hidden"], sizes["ffn"]) for _ in range(layers)))
    for parameter in model.parameters():
        if parameter.dim() == 2:
            nn.init.normal_(parameter, std=0.02)
    return model


def variant_options(recipes):
    """{name: (float8 recipe, torchao)}."""
    found = {"amp O2 bf16": (None, False)}
    for recipe in recipes:
        found[f"amp O2 + float8 {recipe}"] = (recipe, False)
    if importlib.util.find_spec("torchao") is not None:
        found["torchao under amp O2"] = (None, True)
    return found


def setup(model, recipe, torchao, compiled):
    """(step(inputs) -> loss, close)."""
    if torchao:
        model = variants.torchao_float8(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = amp.initialize(
        model, optimizer, opt_level="O2", dtype=torch.bfloat16, float8=recipe, verbosity=0
    )
    if compiled:
        for block in model:
            block.compile()

    def step(inputs):
        optimizer.zero_grad(set_to_none=True)
        loss = model(inputs).float().square().mean()
        with amp.scale_loss(loss, optimizer) as scaled:
            scaled.backward()
        optimizer.step()
        return loss.detach()

    return step, amp.deinitialize


def measure(name, options, mode, args, sizes):
    cuda = args.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    began = time.perf_counter()
    model = make_model(args.layers, sizes, args.device)
    step, close = setup(model, *options, compiled=mode == "compiled")
    try:
        generator = torch.Generator(args.device).manual_seed(1)
        shape = (args.batch, sizes["length"], sizes["hidden"])
        inputs = torch.randn(shape, device=args.device, generator=generator)
        for _ in range(args.warmup):
            step(inputs)
        sync()
        start = time.perf_counter()
        for _ in range(args.steps):
            loss = step(inputs)
        sync()
        seconds = (time.perf_counter() - start) / args.steps
        return {
            "variant": name,
            "mode": mode,
            "step time": seconds,
            "finite loss": bool(torch.isfinite(loss).item()),
            "wall s": time.perf_counter() - began,
        }
    finally:
        close()
        del model, step
        gc.collect()
        torch._dynamo.reset()
        if cuda:
            torch.cuda.empty_cache()


def check_bits(device, sizes, tokens):
    """{recipe: whether the eager FP8 linear's output and gradients are the traced one's bits},
    and whether its casts ran on the float8*.cu kernels."""
    generator = torch.Generator(device).manual_seed(2)
    hidden, ffn = sizes["hidden"], sizes["ffn"]
    x = torch.randn(tokens, hidden, device=device, generator=generator)
    x = (x * torch.logspace(-2, 2, hidden, device=device)).to(torch.bfloat16)
    w = (torch.randn(ffn, hidden, device=device, generator=generator) * 0.02).to(torch.bfloat16)
    grad = torch.randn(tokens, ffn, device=device, generator=generator).to(torch.bfloat16)
    same = {}
    for recipe in ("tensorwise", "rowwise"):
        results = []
        functions = ((float8_eager.Float8LinearEager, (True,)), (float8.Float8Linear, ()))
        for function, extra in functions:
            a, b = x.clone().requires_grad_(), w.clone().requires_grad_()
            out = function.apply(a, b, float8.RECIPES[recipe], *extra)
            out.backward(grad)
            results.append((out, a.grad, b.grad))
        same[recipe] = all(torch.equal(p, q) for p, q in zip(*results))
    return same, kernels8._cupy_for(x) is not None


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--recipes", nargs="+", choices=["tensorwise", "rowwise"],
                        default=["tensorwise", "rowwise"])
    parser.add_argument("--modes", nargs="+", choices=["eager", "compiled"],
                        default=["eager", "compiled"])
    parser.add_argument("--tiny", action="store_true", help="toy sizes (a CPU smoke run)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        parser.error("FP8 matmuls need a GPU of compute capability 8.9 or higher (Ada, Hopper)")
    sizes = TINY if args.tiny else SIZES
    same, fused = check_bits(args.device, sizes, 64 if args.tiny else 2048)
    print(f"eager FP8 linear = traced, bit for bit: {same}; casts on float8.cu: {fused}")
    table = [
        measure(name, options, mode, args, sizes)
        for mode in args.modes
        for name, options in variant_options(args.recipes).items()
    ]
    by_key = {(row["variant"], row["mode"]): row for row in table}
    baseline = by_key.get(BASELINE)
    for row in table:
        if baseline is not None:
            row["/ amp O2 bf16 eager"] = row["step time"] / baseline["step time"]
        same_mode = by_key.get(("amp O2 bf16", row["mode"]))
        if same_mode is not None:
            row["/ amp O2 bf16, same mode"] = row["step time"] / same_mode["step time"]
        goal = GOALS.get(row["variant"]) if row["mode"] == "eager" else None
        if goal is not None and "/ amp O2 bf16 eager" in row:
            row["goal"] = f"<= {goal}: {'met' if row['/ amp O2 bf16 eager'] <= goal else 'missed'}"
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print_table(
        f"{args.layers} blocks LayerNorm + {sizes['hidden']} -> {sizes['ffn']} -> "
        f"{sizes['hidden']}, SiLU, {args.batch} x {sizes['length']} tokens, bf16, AdamW, on "
        f"{device}, mean of {args.steps} steps",
        table,
        ["variant", "mode", "step time", "/ amp O2 bf16 eager", "/ amp O2 bf16, same mode",
         "goal", "finite loss", "wall s"],
        time_columns=("step time",),
    )
    return table, same, fused


if __name__ == "__main__":
    main()

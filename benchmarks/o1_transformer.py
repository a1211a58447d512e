"""A small transformer training step: FP32 vs torch.autocast + torch.amp.GradScaler vs amp O1.

    python benchmarks/o1_transformer.py [--dtype bfloat16|float16] [--device cpu|cuda] [--steps N]
                                        [--rounds N] [--clock wall|cpu]

The three variants run in the same process, in rounds whose order rotates (the first variant of a
round runs a few percent slower here), on identical models and data; the table gives the median
time per step over all rounds, its ratio to FP32, and the median (and range) over rounds of the
ratio to torch.autocast within each round.
"""

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from harness import interleaved_rounds, print_table  # noqa: E402

import amp  # noqa: E402

VOCAB, WIDTH, HEADS, LAYERS, BATCH, LENGTH = 256, 128, 4, 2, 8, 64


class TinyTransformer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.position = torch.nn.Parameter(torch.randn(LENGTH, WIDTH) * 0.02)
        layer = torch.nn.TransformerEncoderLayer(
            WIDTH, HEADS, 4 * WIDTH, dropout=0.0, batch_first=True, norm_first=True
        )
        self.blocks = torch.nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
        self.head = torch.nn.Linear(WIDTH, VOCAB)
        self.mask = torch.nn.Transformer.generate_square_subsequent_mask(LENGTH)

    def forward(self, tokens):
        x = self.embed(tokens) + self.position
        return self.head(self.blocks(x, mask=self.mask, is_causal=True))


def make(device):
    torch.manual_seed(0)
    model = TinyTransformer().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, optimizer


def batches(device, count):
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (count, BATCH, LENGTH + 1), generator=generator)
    return [(t[:, :-1].to(device), t[:, 1:].to(device)) for t in tokens]


def loss_fn(model, tokens, targets):
    return F.cross_entropy(model(tokens).float().flatten(0, 1), targets.flatten())


def step_fp32(model, optimizer, tokens, targets, _):
    optimizer.zero_grad(set_to_none=True)
    loss_fn(model, tokens, targets).backward()
    optimizer.step()


def step_torch(model, optimizer, tokens, targets, context):
    dtype, scaler, device = context
    optimizer.zero_grad(set_to_none=True)
    with torch.autocast(device, dtype=dtype):
        loss = loss_fn(model, tokens, targets)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()


def step_amp(model, optimizer, tokens, targets, _):
    optimizer.zero_grad(set_to_none=True)
    loss = loss_fn(model, tokens, targets)
    with amp.scale_loss(loss, optimizer) as scaled:
        scaled.backward()
    optimizer.step()


def time_steps(step, model, optimizer, data, context, sync, clock):
    """The time of each step, the device drained after each."""
    times = []
    for tokens, targets in data:
        begin = clock()
        step(model, optimizer, tokens, targets, context)
        sync()
        times.append(clock() - begin)
    return times


# "cpu": the CPU time of this thread with torch on one thread, so the work itself is measured and
# not the waits of a shared machine; it resolves differences well below 1% where wall time on
# this 2-core machine does not.
CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}


def run(dtype, device, steps, rounds, clock="wall"):
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    clock = CLOCKS[clock]
    data = batches(device, steps)
    fp32, torch_amp, ours = make(device), make(device), make(device)
    scaler = torch.amp.GradScaler(device)

    def run_amp():
        amp.initialize(*ours, opt_level="O1", dtype=dtype, verbosity=0)
        try:
            return time_steps(step_amp, *ours, data, None, sync, clock)
        finally:
            amp.deinitialize()

    variants = {
        "fp32": lambda: time_steps(step_fp32, *fp32, data, None, sync, clock),
        "torch.autocast": lambda: time_steps(
            step_torch, *torch_amp, data, (dtype, scaler, device), sync, clock
        ),
        "amp O1": run_amp,
    }
    times = interleaved_rounds(variants, rounds)
    # The median step: this 2-core machine is shared, and single steps are hit by outside noise.
    medians = {
        name: statistics.median(t for round_times in per_round for t in round_times)
        for name, per_round in times.items()
    }
    # The ratios are paired within a round (the variants ran back to back there), which cancels
    # the slow drifts of a shared machine that the medians above still carry.
    ratios = {
        name: [
            statistics.median(ours) / statistics.median(theirs)
            for ours, theirs in zip(per_round, times["torch.autocast"])
        ]
        for name, per_round in times.items()
    }
    return medians, ratios


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    parser.add_argument(
        "--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu"
    )
    parser.add_argument("--steps", type=int, default=20, help="steps per round")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="wall",
        help="wall: elapsed time; cpu: CPU time of one thread, torch on one thread (CPU only)",
    )
    args = parser.parse_args(argv)
    if args.clock == "cpu":
        if args.device != "cpu":
            parser.error("--clock cpu measures CPU work; on CUDA use the wall clock")
        torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype)
    medians, ratios = run(dtype, args.device, args.steps, args.rounds, args.clock)
    rows = [
        {
            "variant": name,
            "time per step": seconds,
            "/ fp32": seconds / medians["fp32"],
            "/ torch.autocast": statistics.median(ratios[name]),
            "rounds: min-max": f"{min(ratios[name]):.3f}-{max(ratios[name]):.3f}",
        }
        for name, seconds in medians.items()
    ]
    print_table(
        f"transformer training step ({LAYERS} layers, width {WIDTH}, batch {BATCH}x{LENGTH}), "
        f"{args.dtype} on {args.device}, {args.clock} clock, "
        f"median of {args.rounds} rounds x {args.steps} steps; "
        "/ torch.autocast is the median of the per-round ratios",
        rows,
        ["variant", "time per step", "/ fp32", "/ torch.autocast", "rounds: min-max"],
        time_columns=("time per step",),
    )
    return {
        name: {"time": medians[name], "/ torch.autocast": row["/ torch.autocast"]}
        for name, row in zip(medians, rows)
    }


if __name__ == "__main__":
    main()

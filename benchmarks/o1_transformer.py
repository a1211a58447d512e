"""A small transformer training step: FP32 vs torch.autocast + torch.amp.GradScaler vs amp O1 vs
amp.autocast + amp.GradScaler, eager or under torch.compile.

    python benchmarks/o1_transformer.py [--dtype bfloat16|float16] [--device cpu|cuda] [--steps N]
                                        [--rounds N] [--clock wall|cpu] [--compile]
                                        [--width N] [--batch N] [--length N] [--layers N]

With --compile every variant steps the same `torch.compile`d model (one graph per variant, made in
the warm-up round), so the ratio to torch.autocast is torch.compile + amp against torch.compile +
torch.autocast.

The three variants run in the same process, in rounds whose order rotates (the first variant of a
round runs a few percent slower here), on one model, one optimizer and the same data; the table
gives the median time per step over all rounds, its ratio to FP32, and the median (and range)
over rounds of the ratio to torch.autocast within each round, and of the difference.

The default sizes make a small CPU step of about 10 ms. Small sizes (`--width 16 --batch 2
--length 8`) leave little but the host's work, which shows the cost of amp's Python layer per step.
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
from models import Encoder  # noqa: E402

import amp  # noqa: E402

VOCAB, HEADS = 256, 4
SIZES = {"width": 128, "batch": 8, "length": 64, "layers": 2}  # the defaults of the options


def make(device, sizes):
    torch.manual_seed(0)
    model = Encoder(VOCAB, sizes["width"], HEADS, sizes["length"], sizes["layers"]).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, optimizer


def batches(device, count, sizes):
    generator = torch.Generator().manual_seed(1)
    shape = (count, sizes["batch"], sizes["length"] + 1)
    tokens = torch.randint(0, VOCAB, shape, generator=generator)
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


def step_amp_autocast(model, optimizer, tokens, targets, context):
    dtype, scaler, _ = context
    optimizer.zero_grad(set_to_none=True)
    with amp.autocast(dtype=dtype):
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


def run(dtype, device, steps, rounds, clock, sizes, compiled=False):
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    clock = CLOCKS[clock]
    data = batches(device, steps, sizes)
    # One model and optimizer, trained by each variant in turn: with a copy per variant, where
    # each copy's tensors happened to lie in memory moved its step time by up to 1.2% here,
    # as much as the differences measured.
    model, optimizer = make(device, sizes)
    scaler = torch.amp.GradScaler(device)
    amp_scaler = amp.GradScaler()
    # The optimizer holds `model`'s parameters, which the compiled module shares.
    stepped = torch.compile(model) if compiled else model

    def run_amp():
        amp.initialize(model, optimizer, opt_level="O1", dtype=dtype, verbosity=0)
        try:
            return time_steps(step_amp, stepped, optimizer, data, None, sync, clock)
        finally:
            amp.deinitialize()

    def run_amp_autocast():
        try:
            context = (dtype, amp_scaler, device)
            return time_steps(step_amp_autocast, stepped, optimizer, data, context, sync, clock)
        finally:
            amp.deinitialize()  # torch.autocast is amp's region while amp's patches stay

    variants = {
        "fp32": lambda: time_steps(step_fp32, stepped, optimizer, data, None, sync, clock),
        "torch.autocast": lambda: time_steps(
            step_torch, stepped, optimizer, data, (dtype, scaler, device), sync, clock
        ),
        "amp O1": run_amp,
        "amp.autocast": run_amp_autocast,
    }
    times = interleaved_rounds(variants, rounds)
    # The median step: this 2-core machine is shared, and single steps are hit by outside noise.
    medians = {
        name: statistics.median(t for round_times in per_round for t in round_times)
        for name, per_round in times.items()
    }
    # The ratios and differences are paired within a round (the variants ran back to back
    # there), which cancels the slow drifts of a shared machine that the medians above still carry.
    paired = {
        name: [
            (statistics.median(ours), statistics.median(theirs))
            for ours, theirs in zip(per_round, times["torch.autocast"])
        ]
        for name, per_round in times.items()
    }
    ratios = {name: [ours / theirs for ours, theirs in pairs] for name, pairs in paired.items()}
    differences = {
        name: statistics.median(ours - theirs for ours, theirs in pairs)
        for name, pairs in paired.items()
    }
    return medians, ratios, differences


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
    parser.add_argument("--compile", action="store_true", help="step a torch.compile'd model")
    for name, default in SIZES.items():
        parser.add_argument(f"--{name}", type=int, default=default)
    args = parser.parse_args(argv)
    sizes = {name: getattr(args, name) for name in SIZES}
    if args.clock == "cpu":
        if args.device != "cpu":
            parser.error("--clock cpu measures CPU work; on CUDA use the wall clock")
        torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype)
    medians, ratios, differences = run(
        dtype, args.device, args.steps, args.rounds, args.clock, sizes, args.compile
    )
    rows = [
        {
            "variant": name,
            "time per step": seconds,
            "/ fp32": seconds / medians["fp32"],
            "/ torch.autocast": statistics.median(ratios[name]),
            "- torch.autocast": differences[name],
            "rounds: min-max": f"{min(ratios[name]):.3f}-{max(ratios[name]):.3f}",
        }
        for name, seconds in medians.items()
    ]
    print_table(
        f"{'compiled ' if args.compile else ''}"
        f"transformer training step ({sizes['layers']} layers, width {sizes['width']}, "
        f"batch {sizes['batch']}x{sizes['length']}), "
        f"{args.dtype} on {args.device}, {args.clock} clock, "
        f"median of {args.rounds} rounds x {args.steps} steps; "
        "/ torch.autocast and - torch.autocast are medians of the per-round ratios and differences",
        rows,
        [
            "variant",
            "time per step",
            "/ fp32",
            "/ torch.autocast",
            "rounds: min-max",
            "- torch.autocast",
        ],
        time_columns=("time per step", "- torch.autocast"),
    )
    return {
        name: {"time": medians[name], "/ torch.autocast": row["/ torch.autocast"]}
        for name, row in zip(medians, rows)
    }


if __name__ == "__main__":
    main()

"""Python calls, peak memory and host time of one training step, every precision variant side by
side.

    python benchmarks/step_costs.py [--dtype bfloat16|float16] [--device cpu|cuda] [--quick]
                                    [--tiny] [--optimizer default|foreach|fused]
                                    [--time ROUNDS] [--steps N] [--no-device-work]

Variants (variants.py): fp32, torch.autocast + torch.amp.GradScaler (the reference), amp O1,
amp.autocast + amp.GradScaler, amp O2, amp O3, and a model in `dtype` stepped by torch's fused /
foreach AdamW on FP32 masters ("manual O2"). Every variant trains a fresh copy of the same model
on the same data with AdamW. Workloads (workloads.py):
  calls    the host-bound transformer (width 16, batch 2 x 8) at depth 1, 4 and 16, GPT-2 at
           CI size (gpt2-tiny: 2 layers of width 32, batch 2 x 32) and the CNN: cProfile's
           total_calls of one step after two warm-up steps and once the loss scale has settled
           (measure.settle)
  memory   the 4-layer width-512 transformer at 128 and 512 tokens (--quick: 128 only), and the
           CNN: bytes live when the step starts and their peak during it (measure.py), after one
           warm-up step on a batch of 2. --tiny (a smoke run): the transformer at width 64 and 32
           tokens, the CNN at CI size. "At step start"
           includes the previous step's gradients where a variant frees them only at the next
           zero_grad(set_to_none=True).
  scaling  the Python calls loss scaling adds to a step at 10 parameter tensors: amp's
           zero_grad + scale_loss + step at O0-O3 against the same step unscaled at that level,
           torch.amp.GradScaler's scale / unscale_ / step / update against a plain step
           (measure.scaling_calls)
  device   the GPU proxies (device_work.py): kernel launches, bytes read and written and bytes
  work     saved for backward per step, host reads per step, and launches and bytes per parameter
           after backward, counted below autograd on FakeTensors at the end-to-end benchmark's
           real sizes (GPT-2 small, batch 8 x 1024; ResNet-50, batch 64 x 224^2; --tiny: their CI
           sizes), with AdamW as torch defaults to on CUDA (foreach), and three more rows: amp O2
           with a fused AdamW, amp O2 with float8="tensorwise" and its peer, manual O2 with
           torchao's Float8Linear (when torchao is installed). Eager counts: FP8's scale and
           cast ops are separate launches here, which torch.compile fuses.
  --time   the calls workloads' step time, ROUNDS rounds of --steps steps whose variant order
           rotates (harness.interleaved_rounds), each on a fresh trainer warmed up and settled
           untimed: CPU time of this thread with torch on one thread on the CPU (the host's work,
           which these sizes leave), wall time with synchronisation on CUDA. The ratio to
           torch.autocast is the median of the per-round ratios of per-round medians.
Ratios are to torch.autocast (below 1.00: fewer calls, less memory, less time). Calls and bytes are
counts, not times: they do not move with the load of the machine; times do, a little.
"""

import argparse
import importlib.util
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
import device_work  # noqa: E402
import variants  # noqa: E402
import workloads  # noqa: E402
from harness import interleaved_rounds, print_table  # noqa: E402
from measure import peak_memory, python_calls, scaling_calls, settle  # noqa: E402

MIB = 2.0**20


def calls(workload, names, dtype, device, optimizer):
    found = {}
    for name in names:
        trainer = variants.setup(name, workload.build(device), workloads.loss_fn, dtype, optimizer)
        try:
            found[name] = python_calls(trainer, workload.batch(device))
        finally:
            trainer.close()
    return found


def memory(workload, names, dtype, device, optimizer):
    found = {}
    for name in names:

        def build(name=name):
            model = workload.build(device)
            return variants.setup(name, model, workloads.loss_fn, dtype, optimizer)

        found[name] = peak_memory(
            build, lambda: workload.batch(device, 2), lambda: workload.batch(device), device
        )
    return found


def host_time(workload, names, dtype, device, optimizer, rounds, steps):
    """{variant: [its median step time in each round]} (see --time in the module doc)."""
    if device == "cuda":
        sync, clock = torch.cuda.synchronize, time.perf_counter
    else:
        sync, clock = (lambda: None), time.thread_time
    batch = workload.batch(device)

    def timed(name):
        def run():
            trainer = variants.setup(
                name, workload.build(device), workloads.loss_fn, dtype, optimizer
            )
            try:
                for _ in range(2):
                    trainer.step(*batch)
                settle(trainer, batch)
                times = []
                for _ in range(steps):
                    sync()
                    begin = clock()
                    trainer.step(*batch)
                    sync()
                    times.append(clock() - begin)
                return times
            finally:
                trainer.close()

        return run

    per_round = interleaved_rounds({name: timed(name) for name in names}, rounds)
    return {name: [statistics.median(t) for t in times] for name, times in per_round.items()}


# (opt level, dtype): O2 with an fp16 model keeps FP32 masters; a bf16 one exact masters as its
# weights and int16 remainders, which the torch backend decodes and encodes around its fused op
# (a fixed number of calls, whatever the parameter count)
SCALING_ROWS = [
    ("O0", torch.bfloat16),
    ("O1", torch.bfloat16),
    ("O2", torch.float16),
    ("O2", torch.bfloat16),
    ("O3", torch.bfloat16),
]


def scaling_rows():
    """One row per opt level (O2 with each master form): the calls amp's loss scaling adds to a
    step, against torch's GradScaler."""
    table = []
    for opt_level, dtype in SCALING_ROWS:
        ours, theirs = scaling_calls(opt_level, dtype)
        table.append(
            {
                "opt level": opt_level,
                "dtype": str(dtype).replace("torch.", ""),
                "amp calls": ours,
                "torch.amp.GradScaler calls": theirs,
                "amp / GradScaler": ours / theirs,
            }
        )
    return table


# (row name, variant, optimizer): every variant with AdamW as on CUDA (foreach), amp O2 fused,
# amp O2 with float8 (F.linear in FP8), and its peer torchao's Float8Linear (if installed).
DEVICE_WORK_ROWS = [(name, name, "foreach") for name in variants.VARIANTS] + [
    ("amp O2 + fused AdamW", "amp O2", "fused"),
    ("amp O2 + float8", "amp O2 + float8", "foreach"),
]
if importlib.util.find_spec("torchao") is not None:
    DEVICE_WORK_ROWS.append(("torchao float8", "torchao float8", "foreach"))
DEVICE_WORK_COLUMNS = [
    "variant",
    "launches",
    "launches / torch.autocast",
    "GB",
    "bytes / torch.autocast",
    "saved MB",
    "saved / torch.autocast",
    "host reads",
    "launches after backward",
    "bytes / param after backward",
]


def device_work_rows(workload, dtype, names=None):
    """One row per variant: the device work of one step (device_work.py), FakeTensors at the
    workload's real size, with ratios to torch.autocast's."""
    found = {}
    for row_name, variant, optimizer in DEVICE_WORK_ROWS:
        if names is None or variant in names:
            found[row_name] = device_work.step_work(workload, variant, dtype, optimizer)
    reference = found.get(variants.REFERENCE)
    table = []
    for row_name, work in found.items():
        row = {
            "workload": workload.name,
            "variant": row_name,
            "launches": work.launches,
            "GB": work.bytes / 1e9,
            "saved MB": work.saved / 1e6,
            "host reads": work.host_reads,
            "launches after backward": work.phases["after backward"].launches,
            "bytes / param after backward": work.bytes_per_parameter_after_backward,
        }
        if reference is not None:
            row["launches / torch.autocast"] = work.launches / reference.launches
            row["bytes / torch.autocast"] = work.bytes / reference.bytes
            row["saved / torch.autocast"] = work.saved / reference.saved
        table.append(row)
    return table


def rows(workload, names, counted, measured, timed=None):
    """One row per variant: its calls, peak bytes and bytes at the step's start, and the ratios
    to torch.autocast's (when it ran)."""
    peaks = {name: peak for name, (_, peak) in measured.items()}
    timed = timed or {}
    table = []
    for name in names:
        row = {"workload": workload, "variant": name}
        if name in counted:
            row["calls"] = counted[name]
        if name in measured:
            row["peak MiB"] = peaks[name] / MIB
            row["at step start MiB"] = measured[name][0] / MIB
        for column, values in (("calls", counted), ("peak", peaks)):
            if name in values and variants.REFERENCE in values:
                row[f"{column} / torch.autocast"] = values[name] / values[variants.REFERENCE]
        if name in timed and variants.REFERENCE in timed:
            ratios = [ours / theirs for ours, theirs in zip(timed[name], timed[variants.REFERENCE])]
            row["time"] = statistics.median(timed[name])
            row["time / torch.autocast"] = statistics.median(ratios)
            row["rounds"] = f"{min(ratios):.3f}-{max(ratios):.3f}"
        table.append(row)
    return table


COLUMNS = [
    "variant",
    "calls",
    "calls / torch.autocast",
    "peak MiB",
    "peak / torch.autocast",
    "at step start MiB",
    "time",
    "time / torch.autocast",
    "rounds",
]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    parser.add_argument(
        "--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu"
    )
    parser.add_argument("--quick", action="store_true", help="memory at 128 tokens only")
    parser.add_argument("--tiny", action="store_true", help="memory workloads at CI sizes")
    parser.add_argument("--optimizer", choices=["default", "foreach", "fused"], default="default")
    parser.add_argument("--variants", nargs="+", choices=variants.VARIANTS, default=None)
    parser.add_argument(
        "--time", type=int, default=0, metavar="ROUNDS", help="also time the calls workloads"
    )
    parser.add_argument("--steps", type=int, default=20, help="timed steps per round (--time)")
    parser.add_argument(
        "--no-device-work", action="store_true", help="leave out the GPU-proxy tables"
    )
    args = parser.parse_args(argv)
    if args.time and args.device == "cpu":
        torch.set_num_threads(1)  # the work itself, not the waits of a shared machine
    dtype = getattr(torch, args.dtype)
    names = args.variants or list(variants.VARIANTS)
    plan = [(workloads.host_bound_transformer(depth), True, False) for depth in (1, 4, 16)]
    plan.append((workloads.END_TO_END["gpt2-tiny"], True, False))
    if args.tiny:
        plan += [(workloads.memory_transformer(32, width=64), False, True)]
    else:
        lengths = (128,) if args.quick else (128, 512)
        plan += [(workloads.memory_transformer(length), False, True) for length in lengths]
    plan.append((workloads.TINY_CNN if args.tiny else workloads.SMALL_CNN, True, True))
    results = {}
    for workload, count, weigh in plan:
        counted = calls(workload, names, dtype, args.device, args.optimizer) if count else {}
        measured = memory(workload, names, dtype, args.device, args.optimizer) if weigh else {}
        timed = {}
        if count and args.time and variants.REFERENCE in names:
            timed = host_time(
                workload, names, dtype, args.device, args.optimizer, args.time, args.steps
            )
        table = rows(workload.name, names, counted, measured, timed)
        results[workload.name] = table
        print_table(
            f"one training step, {workload.name}, {args.dtype} on {args.device}, "
            f"AdamW ({args.optimizer}); ratios to torch.autocast + torch.amp.GradScaler",
            table,
            COLUMNS,
            time_columns=("time",),
        )
    if not args.no_device_work:
        sizes = ("gpt2-tiny", "resnet50-tiny") if args.tiny else ("gpt2", "resnet50")
        for size in sizes:
            workload = workloads.END_TO_END[size]
            table = device_work_rows(workload, dtype, args.variants)
            results[f"device work {size}"] = table
            print_table(
                f"device work of one step (counted below autograd, FakeTensors), {size}, "
                f"{args.dtype}; ratios to torch.autocast + torch.amp.GradScaler",
                table,
                DEVICE_WORK_COLUMNS,
            )
    table = scaling_rows()
    results["scaling"] = table
    print_table(
        "loss scaling + step at 10 parameter tensors: Python calls added to the step unscaled "
        "(zero_grad + scale_loss + step; torch: scale / unscale_ / step / update)",
        table,
        list(table[0]),
    )
    return results


if __name__ == "__main__":
    main()

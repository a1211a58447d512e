"""Python calls and peak memory of one training step, every precision variant side by side.

    python benchmarks/step_costs.py [--dtype bfloat16|float16] [--device cpu|cuda] [--quick]
                                    [--tiny] [--optimizer default|foreach|fused]

Variants (variants.py): fp32, torch.autocast + torch.amp.GradScaler (the reference), amp O1,
amp.autocast + amp.GradScaler, amp O2, amp O3, and a model in `dtype` stepped by torch's fused /
foreach AdamW on FP32 masters ("manual O2"). Every variant trains a fresh copy of the same model
on the same data with AdamW. Workloads (workloads.py):
  calls    the host-bound transformer (width 16, batch 2 x 8) at depth 1, 4 and 16, and the CNN:
           cProfile's total_calls of one step after two warm-up steps and once the loss scale
           has settled (measure.settle)
  memory   the 4-layer width-512 transformer at 128 and 512 tokens (--quick: 128 only), and the
           CNN: bytes live when the step starts and their peak during it (measure.py), after one
           warm-up step on a batch of 2. --tiny (a smoke run): the transformer at width 64 and 32
           tokens, the CNN at CI size. "At step start"
           includes the previous step's gradients where a variant frees them only at the next
           zero_grad(set_to_none=True).
Ratios are to torch.autocast (below 1.00: fewer calls, less memory). Figures are counts, not
times: they do not move with the load of the machine.
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import variants  # noqa: E402
import workloads  # noqa: E402
from harness import print_table  # noqa: E402
from measure import peak_memory, python_calls  # noqa: E402

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


def rows(workload, names, counted, measured):
    """One row per variant: its calls, peak bytes and bytes at the step's start, and the ratios
    to torch.autocast's (when it ran)."""
    peaks = {name: peak for name, (_, peak) in measured.items()}
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
        table.append(row)
    return table


COLUMNS = [
    "variant",
    "calls",
    "calls / torch.autocast",
    "peak MiB",
    "peak / torch.autocast",
    "at step start MiB",
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
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    names = args.variants or list(variants.VARIANTS)
    plan = [(workloads.host_bound_transformer(depth), True, False) for depth in (1, 4, 16)]
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
        table = rows(workload.name, names, counted, measured)
        results[workload.name] = table
        print_table(
            f"one training step, {workload.name}, {args.dtype} on {args.device}, "
            f"AdamW ({args.optimizer}); ratios to torch.autocast + torch.amp.GradScaler",
            table,
            COLUMNS,
        )
    return results


if __name__ == "__main__":
    main()

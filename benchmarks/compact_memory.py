"""Memory of O2's compact state against torch.autocast: bytes a parameter held between steps and
at a step's peak (allocator events, the step after a warm-up step), on the 4-layer width-512
transformer (benchmarks/workloads.py's memory workload), bf16, AdamW.

    python benchmarks/compact_memory.py [--lengths 128 512] [--optimizer default|foreach|fused]
                                        [--tiny]

Variants: torch.autocast + GradScaler (the reference), amp O2 (FP32 masters), amp O2 compact
(master_weights="compact"), amp O2 compact int8 (and optimizer_state="int8"), amp O2 bf16 no
masters (master_weights=False: compact_accuracy.py's control). "Between steps"
is what is live when a step starts: the model, the masters and corrections, the optimizer's
state (activations and gradients are gone: every variant zeroes with set_to_none=True).
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import workloads  # noqa: E402
from harness import print_table  # noqa: E402
from step_costs import memory  # noqa: E402

NAMES = (
    "torch.autocast",
    "amp O2",
    "amp O2 compact",
    "amp O2 compact int8",
    "amp O2 bf16 no masters",
)


def rows(workload, optimizer, device="cpu"):
    """[(variant, B/param between steps, B/param at the peak, peak / torch.autocast's)]."""
    found = memory(workload, NAMES, torch.bfloat16, device, optimizer)
    count = sum(p.numel() for p in workload.build("cpu").parameters())
    reference = found["torch.autocast"][1]
    return [
        (name, before / count, peak / count, peak / reference)
        for name, (before, peak) in found.items()
    ]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--optimizer", default="default")
    parser.add_argument("--tiny", action="store_true", help="width 64, 32 tokens (a smoke run)")
    args = parser.parse_args(argv)
    plan = (
        [workloads.memory_transformer(32, width=64)]
        if args.tiny
        else [workloads.memory_transformer(length) for length in args.lengths]
    )
    columns = ["variant", "B/param between steps", "B/param at the peak", "peak / torch.autocast"]
    for workload in plan:
        found = rows(workload, args.optimizer)
        print_table(
            f"{workload.name}, bfloat16, AdamW ({args.optimizer})",
            [
                dict(zip(columns, (name, f"{held:.2f}", f"{peak:.2f}", f"{ratio:.3f}")))
                for name, held, peak, ratio in found
            ],
            columns,
        )


if __name__ == "__main__":
    main()

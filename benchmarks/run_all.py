"""Every side-by-side benchmark in one run, summarised as one table of ratios.

    python benchmarks/run_all.py            # or: make benchmark
    python benchmarks/run_all.py --quick    # fewer rounds and steps (a smoke run)
    python benchmarks/run_all.py --tiny     # CI sizes: GPT-2 / ResNet-50 code and the memory
                                            # transformer small enough for a CPU smoke run

Rows (a ratio below 1.00 means amp is faster):
  O1 transformer step      amp O1 (and amp.autocast + amp.GradScaler) / torch.autocast +
                           torch.amp.GradScaler, and / FP32; eager and under torch.compile
  loss scaling + step      amp scale_loss + step / torch.amp.GradScaler, 300 parameter tensors
  per-call overhead        a patched F.linear, F.conv2d and Tensor.sum call in a region (amp.autocast
                           and O1), and F.linear at a weight's first use / torch.autocast's; an
                           autocast region enter + exit / torch.autocast's; a patched call outside
                           any region / the original (per_call.py)
  kernels                  amp.kernels / torch's ops (unscale, copies, norm), and on a GPU the
                           large unscale's bandwidth as a fraction of the datasheet's
  step costs               Python calls, peak memory and (not --quick) host time of one step,
                           amp O1 / amp.autocast / amp O2 / amp O3 and the manual O2 peer (a
                           model in the low dtype, torch's fused AdamW on FP32 masters) /
                           torch.autocast + GradScaler (step_costs.py: host-bound transformers
                           at depth 1, 4 and 16; the 4-layer width-512 transformer at 128 and
                           512 tokens; a small CNN); and the calls loss scaling adds at 10
                           parameter tensors, O0-O3 / torch.amp.GradScaler
  GPT-2 small, ResNet-50   end-to-end training steps (end_to_end.py), every variant's step time
                           / torch.autocast's, and tokens/s or images/s: CUDA, fp16 and bf16
The individual scripts print their own detailed tables first; the last line says what ran on this
device and what needs a GPU.
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import end_to_end  # noqa: E402
import kernels as kernel_benchmark  # noqa: E402
import o1_transformer  # noqa: E402
import per_call as per_call_benchmark  # noqa: E402
import scaler as scaler_benchmark  # noqa: E402
import step_costs  # noqa: E402
from harness import print_table  # noqa: E402

import amp  # noqa: E402


def ran_on(device, tiny):
    """The line that says what this run measured here and what needs a GPU."""
    sizes = " Models at CI sizes (--tiny): a smoke run, not figures." if tiny else ""
    if device == "cuda":
        return (
            "Ran on CUDA: every row above, float16 and bfloat16, the CuPy kernels, "
            "GPT-2 small and ResNet-50 end to end." + sizes
        )
    return (
        "Ran on the CPU: bfloat16 only, the kernels' torch backend"
        + (", GPT-2 / ResNet-50 code" if tiny else ", no GPT-2 / ResNet-50 rows")
        + ". Needs CUDA: float16 rows, the CuPy kernels and bandwidth, GPT-2 small (124M, "
        "1024 tokens) and ResNet-50 end to end with tokens/s and images/s." + sizes
    )


# The variants summarised from step_costs.py and end_to_end.py (their own tables give them all).
SUMMARISED = ("amp O1", "amp.autocast", "amp O2", "amp O3", "manual O2 fused")


def _costs(row):
    """A step_costs row's calls and peak as one cell."""
    cells = []
    if "calls" in row:
        cells.append(f"{row['calls']} calls")
    if "peak MiB" in row:
        cells.append(f"{row['peak MiB']:.1f} MiB")
    return ", ".join(cells)


def step_cost_rows(device, dtype, quick, tiny):
    rows = []
    options = ["--device", device, "--dtype", dtype] + ["--quick"] * quick + ["--tiny"] * tiny
    # A full run also times the host-bound steps (5 rounds); a quick one counts only.
    results = step_costs.main(options + ([] if quick else ["--time", "5"]))
    for row in results.pop("scaling"):
        rows.append(
            {
                "benchmark": "loss scaling + step, calls",
                "case": f"amp {row['opt level']}, 10 tensors",
                "amp": f"{row['amp calls']} calls",
                "torch": f"{row['torch.amp.GradScaler calls']} calls",
                "calls / torch": row["amp / GradScaler"],
            }
        )
    for workload, table in results.items():
        reference = next(r for r in table if r["variant"] == "torch.autocast")
        for row in table:
            if row["variant"] in SUMMARISED:
                entry = {
                    "benchmark": f"step costs, {dtype}",
                    "case": f"{row['variant']}, {workload}",
                    "amp": _costs(row),
                    "torch": _costs(reference),
                }
                if "time / torch.autocast" in row:
                    entry["amp / torch"] = row["time / torch.autocast"]
                if "calls" in row:
                    entry["calls / torch"] = row["calls / torch.autocast"]
                if "peak MiB" in row:
                    entry["peak / torch"] = row["peak / torch.autocast"]
                rows.append(entry)
    return rows


def end_to_end_rows(device, quick, tiny):
    steps = ["--steps", "2", "--warmup", "1"] if tiny else ["--steps", "5", "--warmup", "2"]
    options = ["--device", device] + (steps if quick else [])
    rows = []
    for (model, dtype), table in end_to_end.main(options + ["--tiny"] * tiny).items():
        reference = next(r for r in table if r["variant"] == "torch.autocast")
        for row in table:
            if row["variant"] in SUMMARISED:
                entry = {
                    "benchmark": f"{model}{' (tiny)' if tiny else ''} step, {dtype}",
                    "case": row["variant"] + ("" if row["trained"] else " (did not train)"),
                    "amp": row["step time"],
                    "torch": reference["step time"],
                    "amp / torch": row["time / torch.autocast"],
                    "calls / torch": row["calls / torch.autocast"],
                }
                if "peak / torch.autocast" in row:
                    entry["peak / torch"] = row["peak / torch.autocast"]
                rows.append(entry)
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds and steps")
    parser.add_argument(
        "--tiny", action="store_true", help="models at CI sizes (GPT-2 / ResNet-50 code on a CPU)"
    )
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rounds = ["--rounds", "2", "--steps", "5"] if args.quick else []
    summary = []

    dtypes = ["bfloat16", "float16"] if device == "cuda" else ["bfloat16"]
    for dtype in dtypes:
        # Compiling four variants takes minutes: a quick run leaves the compiled rows out.
        for compiled in ([], ["--compile"])[: 1 if args.quick else 2]:
            options = ["--dtype", dtype, "--device", device] + rounds + compiled
            results = o1_transformer.main(options)
            for variant in ("amp O1", "amp.autocast"):
                summary.append(
                    {
                        "benchmark": "transformer step" + (", compiled" if compiled else ""),
                        "case": f"{variant}, {dtype}",
                        "amp": results[variant]["time"],
                        "torch": results["torch.autocast"]["time"],
                        "amp / torch": results[variant]["/ torch.autocast"],
                        "amp / fp32": results[variant]["time"] / results["fp32"]["time"],
                    }
                )

    medians = scaler_benchmark.main(["--device", device] + rounds)
    floor = medians["plain"]
    summary.append(
        {
            "benchmark": "loss scaling + step",
            "case": "300 tensors",
            "amp": medians["amp"],
            "torch": medians["torch GradScaler"],
            "amp / torch": medians["amp"] / medians["torch GradScaler"],
            "overhead / torch's": (medians["amp"] - floor) / (medians["torch GradScaler"] - floor),
        }
    )

    dtype = torch.bfloat16 if device == "cpu" else torch.float16
    for row in per_call_benchmark.rows(device, dtype, repeat=3 if args.quick else 7):
        summary.append({"benchmark": "per-call overhead", **row})

    for row in kernel_benchmark.main():
        entry = {
            "benchmark": "kernels",
            "case": row["case"],
            "amp": row["amp"],
            "torch": row["torch"],
            "amp / torch": row["amp"] / row["torch"],
        }
        if "of datasheet" in row:
            entry["of bandwidth"] = row["of datasheet"]
        summary.append(entry)

    for dtype in dtypes:
        summary += step_cost_rows(device, dtype, args.quick, args.tiny)
    if device == "cuda" or args.tiny:
        summary += end_to_end_rows(device, args.quick, args.tiny)

    print_table(
        f"summary on {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'} "
        f"(torch {torch.__version__}, amp {amp.__version__})",
        summary,
        [
            "benchmark",
            "case",
            "amp",
            "torch",
            "amp / torch",
            "amp - torch",
            "amp / fp32",
            "overhead / torch's",
            "of bandwidth",
            "calls / torch",
            "peak / torch",
        ],
        time_columns=("amp", "torch", "amp - torch"),
    )
    print(ran_on(device, args.tiny))
    return summary


if __name__ == "__main__":
    main()

"""Host time of one patched call: amp against torch.autocast, side by side.

    python benchmarks/per_call.py [--device cpu|cuda] [--dtype bfloat16|float16]
                                  [--number N] [--repeat N]

Cases, small enough that the host's work is most of a call:
  F.linear       input 4 x 16 in FP32, nn.Linear(16, 16): the input cast, weight and bias from
                 the cache (called `--number` times in one region, as a shared weight is)
  torch.matmul   the same input times the weight's transpose (its cast cached)
  F.conv2d       input 1 x 4 x 8 x 8 in FP32, a 3 x 3 kernel of 4 channels, no bias (cached)
  F.softmax      F.softmax(x, -1) on the FP32 input: an FP32 op with nothing to cast (on the CPU
                 torch's autocast leaves softmax alone, so amp's wrapper runs)
  Tensor.sum     x.sum(dim=-1) on the FP32 input: the same, its dimension given by keyword, as
                 reductions usually are
  Tensor.add     x + x: an op neither casts (amp leaves it unpatched)
  F.linear, weights cast anew
                 the same F.linear in a region of its own, less an empty region: the input,
                 weight and bias cast and the casts kept, as at a weight's first use in a step
  region         entering and leaving an empty region: amp.autocast(dtype=...) sets torch's
                 autocast state on cpu and cuda, torch.autocast(device) on one device; "one
                 device" is amp.autocast(device_type=device), the same work as torch's
  outside        F.linear outside any region while amp's patches stay installed, against the
                 original function
Each runs under amp.autocast, the cached cases also under amp O1 (no region: `amp.initialize`),
and under torch.autocast (amp's patches removed: while they are installed torch.autocast is an amp
region). Rounds alternate amp and torch; a cell is the best round's time per call: this thread's
CPU time with torch on one thread on the CPU, wall time on CUDA. The device work is the same on
both sides, so `amp - torch` is the host time amp adds per call.
"""

import argparse
import os
import sys
import time
import timeit

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from harness import print_table  # noqa: E402

import amp  # noqa: E402


def _cases(device):
    """(the model whose weights the cases use, {case: a call}, the original F.linear's call)."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(16, 16).to(device)
    conv = torch.nn.Conv2d(4, 4, 3, padding=1, bias=False).to(device)
    x = torch.randn(4, 16, device=device)
    image = torch.randn(1, 4, 8, 8, device=device)
    weight, bias, kernel = linear.weight, linear.bias, conv.weight
    original = F.linear
    # F.linear and F.conv2d are read at call time: amp patches them while it casts.
    transposed = weight.t()
    cases = {
        "F.linear": lambda: F.linear(x, weight, bias),
        "torch.matmul": lambda: torch.matmul(x, transposed),
        "F.conv2d": lambda: F.conv2d(image, kernel, None, 1, 1),
        "F.softmax": lambda: F.softmax(x, -1),
        "Tensor.sum": lambda: x.sum(dim=-1),
        "Tensor.add": lambda: x + x,
    }
    return torch.nn.Sequential(linear, conv), cases, lambda: original(x, weight, bias)


def measure(device, dtype, number=2000, repeat=7):
    """Per call, the best time of `repeat` rounds: ({case: {variant: seconds}}, {variant: seconds
    of an empty region}, {"amp": F.linear outside a region, patches installed, "torch": the
    original F.linear}). The region-per-call case has no amp O1 entry."""
    model, cases, original = _cases(device)
    variants = ("amp.autocast", "amp O1", "torch.autocast")
    times = {name: {variant: [] for variant in variants} for name in cases}
    region = {"amp.autocast": [], "torch.autocast": [], "one device": []}
    anew = {"amp.autocast": [], "torch.autocast": []}  # F.linear in a region of its own
    outside = {"amp": [], "torch": []}
    # CPU: the host's work, not the waits of a shared machine; CUDA: kernels run asynchronously.
    clock = time.perf_counter if device == "cuda" else time.thread_time

    def timed(fn):
        return timeit.timeit(fn, timer=clock, number=number) / number

    def torch_region():
        with torch.autocast(device, dtype=dtype):
            pass

    def amp_region():
        with amp.autocast(dtype=dtype):
            pass

    def amp_region_one_device():
        with amp.autocast(dtype=dtype, device_type=device):
            pass

    def torch_anew():
        with torch.autocast(device, dtype=dtype):
            cases["F.linear"]()

    def amp_anew():
        with amp.autocast(dtype=dtype):
            cases["F.linear"]()

    def one_round():
        amp.deinitialize()  # while amp's patches are installed, torch.autocast is amp's region
        with torch.autocast(device, dtype=dtype):
            for name, fn in cases.items():
                times[name]["torch.autocast"].append(timed(fn))
        region["torch.autocast"].append(timed(torch_region))
        anew["torch.autocast"].append(timed(torch_anew))
        outside["torch"].append(timed(original))
        with amp.autocast(dtype=dtype):
            for name, fn in cases.items():
                times[name]["amp.autocast"].append(timed(fn))
        region["amp.autocast"].append(timed(amp_region))
        region["one device"].append(timed(amp_region_one_device))
        anew["amp.autocast"].append(timed(amp_anew))
        outside["amp"].append(timed(cases["F.linear"]))  # the patches stay after a region
        amp.deinitialize()
        amp.initialize(model, opt_level="O1", dtype=dtype, verbosity=0)
        try:
            for name, fn in cases.items():
                times[name]["amp O1"].append(timed(fn))
        finally:
            amp.deinitialize()

    threads = torch.get_num_threads()
    if device == "cpu":
        torch.set_num_threads(1)
    try:
        for _ in range(repeat):
            one_round()
    finally:
        torch.set_num_threads(threads)
    best = lambda found: {key: min(values) for key, values in found.items()}  # noqa: E731
    calls = {name: best(found) for name, found in times.items()}
    region, anew = best(region), best(anew)
    calls["F.linear, weights cast anew"] = {
        variant: anew[variant] - region[variant] for variant in anew
    }
    return calls, region, best(outside)


def rows(device, dtype, number=2000, repeat=7):
    """The table: one row per case and amp variant, against torch's."""
    calls, region, outside = measure(device, dtype, number, repeat)
    table = []
    for name, found in calls.items():
        theirs = found["torch.autocast"]
        for variant in ("amp.autocast", "amp O1"):
            if variant not in found:
                continue
            ours = found[variant]
            table.append(
                {
                    "case": f"{name}, {variant}",
                    "amp": ours,
                    "torch": theirs,
                    "amp / torch": ours / theirs,
                    "amp - torch": ours - theirs,
                }
            )
    for name, ours, theirs in (
        ("region enter + exit", region["amp.autocast"], region["torch.autocast"]),
        ("region enter + exit, one device", region["one device"], region["torch.autocast"]),
        ("F.linear outside any region", outside["amp"], outside["torch"]),
    ):
        table.append(
            {
                "case": name,
                "amp": ours,
                "torch": theirs,
                "amp / torch": ours / theirs,
                "amp - torch": ours - theirs,
            }
        )
    return table


COLUMNS = ["case", "amp", "torch", "amp / torch", "amp - torch"]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu"
    )
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default=None)
    parser.add_argument("--number", type=int, default=2000, help="calls per round")
    parser.add_argument("--repeat", type=int, default=7, help="rounds (the best is kept)")
    args = parser.parse_args(argv)
    dtype_name = args.dtype or ("float16" if args.device == "cuda" else "bfloat16")
    table = rows(args.device, getattr(torch, dtype_name), args.number, args.repeat)
    print_table(
        f"host time per patched call, {dtype_name} on {args.device}: amp against "
        f"torch.autocast, best of {args.repeat} rounds of {args.number} calls",
        table,
        COLUMNS,
        time_columns=("amp", "torch", "amp - torch"),
    )
    return table


if __name__ == "__main__":
    main()

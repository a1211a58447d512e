"""GPT-2 small and ResNet-50 training steps end to end, every precision variant: tokens/s and
images/s, peak memory, Python calls.

    python benchmarks/end_to_end.py [--dtype float16 bfloat16] [--models gpt2 resnet50]
                                    [--steps 20] [--warmup 5] [--optimizer default|foreach|fused]
    python benchmarks/end_to_end.py --tiny    # the same code at CI sizes (any device)

GPT-2 small: 124M parameters, batch 8 x 1024 tokens; ResNet-50: batch 64 of 224x224 images
(models.py, workloads.py). The full sizes run on CUDA only. Each variant (variants.py) trains a
fresh copy of the model in turn: `--warmup` steps and any more until the loss scale settles, then
`--steps` timed steps (CUDA synchronised at both ends), then one step under cProfile. Columns:
throughput, step time / torch.autocast's (below 1.00: faster), peak bytes of the timed steps
(torch.cuda.max_memory_allocated; on CPU not measured here: step_costs.py does), Python calls of
one step, and whether the variant trained (finite loss, parameters moved).
"""

import argparse
import gc
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
import variants  # noqa: E402
import workloads  # noqa: E402
from harness import print_table  # noqa: E402
from measure import python_calls, settle  # noqa: E402

MIB = 2.0**20


def _fingerprint(model):
    """One norm per parameter: small enough to keep through a step, and it moves when they do."""
    with torch.no_grad():
        return torch.stack([p.detach().float().norm() for p in model.parameters()])


def _host_time(trainer, inputs, targets):
    """Seconds for one step to return to the caller, the device idle at its start: the host's
    share (below the step time: the device is the bound; at it: the host is)."""
    torch.cuda.synchronize()
    begin = time.perf_counter()
    trainer.step(inputs, targets)
    seconds = time.perf_counter() - begin
    torch.cuda.synchronize()
    return seconds


def _held_bytes(trainer, batch):
    """Bytes a parameter the variant holds between steps: allocated after its zero_grad (set to
    None), less the batch, over the model's parameter count."""
    trainer.zero_grad()
    gc.collect()
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - sum(t.numel() * t.element_size() for t in batch)
    return held / sum(p.numel() for p in trainer.model.parameters())


def train(workload, name, dtype, device, steps, warmup, optimizer):
    """Train variant `name` on a fresh model; returns its row (without the ratio)."""
    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    trainer = variants.setup(name, workload.build(device), workloads.loss_fn, dtype, optimizer)
    try:
        before = _fingerprint(trainer.model)
        inputs, targets = workload.batch(device)
        for _ in range(warmup):
            trainer.step(inputs, targets)
        settle(trainer, (inputs, targets))  # float16: past the skips that bring the scale down
        sync()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        begin = time.perf_counter()
        for _ in range(steps):
            loss = trainer.step(inputs, targets)
        sync()
        seconds = (time.perf_counter() - begin) / steps
        row = {
            "variant": name,
            f"{workload.unit}/s": workload.per_batch / seconds,
            "step time": seconds,
        }
        if cuda:
            row["peak MiB"] = torch.cuda.max_memory_allocated() / MIB
            row["host time"] = _host_time(trainer, inputs, targets)
            row["held B/param"] = _held_bytes(trainer, (inputs, targets))
        row["calls"] = python_calls(trainer, (inputs, targets), warmup=0)
        moved = not torch.equal(before, _fingerprint(trainer.model))
        row["trained"] = bool(torch.isfinite(loss).item()) and moved
        return row
    finally:
        trainer.close()
        del trainer
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()


def run(workload, names, dtype, device, steps, warmup, optimizer="default"):
    table = [train(workload, name, dtype, device, steps, warmup, optimizer) for name in names]
    reference = next((row for row in table if row["variant"] == variants.REFERENCE), None)
    for row in table:
        if reference:
            row["time / torch.autocast"] = row["step time"] / reference["step time"]
            row["calls / torch.autocast"] = row["calls"] / reference["calls"]
            if "peak MiB" in row:
                row["peak / torch.autocast"] = row["peak MiB"] / reference["peak MiB"]
    return table


COLUMNS = [
    "variant",
    "tokens/s",
    "images/s",
    "step time",
    "time / torch.autocast",
    "peak MiB",
    "peak / torch.autocast",
    "held B/param",
    "host time",
    "calls",
    "calls / torch.autocast",
    "trained",
]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", nargs="+", choices=["float16", "bfloat16"], default=None)
    parser.add_argument("--models", nargs="+", choices=["gpt2", "resnet50"], default=None)
    parser.add_argument(
        "--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu"
    )
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--optimizer", choices=["default", "foreach", "fused"], default="default")
    parser.add_argument("--variants", nargs="+", choices=list(variants.SETUPS), default=None)
    parser.add_argument("--tiny", action="store_true", help="CI sizes of the same models")
    args = parser.parse_args(argv)
    if args.device != "cuda" and not args.tiny:
        parser.error("GPT-2 small and ResNet-50 run on CUDA only; on CPU pass --tiny")
    if args.device == "cuda":
        torch.backends.cudnn.benchmark = True
    dtypes = args.dtype or (["float16", "bfloat16"] if args.device == "cuda" else ["bfloat16"])
    names = args.variants or list(variants.VARIANTS)
    results = {}
    for model in args.models or ["gpt2", "resnet50"]:
        workload = workloads.END_TO_END[model + ("-tiny" if args.tiny else "")]
        for dtype in dtypes:
            table = run(
                workload,
                names,
                getattr(torch, dtype),
                args.device,
                args.steps,
                args.warmup,
                args.optimizer,
            )
            results[(model, dtype)] = table
            name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
            print_table(
                f"{workload.name} training step, {dtype} on {name}, AdamW ({args.optimizer}), "
                f"{workload.per_batch} {workload.unit} a step, mean of {args.steps} steps",
                table,
                COLUMNS,
                time_columns=("step time", "host time"),
            )
    return results


if __name__ == "__main__":
    main()

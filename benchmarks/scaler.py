"""Loss scaling around an optimizer step: amp.scale_loss + step vs torch.amp.GradScaler.

    python benchmarks/scaler.py [--tensors 300] [--device cpu|cuda]

A model of `--tensors` small parameter tensors (so that the scaling machinery, not arithmetic,
dominates) trains in FP32 with dynamic loss scaling, in the same process, in rotating order:
  plain       loss.backward(); optimizer.step()                    (no scaling: the floor)
  torch       scaler.scale(loss).backward(); scaler.step(); scaler.update()
  amp         amp.initialize(O0, loss_scale="dynamic"); scale_loss; step
The table gives time per iteration, and the overhead above `plain` of each, as a ratio.
"""

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from harness import interleaved, print_table  # noqa: E402

import amp  # noqa: E402


class ManyTensors(torch.nn.Module):
    def __init__(self, tensors, width=16):
        super().__init__()
        self.layers = torch.nn.ModuleList(
            torch.nn.Linear(width, width) for _ in range(tensors // 2)
        )

    def forward(self, x):
        total = 0
        for layer in self.layers:
            total = total + layer(x)
        return total


def make(tensors, device):
    torch.manual_seed(0)
    model = ManyTensors(tensors).to(device)
    return model, torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9, foreach=True)


def run(tensors, device, steps, rounds):
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    x = torch.randn(8, 16, device=device)
    plain, torch_case, ours = make(tensors, device), make(tensors, device), make(tensors, device)
    scaler = torch.amp.GradScaler(device)

    def timed(body):
        sync()
        begin = time.perf_counter()
        for _ in range(steps):
            body()
        sync()
        return [(time.perf_counter() - begin) / steps]

    def plain_step():
        model, optimizer = plain
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()

    def torch_step():
        model, optimizer = torch_case
        optimizer.zero_grad()
        scaler.scale(model(x).square().mean()).backward()
        scaler.step(optimizer)
        scaler.update()

    def amp_step():
        model, optimizer = ours
        optimizer.zero_grad()
        with amp.scale_loss(model(x).square().mean(), optimizer) as scaled:
            scaled.backward()
        optimizer.step()

    def amp_round():
        amp.initialize(*ours, opt_level="O0", loss_scale="dynamic", verbosity=0)
        try:
            return timed(amp_step)
        finally:
            amp.deinitialize()

    variants = {
        "plain": lambda: timed(plain_step),
        "torch GradScaler": lambda: timed(torch_step),
        "amp": amp_round,
    }
    times = interleaved(variants, rounds)
    return {name: statistics.median(values) for name, values in times.items()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=300)
    parser.add_argument(
        "--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu"
    )
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args(argv)
    medians = run(args.tensors, args.device, args.steps, args.rounds)
    floor = medians["plain"]
    rows = [
        {
            "variant": name,
            "time per iteration": seconds,
            "overhead": seconds - floor,
            "/ torch": seconds / medians["torch GradScaler"],
        }
        for name, seconds in medians.items()
    ]
    overhead_ratio = (medians["amp"] - floor) / (medians["torch GradScaler"] - floor)
    print_table(
        f"loss scaling + step, {args.tensors} parameter tensors, {args.device}; "
        f"amp overhead / torch overhead = {overhead_ratio:.3f}",
        rows,
        ["variant", "time per iteration", "overhead", "/ torch"],
        time_columns=("time per iteration", "overhead"),
    )
    return medians


if __name__ == "__main__":
    main()

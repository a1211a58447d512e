"""Each fused step kernel alone against torch's fused AdamW and a device copy of the same bytes:
time per step and effective bandwidth (the bytes a step must move / its time).

    python benchmarks/step_kernels.py [--millions 100 470]    # on a GPU: the CuPy kernels
    python benchmarks/step_kernels.py --tiny                   # CPU: the torch backend, 2M

The parameters are split into 16 tensors (a model's are many). Bytes per parameter each case
must move, read and written (8-bit moments: 1 byte each way per code, plus one FP32 scale per
_codecs.BLOCK elements each way):

  torch fused AdamW   FP32 param r/w 8, FP32 grad 4, FP32 moments r/w 16            = 28
  adam fp32 master    bf16 grad 2, FP32 master r/w 8, bf16 copy written 2, moments 16 = 28
  adam remainder      bf16 grad 2, bf16 weight + int16 remainder r/w 8, moments 16   = 26
  adam compact int8   bf16 grad 2, bf16 weight + int8 correction r/w 6, codes r/w 4,
                      scales                                                        ~ 12.5
  sgd remainder       bf16 grad 2, weight + remainder r/w 8, FP32 momentum r/w 8     = 18
  sgd compact int8    bf16 grad 2, weight + correction r/w 6, codes r/w 2, scales    ~ 10.3

"copy" is a device-to-device copy moving the same bytes (half read, half written): the
bandwidth this memory gives a kernel that only streams. Ratios: time / torch fused AdamW's and
time / the copy's (1.00: at the copy's bandwidth).
"""

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from harness import interleaved, print_table  # noqa: E402

from amp import kernels  # noqa: E402
from amp.kernels import _codecs  # noqa: E402

TENSORS = 16
ADAM = kernels.AdamOptions(1e-4, 0.9, 0.999, 1e-8, 0.01, True)
SGD = kernels.SGDOptions(1e-4, 0.9, 0.0, 0.0, False)


def _scales_bytes(numel):
    return 2 * 4 * kernels.moment_scales(numel)  # read and written, FP32


def _split(numel):
    size = numel // TENSORS
    return [size] * TENSORS


def _weights(sizes, device):
    return [torch.randn(size, device=device) * 0.02 for size in sizes]


def _grads(sizes, device, dtype=torch.bfloat16):
    return [(torch.randn(size, device=device) * 1e-3).to(dtype) for size in sizes]


def _steps(device):
    return [torch.zeros((), device=device) for _ in range(TENSORS)]


def torch_fused(sizes, device):
    params = _weights(sizes, device)
    grads = _grads(sizes, device, torch.float32)
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    steps = _steps(device)

    def step():
        torch._fused_adamw_(
            params, grads, m, v, [], steps, lr=1e-4, beta1=0.9, beta2=0.999,
            weight_decay=0.01, eps=1e-8, amsgrad=False, maximize=False,
        )

    return step, 28 * sum(sizes)


def adam_fp32_master(sizes, device):
    masters = _weights(sizes, device)
    lows = [t.to(torch.bfloat16) for t in masters]
    grads = _grads(sizes, device)
    m = [torch.zeros_like(t) for t in masters]
    v = [torch.zeros_like(t) for t in masters]
    steps, inv, found = _steps(device), torch.ones((), device=device), torch.zeros((), device=device)

    def step():
        kernels.adam_step_(grads, lows, masters, m, v, steps, ADAM, inv_scale=inv, found_inf=found)

    return step, 28 * sum(sizes)


def _remainders(sizes, device):
    pairs = [kernels.remainder_encode(t) for t in _weights(sizes, device)]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def _compact(sizes, device):
    pairs = [kernels.compact_encode(t) for t in _weights(sizes, device)]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def _codes(sizes, device, signed):
    codes, scales = zip(*(kernels.moment_encode(torch.zeros(s, device=device), signed) for s in sizes))
    return list(codes), list(scales)


def adam_remainder(sizes, device):
    lows, rests = _remainders(sizes, device)
    grads = _grads(sizes, device)
    m = [torch.zeros(s, device=device) for s in sizes]
    v = [torch.zeros(s, device=device) for s in sizes]
    steps, inv, found = _steps(device), torch.ones((), device=device), torch.zeros((), device=device)

    def step():
        kernels.adam_step_(grads, lows, rests, m, v, steps, ADAM, inv_scale=inv, found_inf=found)

    return step, 26 * sum(sizes)


def adam_compact_int8(sizes, device):
    lows, rests = _compact(sizes, device)
    grads = _grads(sizes, device)
    m, m_scales = _codes(sizes, device, True)
    v, v_scales = _codes(sizes, device, False)
    steps, inv, found = _steps(device), torch.ones((), device=device), torch.zeros((), device=device)

    def step():
        kernels.adam_step_(
            grads, lows, rests, m, v, steps, ADAM,
            scales=(m_scales, v_scales), inv_scale=inv, found_inf=found,
        )

    return step, sum(12 * s + 2 * _scales_bytes(s) for s in sizes)


def sgd_remainder(sizes, device):
    lows, rests = _remainders(sizes, device)
    grads = _grads(sizes, device)
    buffers = [torch.zeros(s, device=device) for s in sizes]
    inv, found = torch.ones((), device=device), torch.zeros((), device=device)

    def step():
        kernels.sgd_step_(grads, lows, rests, buffers, SGD, inv_scale=inv, found_inf=found)

    return step, 18 * sum(sizes)


def sgd_compact_int8(sizes, device):
    lows, rests = _compact(sizes, device)
    grads = _grads(sizes, device)
    buffers, scales = _codes(sizes, device, True)
    inv, found = torch.ones((), device=device), torch.zeros((), device=device)

    def step():
        kernels.sgd_step_(
            grads, lows, rests, buffers, SGD, scales=scales, inv_scale=inv, found_inf=found
        )

    return step, sum(10 * s + _scales_bytes(s) for s in sizes)


CASES = {
    "torch fused AdamW": torch_fused,
    "adam fp32 master": adam_fp32_master,
    "adam remainder": adam_remainder,
    "adam compact int8": adam_compact_int8,
    "sgd remainder": sgd_remainder,
    "sgd compact int8": sgd_compact_int8,
}


def _timing(fn, cuda, inner):
    def measure():
        fn()
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(inner):
                fn()
            end.record()
            end.synchronize()
            return [start.elapsed_time(end) / 1e3 / inner]
        import time

        begin = time.perf_counter()
        for _ in range(inner):
            fn()
        return [(time.perf_counter() - begin) / inner]

    return measure


def run(numel, device, repeat=5, inner=5):
    cuda = device.type == "cuda"
    sizes = _split(numel)
    steps, moved = {}, {}
    for name, make in CASES.items():
        steps[name], moved[name] = make(sizes, device)
    copy_bytes = {name: moved[name] // 2 for name in CASES}
    sources = {name: torch.empty(b, dtype=torch.uint8, device=device) for name, b in copy_bytes.items()}
    targets = {name: torch.empty_like(s) for name, s in sources.items()}
    variants = {name: _timing(step, cuda, inner) for name, step in steps.items()}
    variants.update(
        {f"copy {name}": _timing(lambda n=name: targets[n].copy_(sources[n]), cuda, inner) for name in CASES}
    )
    times = {name: statistics.median(t) for name, t in interleaved(variants, repeat).items()}
    reference = times["torch fused AdamW"]
    rows = []
    for name in CASES:
        seconds = times[name]
        rows.append(
            {
                "kernel": name,
                "bytes/param": moved[name] / (numel // TENSORS * TENSORS),
                "time": seconds,
                "TB/s": moved[name] / seconds / 1e12,
                "copy TB/s": moved[name] / times[f"copy {name}"] / 1e12,
                "/ torch fused": seconds / reference,
                "/ copy": seconds / times[f"copy {name}"],
            }
        )
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--millions", type=float, nargs="+", default=[100, 470])
    parser.add_argument("--tiny", action="store_true", help="2M parameters, any device")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sizes = [2] if args.tiny or device.type != "cuda" else args.millions
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"backend: {kernels.cuda_backend() if device.type == 'cuda' else 'torch (CPU)'}; "
          f"block {_codecs.BLOCK}")
    results = {}
    for millions in sizes:
        numel = int(millions * 1e6)
        rows = run(numel, device)
        results[millions] = rows
        print_table(
            f"Step kernels alone, {millions:g}M parameters in {TENSORS} tensors, on {name}",
            rows,
            ["kernel", "bytes/param", "time", "TB/s", "copy TB/s", "/ torch fused", "/ copy"],
            time_columns=("time",),
        )
    return results


if __name__ == "__main__":
    main()

"""The first use of amp's CUDA kernels on a GPU: the seconds each family of kernels takes to compile
(NVRTC, through CuPy) and load, with CuPy's on-disk cache empty (a fresh CUPY_CACHE_DIR).

    python benchmarks/first_use.py

A run compiles a family when it first launches one of its kernels (amp/kernels/_sources.py):
the probe of amp.kernels.cuda_backend() compiles the unscale family (unscale and check: all an
O1 run launches), the copies and norms families compile whole, the step families a kernel at a
time. Printed: the probe, then each family (for the step families, the kernels an O2 bf16 run,
an O2 fp16 run and a compact + int8 run launch, each alone).
"""

import os
import tempfile
import time

os.environ["CUPY_CACHE_DIR"] = tempfile.mkdtemp(prefix="amp-first-use-")  # before CuPy loads

import torch  # noqa: E402

from amp import kernels  # noqa: E402

RUNS = {
    "steps": ["amp_adam<__half, __half>", "amp_count_steps"],
    "compact": [
        "amp_compact_adam<__nv_bfloat16, amp::Remainder, float>",
        "amp_compact_adam<__nv_bfloat16, amp::Compact, amp::Codes8>",
        "amp_compact_count_steps",
    ],
}


def main():
    begin = time.perf_counter()
    choice = kernels.cuda_backend()
    print(f"cuda_backend() (compiles the unscale family): {time.perf_counter() - begin:.2f} s")
    print(choice)
    if choice.name != "cupy":
        return
    from amp.kernels import _cupy_device, _sources

    device = _cupy_device.gpu(torch.cuda.current_device())
    for family in ("copies", "norms"):
        device.compile(family)
    for names in RUNS.values():
        for name in names:
            device.functions[name]
    torch.cuda.synchronize()
    print("| module | names | seconds |")
    print("|---|---|---|")
    for key, seconds in device.compile_seconds.items():
        family = _sources.FAMILIES.get(key)
        count = len(family.names) if family else 1
        print(f"| `{key}` | {count} | {seconds:.2f} |")


if __name__ == "__main__":
    main()

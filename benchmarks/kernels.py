"""amp's multi-tensor kernels side by side with torch's, and against the memory-bandwidth limit.

    python benchmarks/kernels.py            # on a GPU: CuPy kernels; on CPU: the torch backend

Cases (float32 unless named):
  large unscale      one large tensor, in place (8 bytes per element); amp vs
                     torch._amp_foreach_non_finite_check_and_unscale_ vs a device-to-device copy;
                     achieved GB/s as a fraction of the datasheet bandwidth
  1000 small         1,000 tensors of 4,096 elements, in place: time per call, host included
  fp16 -> fp32       model gradients into master gradients with unscale (6 bytes per element);
                     torch's way: _foreach_copy_ then the unscale op
  fp32 -> fp16       master weights into the model (6 bytes per element); torch: _foreach_copy_
  l2 norm            of 300 tensors; torch: _foreach_norm + vector_norm
Ratios are amp / torch (below 1.00: amp is faster).
"""

import statistics
import sys
import time

import torch

sys.path.insert(0, __import__("os").path.dirname(__file__))
from harness import interleaved, print_table  # noqa: E402

from amp import kernels  # noqa: E402

DATASHEET_BYTES_PER_SECOND = {  # by torch.cuda.get_device_name(); leads, not readings
    "NVIDIA H200": 4.8e12,
    "NVIDIA H100 80GB HBM3": 3.35e12,
    "NVIDIA H100": 3.35e12,
    "NVIDIA A100-SXM4-80GB": 2.039e12,
    "NVIDIA A100-SXM4-40GB": 1.555e12,
}


class Timer:
    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def _one(self, fn, inner):
        """Seconds per call over `inner` back-to-back calls (CUDA events on a GPU)."""
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(inner):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3 / inner
        begin = time.perf_counter()
        for _ in range(inner):
            fn()
        return (time.perf_counter() - begin) / inner

    def compare(self, amp_fn, torch_fn, repeat=15, inner=1, wall=False):
        """(amp, torch) median seconds per call, the two measured in rotating order.

        wall=True times with the host clock, the device drained at both ends: for host-bound
        work (many small tensors), where the launch cost is what is measured.
        """

        def timings(fn):
            def measure():
                fn()  # warm-up: compilation, allocator
                if wall:
                    if self.cuda:
                        torch.cuda.synchronize()
                    begin = time.perf_counter()
                    for _ in range(inner):
                        fn()
                    if self.cuda:
                        torch.cuda.synchronize()
                    return [(time.perf_counter() - begin) / inner]
                return [self._one(fn, inner)]

            return measure

        times = interleaved({"amp": timings(amp_fn), "torch": timings(torch_fn)}, repeat)
        return statistics.median(times["amp"]), statistics.median(times["torch"])


def torch_unscale(tensors, inv_scale, found_inf):
    for dtype in {t.dtype for t in tensors}:
        torch._amp_foreach_non_finite_check_and_unscale_(
            [t for t in tensors if t.dtype is dtype], found_inf, inv_scale
        )


def alternating(fn_with_inv, device):
    """A call that unscales by 0.5 then by 2.0, so values stay put across repetitions."""
    half = torch.full((), 0.5, device=device)
    double = torch.full((), 2.0, device=device)
    return lambda: (fn_with_inv(half), fn_with_inv(double))


def bandwidth_row(case, amp_time, torch_time, bytes_moved, datasheet):
    """A table row for a memory-bound case: times, amp's GB/s and its fraction of the datasheet."""
    row = {
        "case": case,
        "amp": amp_time,
        "torch": torch_time,
        "amp GB/s": bytes_moved / amp_time / 1e9,
    }
    if datasheet:
        row["of datasheet"] = bytes_moved / amp_time / datasheet
    return row


def run(device):
    timer = Timer(device)
    found = torch.zeros((), device=device)
    rows = []
    datasheet = (
        DATASHEET_BYTES_PER_SECOND.get(torch.cuda.get_device_name(device))
        if device.type == "cuda"
        else None
    )

    # Large in-place unscale.
    numel = 2**28 if device.type == "cuda" else 2**23
    big = [torch.randn(numel, device=device)]
    amp_time, torch_time = timer.compare(
        alternating(lambda inv: kernels.unscale_(big, inv, found), device),
        alternating(lambda inv: torch_unscale(big, inv, found), device),
    )
    amp_time, torch_time = amp_time / 2, torch_time / 2
    copy_source = torch.empty_like(big[0])
    copy_time, _ = timer.compare(lambda: copy_source.copy_(big[0]), lambda: None, repeat=5)
    moved = 8 * numel
    row = bandwidth_row(
        f"large unscale ({numel * 4 / 2**20:.0f} MiB)", amp_time, torch_time, moved, datasheet
    )
    row["copy GB/s"] = moved / copy_time / 1e9
    if datasheet:
        row["torch of datasheet"] = moved / torch_time / datasheet
    rows.append(row)

    # Many small tensors: host-bound, so wall time per call.
    small = [torch.randn(4096, device=device) for _ in range(1000)]
    inv = torch.full((), 1.0, device=device)
    amp_time, torch_time = timer.compare(
        lambda: kernels.unscale_(small, inv, found),
        lambda: torch_unscale(small, inv, found),
        inner=50,
        wall=True,
    )
    rows.append({"case": "1000 small tensors", "amp": amp_time, "torch": torch_time})

    # Model gradients (fp16) into master gradients (fp32).
    numel = 2**27 if device.type == "cuda" else 2**22
    sources = [torch.randn(numel, device=device).half()]
    destinations = [torch.empty(numel, device=device)]
    inv = torch.full((), 2.0**-16, device=device)

    def torch_unscale_to():
        torch._foreach_copy_(destinations, sources)
        torch_unscale(destinations, inv, found)

    amp_time, torch_time = timer.compare(
        lambda: kernels.unscale_to_(sources, destinations, inv, found), torch_unscale_to
    )
    rows.append(
        bandwidth_row("fp16 grads -> fp32 masters", amp_time, torch_time, 6 * numel, datasheet)
    )

    # Master weights into the model.
    masters = [torch.randn(numel, device=device)]
    model = [torch.empty(numel, device=device, dtype=torch.float16)]
    amp_time, torch_time = timer.compare(
        lambda: kernels.copy_(masters, model), lambda: torch._foreach_copy_(model, masters)
    )
    rows.append(
        bandwidth_row("fp32 masters -> fp16 params", amp_time, torch_time, 6 * numel, datasheet)
    )

    # L2 norm over 300 tensors.
    grads = [torch.randn(n, device=device) for n in ([65536] * 200 + [1 << 20] * 100)]

    def torch_norm():
        return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))

    amp_time, torch_time = timer.compare(
        lambda: kernels.l2_norm(grads), torch_norm, inner=5, wall=True
    )
    rows.append({"case": "l2 norm, 300 tensors", "amp": amp_time, "torch": torch_time})
    return rows


def main():
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    backend = kernels.cuda_backend() if device.type == "cuda" else None
    title = f"kernels on {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}"
    if backend is not None:
        title += f"; CUDA backend: {backend.name} ({backend.reason})"
    rows = run(device)
    for row in rows:
        row["amp / torch"] = row["amp"] / row["torch"]
    print_table(
        title,
        rows,
        [
            "case",
            "amp",
            "torch",
            "amp / torch",
            "amp GB/s",
            "copy GB/s",
            "of datasheet",
            "torch of datasheet",
        ],
        time_columns=("amp", "torch"),
    )
    return rows


if __name__ == "__main__":
    main()

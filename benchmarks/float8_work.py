"""The device work of one FP8 linear's forward and backward, counted on the CPU: kernel launches and
bytes moved, against the floor its recipe allows (the CPU proxy of the eager FP8 speed, issue 50).

    python benchmarks/float8_work.py                  # 4096 -> 14336, 16,384 tokens, bf16
    python benchmarks/float8_work.py --compiled       # and torch.compile's (inductor on the CPU)

Rows, per recipe (tensorwise, rowwise):
  traced         float8.Float8Linear run eagerly: torch operations, what amp's eager FP8 was
                 before the fused casts (and still is on CPU tensors under torch.compile)
  eager          float8_eager.Float8LinearEager on the float8*.cu kernels (CUDA, CuPy): the first
                 micro-batch after an optimizer step, which casts the weight
  eager, cached  the same, a later micro-batch of the step: the weight's layouts from the cache
  compiled       float8.Float8Linear under torch.compile (--compiled): inductor's kernels for the
                 CPU, bytes from its scheduler; compiled at three small sizes of the same
                 proportions and extrapolated (bytes are a quadratic in the size)

Counted by benchmarks/device_work.py's DeviceWork below autograd on FakeTensors at the real sizes
(aten ops: launches, and the bytes an ideal kernel reads and writes); the float8*.cu kernels from
their jobs: amp_f8_amax reads the matrix and writes its amaxes, amp_f8_cast reads the matrix and
the amaxes and writes each FP8 layout, the scales and the inverses, amp_f8_scale_outer reads and
writes the matrix and reads the inverses.

The floor, for x (T x K), w (N x K) and dy (T x N) in bf16 (2 bytes), FP8 (1 byte):
  casts   dynamic scaling needs a tensor's amax before its first value is cast: each bf16 tensor
          is read twice (the amax pass, the cast pass) and each FP8 layout its matmuls take is
          written once: x and dy in two layouts each (row-major for forward / grad-input, the
          transpose for grad-weight), w in two (forward, grad-input), once per optimizer step:
            x  4TK read, 2TK written;  w  4NK read, 2NK written;  dy  4TN read, 2TN written.
          Rowwise needs no more passes: one reduction pass gives a tensor's row and column
          amaxes, one cast pass writes the row-scaled layout and the column-scaled transpose.
  matmuls each operand read once, the output written once: forward TK + NK read, 2TN written;
          grad-input TN + NK read, 2TK written; grad-weight TN + TK read, 2NK written. Rowwise
          grad-input and grad-weight (no fast accumulation: torchao scales their outputs after a
          matmul with unit scales) read and write their outputs once more: 4TK + 4NK.
  launches 2 per cast tensor and 1 per matmul: 9 (7 with the weight cached), rowwise 2 more for
          the output scaling. Scales are a few floats a row: left out.
"""

import argparse
import contextlib
import os
import sys
import warnings
from unittest import mock

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import device_work  # noqa: E402
import kernel_work  # noqa: E402
from harness import print_table  # noqa: E402

from amp.casting import float8, float8_eager, float8_weights  # noqa: E402
from amp.kernels import _float8_layout  # noqa: E402
from amp.kernels import float8 as kernels8  # noqa: E402

GB = 1e9
SIZES = dict(tokens=16384, in_features=4096, out_features=14336)
RECIPES = ("tensorwise", "rowwise")


def floor(recipe, tokens, in_features, out_features, cached=False):
    """(launches, bytes) of the module docstring's floor."""
    t, k, n = tokens, in_features, out_features
    moved = 6 * t * k + 6 * t * n  # the casts of x and dy
    moved += (t * k + n * k + 2 * t * n) + (t * n + n * k + 2 * t * k) + (t * n + t * k + 2 * n * k)
    launches = 7
    if not cached:
        moved += 6 * n * k
        launches += 2
    if float8.RECIPES[recipe].rowwise:
        moved += 4 * t * k + 4 * n * k
        launches += 2
    return launches, moved


def _bytes(tensor):
    return 0 if tensor is None else tensor.numel() * tensor.element_size()


class Float8Kernels:
    """Stands in for amp/kernels/_cupy_float8.py: counts float8*.cu's launches and bytes."""

    def __init__(self):
        self.work = kernel_work.KernelWork()

    def cast(self, jobs, float8_dtype, power_of_2):
        self.work.launches += 2 * -(-len(jobs) // _float8_layout.JOBS)
        for job in jobs:
            source = _bytes(job.src)
            amaxes = _bytes(job.amax) + (0 if job.amax_t is job.amax else _bytes(job.amax_t))
            shared = job.scale_t is job.scale
            scales = 2 * (_bytes(job.scale) + (0 if shared else _bytes(job.scale_t)))
            self.work.read += 2 * source + amaxes
            self.work.written += amaxes + _bytes(job.out) + _bytes(job.out_t) + scales

    def scale_outer_(self, out, row_inverse, col_inverse):
        self.work.launches += 1
        self.work.read += _bytes(out) + _bytes(row_inverse) + _bytes(col_inverse)
        self.work.written += _bytes(out)


@contextlib.contextmanager
def fused(kernels):
    """The eager Function on FakeTensors, the float8*.cu kernels counted by `kernels`."""
    with mock.patch.object(float8_eager, "takes", lambda input, weight: True), mock.patch.object(
        kernels8, "_cupy_for", lambda tensor: kernels
    ), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the cache reads FakeTensors' data pointers (0)
        yield
    float8_weights.CACHE.clear()


def _tensors(tokens, in_features, out_features):
    x = torch.randn(tokens, in_features, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.nn.Parameter(torch.randn(out_features, in_features, dtype=torch.bfloat16))
    grad = torch.randn(tokens, out_features, dtype=torch.bfloat16)
    return x, weight, grad


def _counted(step, kernels=None):
    """(launches, bytes) of step(), aten ops and the float8*.cu kernels."""
    counter = device_work.DeviceWork(fake=True)
    before = (0, 0) if kernels is None else (kernels.work.launches, kernels.work.bytes)
    with counter:
        step()
    launches = sum(phase.launches for phase in counter.phases.values())
    moved = sum(phase.bytes for phase in counter.phases.values())
    if kernels is not None:
        launches += kernels.work.launches - before[0]
        moved += kernels.work.bytes - before[1]
    return launches, moved


def eager_rows(recipe, tokens, in_features, out_features):
    """{row name: (launches, bytes)} of the traced Function and of the eager one, first and
    cached micro-batch, at the real sizes on FakeTensors."""
    settings = float8.RECIPES[recipe]
    with FakeTensorMode(allow_non_fake_inputs=True):
        x, weight, grad = _tensors(tokens, in_features, out_features)

        def step(function=float8.linear):
            x.grad = weight.grad = None  # no accumulation into the last step's gradients
            function(x, weight, None, settings).backward(grad)

        def traced(x, weight, bias, settings):
            return float8.Float8Linear.apply(x, weight, settings)

        rows = {"traced": _counted(lambda: step(traced))}
        kernels = Float8Kernels()
        with fused(kernels):
            rows["eager"] = _counted(step, kernels)
            rows["eager, cached"] = _counted(step, kernels)
    return rows


def _inductor_work(recipe, tokens, in_features, out_features):
    """(kernels, bytes) of the compiled forward and backward, from inductor's scheduler."""
    from torch._functorch import config as functorch_config
    from torch._inductor import config
    from torch._inductor import scheduler as inductor_scheduler

    found = []
    codegen = inductor_scheduler.Scheduler.codegen

    def counting(self):
        for node in self.nodes:
            if not isinstance(node, inductor_scheduler.NopKernelSchedulerNode):
                found.append(node.get_read_write_buffers_sizes())
        return codegen(self)

    settings = float8.RECIPES[recipe]
    x, weight, grad = _tensors(tokens, in_features, out_features)
    torch._dynamo.reset()
    with mock.patch.object(inductor_scheduler.Scheduler, "codegen", counting), config.patch(
        fx_graph_cache=False
    ), functorch_config.patch(enable_autograd_cache=False):  # cached graphs skip codegen
        compiled = torch.compile(lambda x, w: float8.Float8Linear.apply(x, w, settings))
        compiled(x, weight).backward(grad)
    torch._dynamo.reset()
    return len(found), sum(found)


def compiled_row(recipe, tokens, in_features, out_features, unit=16):
    """(launches, bytes) of the compiled step at the real sizes: inductor's kernels at sizes a =
    4, 8 and 16 units of the same proportions (a unit: `unit` elements of the smallest
    dimension, so every size stays a multiple of 16), its kernel count at the largest, its bytes
    fitted to a quadratic in a and taken at the real a."""
    real = min(tokens, in_features, out_features) // unit
    shape = [size // real for size in (tokens, in_features, out_features)]
    points = [(a, _inductor_work(recipe, *[s * a for s in shape])) for a in (4, 8, 16)]
    (a1, (_, b1)), (a2, (_, b2)), (a3, (kernels, b3)) = points
    # Newton's divided differences: exact for a quadratic.
    d1, d2 = (b2 - b1) / (a2 - a1), (b3 - b2) / (a3 - a2)
    c2 = (d2 - d1) / (a3 - a1)
    return kernels, int(round(b1 + d1 * (real - a1) + c2 * (real - a1) * (real - a2)))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=SIZES["tokens"])
    parser.add_argument("--in-features", type=int, default=SIZES["in_features"])
    parser.add_argument("--out-features", type=int, default=SIZES["out_features"])
    parser.add_argument("--recipes", nargs="+", choices=RECIPES, default=list(RECIPES))
    parser.add_argument("--compiled", action="store_true", help="count torch.compile's too")
    args = parser.parse_args(argv)
    sizes = (args.tokens, args.in_features, args.out_features)
    table = []
    for recipe in args.recipes:
        rows = eager_rows(recipe, *sizes)
        if args.compiled:
            rows["compiled"] = compiled_row(recipe, *sizes)
        for name, (launches, moved) in rows.items():
            least_launches, least = floor(recipe, *sizes, cached=name == "eager, cached")
            table.append(
                {
                    "recipe": recipe,
                    "variant": name,
                    "launches": launches,
                    "GB moved": moved / GB,
                    "floor launches": least_launches,
                    "floor GB": least / GB,
                    "GB / floor": moved / least,
                }
            )
    print_table(
        f"one FP8 linear {args.in_features} -> {args.out_features}, {args.tokens} tokens, bf16: "
        "forward + backward",
        table,
        ["recipe", "variant", "launches", "floor launches", "GB moved", "floor GB", "GB / floor"],
    )
    return table


if __name__ == "__main__":
    main()

"""The device work of amp's CuPy kernels, which launch outside aten (so benchmarks/device_work.py's
DeviceWork never sees them), counted analytically from their launch arguments: `kernel_traffic()`
counts every launch made inside it, `launch_traffic()` one launch.

KERNEL_ACCESS: the bytes per element each pointer list of a kernel reads and writes, by the
element types in the kernel's name; a list of null pointers is not touched; per-tensor counters
such as Adam's step count 4 bytes each way per tensor; the compact steps' 8-bit moments have a
4-byte scale per block of 32 elements, read and written once a block.
"""

import contextlib
import dataclasses
from unittest import mock

_ELEMENT_BYTES = {"float": 4, "__half": 2, "__nv_bfloat16": 2}
# kernel -> per pointer list: (bytes read, bytes written) per element, "In"/"Out" standing for the
# size of the first/second type in the kernel's name; ("tensor", read, written) for a per-tensor
# counter.
KERNEL_ACCESS = {
    "amp_unscale": (("In", "In"),),  # in place
    "amp_scale_copy": (("In", 0), (0, "Out")),
    "amp_scale_add": (("In", 0), ("Out", "Out")),
    "amp_sum_squares": (("In", 0),),
    "amp_check": (("In", 0),),
    # gradient, master, exp_avg, exp_avg_sq, low-precision weight, step
    "amp_adam": (("In", 0), (4, 4), (4, 4), (4, 4), (0, "Out"), ("tensor", 4, 0)),
    "amp_count_steps": ((0, 0),) * 5 + (("tensor", 4, 4),),
    # gradient, master, momentum buffer, low-precision weight
    "amp_sgd": (("In", 0), (4, 4), (4, 4), (0, "Out")),
    "amp_compact_count_steps": ((0, 0),) * 7 + (("tensor", 4, 4),),
}
_SCALE_BYTES = 4  # an 8-bit moment's fp32 scale, one per _BLOCK elements
_BLOCK = 32
# The compact steps' lists by their template arguments: the master's two lists (a compact
# master's bf16 weight and int8 correction, or an FP32 master and its copy, written only), and a
# moment's bytes an element (FP32, bf16, 8-bit codes with ("block", ...) scales).
_COMPACT_MASTERS = {"amp::Compact": ((2, 2), (1, 1)), "amp::Remainder": ((2, 2), (2, 2))}
_COMPACT_MOMENTS = {"float": 4, "__nv_bfloat16": 2, "amp::Codes8": 1}


def _compact_access(base, types):
    """KERNEL_ACCESS's rows for amp_compact_adam / amp_compact_sgd<G, Master, Moment>."""
    grad, master, moment = types
    lists = _COMPACT_MASTERS.get(master)
    if lists is None:  # amp::Exact<L>
        lists = ((4, 4), (0, _ELEMENT_BYTES[master.removeprefix("amp::Exact<").rstrip(">")]))
    size = _COMPACT_MOMENTS[moment]
    held = (size, size)
    scales = ("block", _SCALE_BYTES, _SCALE_BYTES) if moment == "amp::Codes8" else (0, 0)
    if base == "amp_compact_adam":  # ..., exp_avg, exp_avg_sq, their scales, step
        return ((_ELEMENT_BYTES[grad], 0), *lists, held, held, scales, scales, ("tensor", 4, 0))
    return ((_ELEMENT_BYTES[grad], 0), *lists, held, scales, (0, 0))  # ..., buffer, its scales


@dataclasses.dataclass
class KernelWork:
    """Launches and the bytes they read and write (device_work.PhaseWork adds host reads)."""

    launches: int = 0
    read: int = 0
    written: int = 0

    @property
    def bytes(self):
        return self.read + self.written


def launch_traffic(name, meta):
    """(bytes read, bytes written) of one launch of kernel `name` (e.g. "amp_adam<__half,
    float>") with its Meta record (amp/kernels/_layout.py)."""
    base, _, types = name.partition("<")
    types = [t.strip() for t in types[:-1].split(",") if t.strip()]
    if base in ("amp_compact_adam", "amp_compact_sgd"):
        accesses, size_of = _compact_access(base, types), {}
    else:
        sizes = [_ELEMENT_BYTES[t] for t in types]
        size_of = {"In": sizes[0] if sizes else 0, "Out": sizes[-1] if sizes else 0}
        accesses = KERNEL_ACCESS[base]
    record = meta[0]
    count = int(record["ntensors"])
    numels = record["numel"][:count].astype("int64")
    read = written = 0
    for row, access in enumerate(accesses):
        touched = record["ptr"][row, :count] != 0
        if access[0] == "tensor":
            read += access[1] * int(touched.sum())
            written += access[2] * int(touched.sum())
            continue
        if access[0] == "block":
            blocks = int(((numels[touched] + _BLOCK - 1) // _BLOCK).sum())
            read += access[1] * blocks
            written += access[2] * blocks
            continue
        elements = int(numels[touched].sum())
        read += elements * size_of.get(access[0], access[0])
        written += elements * size_of.get(access[1], access[1])
    return read, written


@contextlib.contextmanager
def kernel_traffic():
    """Count amp's CuPy kernel launches and their bytes (a KernelWork) while inside."""
    from amp.kernels import _cupy_device

    work = KernelWork()
    run, launch = _cupy_device.run, _cupy_device.launch

    def count(name, launches):
        for packed in launches:
            read, written = launch_traffic(name, packed.meta)
            work.launches += 1
            work.read += read
            work.written += written

    def counting_run(name, launches, *args, **kwargs):
        count(name, launches)
        return run(name, launches, *args, **kwargs)

    def counting_launch(name, *args, **kwargs):
        launches = launch(name, *args, **kwargs)
        count(name, launches)
        return launches

    with mock.patch.object(_cupy_device, "run", counting_run), mock.patch.object(
        _cupy_device, "launch", counting_launch
    ):
        yield work

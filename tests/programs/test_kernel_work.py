"""benchmarks/kernel_work.py: amp's CuPy kernels counted from their launch arguments by the rule
KERNEL_ACCESS documents."""

import sys

from amp.kernels import _layout
from helpers import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import kernel_work  # noqa: E402

N = 1000  # elements per tensor: 4,000 bytes in float32


def test_amps_cupy_kernels_count_each_pointer_list_by_its_access():
    """kernel_traffic's rule: bytes per element of each list by the kernel's types; a list of
    null pointers (no low-precision weights) is not touched; Adam's step counts per tensor."""
    numels = [N, 2 * N]
    rows = [[1, 2]] * 4 + [[0, 0], [5, 6]]  # no low-precision weights
    (launch,) = _layout.plan(rows, numels, capacity=8)
    read, written = kernel_work.launch_traffic("amp_adam<__nv_bfloat16, float>", launch.meta)
    assert (read, written) == (3 * N * (2 + 12) + 2 * 4, 3 * N * 12)
    rows[4] = [3, 4]
    (launch,) = _layout.plan(rows, numels, capacity=8)
    read, written = kernel_work.launch_traffic("amp_adam<__half, __half>", launch.meta)
    assert (read, written) == (3 * N * 14 + 8, 3 * N * 14)  # 28 bytes an element in all
    (launch,) = _layout.plan(rows[:1], numels, capacity=8)
    assert kernel_work.launch_traffic("amp_check<__half>", launch.meta) == (3 * N * 2, 0)


def test_the_compact_steps_count_their_forms_bytes_and_8_bit_scales_by_block():
    """A compact master (bf16 weight 2 + 2, int8 correction 1 + 1) with 8-bit moments (1 + 1
    each, and a 4-byte scale read and written per 32 elements) and a bf16 gradient (2 read):
    12 bytes a parameter, 12.5 with the scales; an exact master with FP32 moments moves what
    amp_adam moves."""
    numels = [N, 2 * N]
    blocks = -(-N // 32) + -(-2 * N // 32)
    rows = [[1, 2]] * 8
    (launch,) = _layout.plan(rows, numels, capacity=8)
    name = "amp_compact_adam<__nv_bfloat16, amp::Compact, amp::Codes8>"
    read, written = kernel_work.launch_traffic(name, launch.meta)
    assert (read, written) == (3 * N * 7 + 2 * 4 * blocks + 2 * 4, 3 * N * 5 + 2 * 4 * blocks)
    assert 12.5 <= (read + written - 2 * 4) / (3 * N) < 12.6
    name = "amp_compact_adam<__nv_bfloat16, amp::Exact<__nv_bfloat16>, float>"
    assert kernel_work.launch_traffic(name, launch.meta) == (3 * N * 14 + 8, 3 * N * 14)
    rows[2] = [0, 0]  # no copies: the second list is not touched
    (launch,) = _layout.plan(rows, numels, capacity=8)
    name = "amp_compact_adam<float, amp::Exact<float>, __nv_bfloat16>"
    assert kernel_work.launch_traffic(name, launch.meta) == (3 * N * 12 + 8, 3 * N * 8)
    (launch,) = _layout.plan([[1, 2]] * 6, numels, capacity=8)
    name = "amp_compact_sgd<__nv_bfloat16, amp::Compact, amp::Codes8>"
    assert kernel_work.launch_traffic(name, launch.meta) == (
        3 * N * 6 + 4 * blocks,
        3 * N * 4 + 4 * blocks,
    )
    (launch,) = _layout.plan([[1, 2]] * 8, numels, capacity=8)
    assert kernel_work.launch_traffic("amp_compact_count_steps", launch.meta) == (8, 8)


"""The compact forms of O2's state, on torch operations: the torch backend's, and the reference the
CUDA source (codecs.cu, step_loop.cu) follows operation by operation, so the two agree bit for bit.

- An exact master (bf16 models): the bf16 weight, the FP32 value rounded to nearest with exact
  ties away from zero, and a signed 16-bit remainder: the FP32 bits are the weight's shifted up by
  16 plus the remainder, so the pair holds the FP32 value exactly in 4 bytes (Transformer Engine's
  FusedAdam `store_param_remainders`). Ties must go away from zero: the remainder of a tie rounded
  to even down would be +0x8000, one past int16. So one value in 131,072 (a tie whose lower
  neighbour is even) sits one ulp from torch's nearest-even cast. A NaN stays a NaN (a quiet one;
  its payload's low bits are not kept).
- A compact master: the bf16 weight, the FP32 value rounded to nearest even as torch's cast rounds
  it (so every writer of the weight agrees: the model's cast, a load, the step), and an int8
  correction: the rest of the value in 1/256 of the weight's ulp, rounded to nearest even and
  kept within -127..127. Decoding is integer arithmetic on the bits, exact; encoding what was
  decoded gives the same two back. The error is at most 1/512 of the weight's ulp (1/256 where
  the rest lies within half a unit of the weight's midpoint).
- An 8-bit moment: block-scaled over runs of BLOCK elements of the flattened tensor (one fp32
  scale each, the block's largest magnitude). A signed moment (Adam's first, SGD's momentum) is
  companded by softsign, 2y / (1 + |y|), onto -127..127; an unsigned one (Adam's second) is
  stored as its square root, linear onto 0..255, and a positive value never takes code 0 (its
  denominator would be eps alone). FlashOptim's companders (arXiv 2602.23349). In a step, the
  unsigned code is rounded stochastically (`dither_bits`, over 2**16): Adam's second moment moves
  by 1 - beta2 = 0.1% a step, less than a code, so rounding to nearest would hold it where it is
  (an EMA stuck high, or at the floor) while stochastic rounding follows it on average. The
  random bits are a hash of the element's index in its whole tensor (a shard's elements from the
  shard's start: FSDP2's draw the replicated tensor's) and one of the step count: a resumed run
  draws the same ones, at any world size, and the CUDA kernel computes them as here.
- A bf16 moment: round to nearest even; Adam's second moment in a step stochastically, as its
  8-bit code (bf16's 8 bits of precision are coarser than its 0.1% a step too).

Every float operation here rounds once (no fused multiply-add) and correctly: the CUDA source
uses the `_rn` intrinsics in the same order. Two of torch's float32 operations are not correctly
rounded, and are taken another way: a square root on the CPU (MKL's, an ulp off for some values;
float64's rounded to float32 is), and a division by a Python scalar on CUDA (a multiply by its
reciprocal there; by a 0-dim tensor it divides).
"""

import sys

import torch

__all__ = [
    "BLOCK",
    "remainder_encode",
    "remainder_decode",
    "compact_encode",
    "compact_decode",
    "signed_encode",
    "signed_decode",
    "unsigned_encode",
    "unsigned_decode",
    "dither_bits",
    "bf16_stochastic",
    "blocks",
]

BLOCK = 32  # elements per scale of an 8-bit moment (a warp on the GPU)

_SIGN = -(2**31)
# Where an FP32 value's low and high 16 bits lie in its int16 view (the machine's byte order)
_LOW, _HIGH = (0, 1) if sys.byteorder == "little" else (1, 0)


def remainder_encode(fp32):
    """(bf16 weight, int16 remainder) of FP32 values: the bits split at bit 16, the weight rounded
    to nearest (ties away from zero) and the remainder signed (see the module doc). The remainder
    is the bits' low half as a signed int16, and the weight their high half plus the carry where
    that is negative (0x8000 or more): two passes over halves, where int32 arithmetic took six.
    The CUDA kernel's uint32 arithmetic gives the same bits."""
    flat = _dense_flat(fp32)
    halves = flat.view(torch.int16).view(-1, 2)
    high = halves[:, _HIGH]
    # contiguous_format: a clone of one element would keep its stride of 2 (views of it fail)
    rest = halves[:, _LOW].clone(memory_format=torch.contiguous_format)
    weight = torch.sub(high, rest >> 15)  # >> 15: -1 where the low half is 0x8000 or more
    # A NaN whose rounding left the NaN patterns (up into the sign, or down to inf): a quiet NaN
    # of its sign, remainder 0. A plain CPU tensor is asked first, by a maximum (it propagates
    # NaN; no device to wait for, no FakeTensor that cannot answer): most steps have none, and
    # the fix-up is four passes more.
    if not _on_the_host(flat) or (flat.numel() and bool(torch.isnan(flat.amax()))):
        nan = torch.isnan(flat)
        weight = torch.where(nan, high | 0x40, weight)
        rest.masked_fill_(nan, 0)
    return weight.view(torch.bfloat16).view(fp32.shape), rest.view(fp32.shape)


def _dense_flat(tensor):
    """`tensor` flat with unit stride (a copy where it is not contiguous, or is one element of
    another stride, which torch calls contiguous but will not view as halves)."""
    flat = tensor.reshape(-1)
    if flat.numel() and flat.stride(0) != 1:
        flat = flat.clone(memory_format=torch.contiguous_format)
    return flat


def _on_the_host(tensor):
    """Whether `tensor` can be asked about its values for free: a plain CPU tensor, seen by no
    dispatch mode (FakeTensorMode, make_fx, a counter of device work), no functorch transform
    (vmap) and no compiler, which have no values to give or stand for a device that would wait."""
    return (
        type(tensor) is torch.Tensor
        and tensor.device.type == "cpu"
        and not torch.compiler.is_compiling()
        and not _dispatch_modes()
        and not _functorch_wrapped(tensor)
    )


_dispatch_modes = torch._C._len_torch_dispatch_stack
_functorch_wrapped = torch._C._functorch.is_functorch_wrapped_tensor


def remainder_decode(bf16, remainder):
    """The FP32 values a (bf16 weight, int16 remainder) pair holds (exact): the weight's bits
    shifted up by 16 plus the remainder, in int32 arithmetic that wraps."""
    bits = bf16.contiguous().view(torch.int16).to(torch.int32)
    bits <<= 16  # in place: a fresh tensor of this size costs its pages again on the CPU
    bits += remainder
    return bits.view(torch.float32)


def compact_encode(fp32):
    """(bf16 weight, int8 correction) of FP32 values (see the module doc). inf stays inf
    (correction 0), a value past the largest bf16 becomes inf as torch's cast makes it, NaN
    becomes bf16's quiet NaN (correction 0). In place where it can be: on the CPU each new
    tensor of this size costs its pages again. The rare cases (a NaN, a value rounded up to inf)
    are fixed up only where a plain CPU tensor's largest magnitude says there may be one
    (`_on_the_host`; any other tensor always)."""
    flat = _dense_flat(fp32)
    magnitude = flat.view(torch.int32) & 0x7FFFFFFF
    largest = 0x7FFFFFFF  # as if it held a NaN: every fix-up
    if _on_the_host(flat) and flat.numel():
        largest = int(magnitude.amax())
    nan = None
    if largest > 0x7F800000:
        nan = magnitude > 0x7F800000
        magnitude.masked_fill_(nan, 0)  # its weight is set below; its correction comes out 0
    high = magnitude >> 16  # the weight's magnitude, nearest even: + 0x7FFF + its lowest bit
    high &= 1
    high += magnitude
    high += 0x7FFF
    high >>= 16
    rest = magnitude.add_(high, alpha=-0x10000)  # -0x8000..0x8000: the value less the weight
    correction = rest >> 8  # rest / 256, nearest even
    correction &= 1
    correction += rest
    correction += 0x7F
    correction >>= 8
    correction.clamp_(-127, 127)
    if largest >= 0x7F7F8000:  # the least magnitude that rounds to inf (a tie, up to even)
        correction.masked_fill_(high >= 0x7F80, 0)  # inf, or rounded up to it: no correction
    if nan is not None:
        high.masked_fill_(nan, 0x7FC0)
    weight = high.to(torch.int16)  # at most 0x7FC0: in range
    weight |= flat.view(torch.int16).view(-1, 2)[:, _HIGH] & -0x8000  # the value's sign
    return weight.view(torch.bfloat16).view(fp32.shape), correction.to(torch.int8).view(fp32.shape)


def compact_decode(bf16, correction):
    """The FP32 values a (bf16 weight, int8 correction) pair holds (exact): the weight's
    magnitude shifted up by 16 plus 256 times the correction (none for inf and NaN), its sign."""
    weight = bf16.contiguous().view(torch.int16).to(torch.int32)  # sign-extended
    sign = weight & _SIGN
    high = weight.bitwise_and_(0x7FFF)  # the weight's magnitude
    special = None
    if not _on_the_host(high) or (high.numel() and bool(high.amax() >= 0x7F80)):
        special = high >= 0x7F80  # inf and NaN: no correction
    high <<= 16
    magnitude = correction.to(torch.int32)
    magnitude *= 256
    magnitude += high
    if special is not None:
        magnitude = torch.where(special, high, magnitude)
    magnitude |= sign
    return magnitude.view(torch.float32)


def blocks(values):
    """`values` flattened into rows of BLOCK (the last one padded with zeros)."""
    flat = values.reshape(-1)
    pad = -flat.numel() % BLOCK
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return flat.view(-1, BLOCK)


def _scales(rows):
    """Each block's largest magnitude, and the divisor for the block (1 where it is 0)."""
    scales = rows.abs().amax(dim=1, keepdim=True)
    return scales, torch.where(scales > 0, scales, torch.ones_like(scales))


def signed_encode(values):
    """(int8 codes in the shape of `values`, fp32 scales per block): softsign-companded. In
    place where it can be (each operation rounds once, in the same order)."""
    rows = blocks(values.float())
    scales, divisor = _scales(rows)
    y = rows / divisor
    denominator = y.abs()
    denominator += 1.0
    y *= 2.0
    y /= denominator  # 2y / (|y| + 1)
    y *= 127.0
    y.round_()
    return _unblock(y.to(torch.int8), values), scales.view(-1)


def signed_decode(codes, scales):
    """The FP32 values of signed_encode's codes and scales, in the codes' shape."""
    z = blocks(codes.float()) / _constant(127.0, codes)
    denominator = z.abs()
    torch.sub(2.0, denominator, out=denominator)
    z /= denominator  # z / (2 - |z|)
    z *= scales.view(-1, 1)
    return _unblock(z, codes)


def unsigned_encode(values, step=None, start=0):
    """(uint8 codes, fp32 scales per block) of non-negative values: their square roots, linear
    onto 0..255, a positive value at least code 1. Rounded to nearest; or, given the `step`
    count (a 0-dim tensor), stochastically by dither_bits(start, ..., step) over 2**16: `values`
    are the elements from flat index `start` of their moment."""
    roots = blocks(values.float()).double()
    roots.sqrt_()  # correctly rounded (module doc)
    roots = roots.float()
    scales, divisor = _scales(roots)
    y = roots / divisor
    y *= 255.0
    if step is None:
        y.round_()
    else:
        # + the dither: its bits times 2**-16 are exact, so the sum rounds once
        y.add_(dither_bits(start, roots.numel(), step).view(roots.shape), alpha=2.0**-16)
        y.floor_()
        y.clamp_(max=255.0)
    torch.maximum(y, roots.sign(), out=y)  # a positive value takes code 1 at least
    return _unblock(y.to(torch.uint8), values), scales.view(-1)


_MASK = 0xFFFFFFFF
_PERIOD = 1 << 16  # the dither of a moment's elements repeats every 2**16 of them
_DITHER_BITS = {}  # device -> int32 [_PERIOD]: the high 16 bits of each index's hash


def _mix(x):
    """A 32-bit hash of int64 values below 2**32 (products stay below 2**63: exact in int64,
    as uint32 arithmetic wraps them on the GPU)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & _MASK
    return x ^ (x >> 16)


def dither_bits(start, count, step):
    """16 random bits (int32 0..65535) for flat indices start..start+count at `step` (a 0-dim
    tensor holding an integer): the high 16 bits of a hash of the index (modulo _PERIOD, from a
    table made once per device) xor those of a hash of the step."""
    device = step.device
    table = _DITHER_BITS.get(device)
    if table is None:
        index = torch.arange(_PERIOD, dtype=torch.int64, device=device)
        table = _DITHER_BITS[device] = (_mix(index) >> 16).to(torch.int32)
    salt = (_mix((step.to(torch.int64) * 0x61C88647) & _MASK) >> 16).to(torch.int32)
    offset = start % _PERIOD
    if offset:
        table = table.roll(-offset)
    bits = table.repeat(-(-count // _PERIOD))[:count]
    bits ^= salt
    return bits


def bf16_stochastic(values, step, start=0):
    """Non-negative FP32 `values` (elements from flat index `start` of a second moment) rounded
    to bf16 stochastically: dither_bits added to the low 16 bits, then cut (see the module doc:
    a bf16 second moment rounded to nearest stays stuck as an 8-bit one does)."""
    bits = values.contiguous().view(-1).view(torch.int32)
    high = dither_bits(start, bits.numel(), step)
    high += bits
    high >>= 16
    return high.to(torch.int16).view(torch.bfloat16).view(values.shape)


def unsigned_decode(codes, scales):
    """The FP32 values of unsigned_encode's codes and scales, in the codes' shape."""
    roots = blocks(codes.float()) / _constant(255.0, codes)
    roots *= scales.view(-1, 1)
    roots *= roots
    return _unblock(roots, codes)


def _constant(value, like):
    """A float32 0-dim tensor on `like`'s device: a divisor torch divides by (module doc)."""
    return torch.full((), value, dtype=torch.float32, device=like.device)


def _unblock(rows, like):
    return rows.reshape(-1)[: like.numel()].view(like.shape)

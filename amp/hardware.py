"""What this machine's hardware does with float16 and bfloat16: native units or emulation.

Mixed precision is faster only where the hardware has low-precision arithmetic units (Tensor
Cores on NVIDIA GPUs from compute capability 7.0 for float16 and 8.0 for bfloat16; AMX or
AVX512-FP16/BF16 on x86 CPUs; the FP16/BF16 extensions on ARM). Elsewhere torch converts to
float32 for the arithmetic and back, which costs time: mixed precision then saves memory only.
`python -m amp` and the demo print this, read from the machine.
"""

import dataclasses

import torch

__all__ = ["DTYPES", "LowPrecisionSupport", "cpu_support", "cuda_support", "support"]

# x86 CPU features (torch.cpu.get_capabilities() names) that run each dtype fast.
_X86_UNITS = {
    torch.float16: ("amx_fp16", "avx512_fp16"),
    torch.bfloat16: ("amx_bf16", "avx512_bf16"),
}
_ARM_UNITS = {
    torch.float16: ("fp16_arith",),
    torch.bfloat16: ("bf16", "sve_bf16"),
}
_UNIT_NAMES = {
    "amx_fp16": "AMX-FP16",
    "avx512_fp16": "AVX512-FP16",
    "amx_bf16": "AMX-BF16",
    "avx512_bf16": "AVX512-BF16",
    "fp16_arith": "FP16 arithmetic",
    "bf16": "BF16 (BFMMLA)",
    "sve_bf16": "SVE-BF16",
}
DTYPES = (torch.float16, torch.bfloat16)


def _name(dtype):
    return str(dtype).replace("torch.", "")


@dataclasses.dataclass(frozen=True)
class LowPrecisionSupport:
    """For one device: which low-precision dtypes run on native units, and what those are."""

    device: str  # e.g. "cpu (AMD EPYC)" or "cuda:0 (NVIDIA H100, compute capability 9.0)"
    units: dict  # dtype -> the native units found for it ("" when none: emulated)
    is_gpu: bool

    def fast(self, dtype):
        return bool(self.units.get(dtype))

    def summary(self):
        """Two or three sentences a newcomer can act on."""
        fast = [d for d in DTYPES if self.fast(d)]
        slow = [d for d in DTYPES if not self.fast(d)]
        sentences = []
        by_units = {}
        for dtype in fast:
            by_units.setdefault(self.units[dtype], []).append(_name(dtype))
        for units, names in by_units.items():
            sentences.append(
                f"{' and '.join(names)} run{'s' if len(names) == 1 else ''} on {units}"
            )
        if slow:
            names = " and ".join(_name(d) for d in slow)
            needs = (
                "Tensor Cores need compute capability 7.0+ for float16, 8.0+ for bfloat16"
                if self.is_gpu
                else "no AMX, AVX512-FP16/BF16 or ARM FP16/BF16 units"
            )
            sentences.append(
                f"{names} {'have' if len(slow) > 1 else 'has'} no fast units here ({needs}): "
                "torch computes through float32 conversions, slower than float32 itself"
            )
        text = f"{self.device}: " + "; ".join(sentences) + "."
        if fast:
            names = " and ".join(_name(d) for d in fast)
            text += f" Large matmuls and convolutions in {names} run several times faster than in float32."
        else:
            text += " Mixed precision saves memory on this machine, not time."
        return text


def cpu_support(capabilities=None):
    """LowPrecisionSupport of this CPU (or of `capabilities`, torch.cpu.get_capabilities()'s)."""
    if capabilities is None:
        capabilities = _cpu_capabilities()
    arm = str(capabilities.get("architecture", "")).lower() in ("arm64", "aarch64")
    table = _ARM_UNITS if arm else _X86_UNITS
    units = {
        dtype: ", ".join(_UNIT_NAMES[f] for f in features if capabilities.get(f))
        for dtype, features in table.items()
    }
    name = capabilities.get("cpu_name") or capabilities.get("architecture") or "unknown"
    return LowPrecisionSupport(f"cpu ({name})", units, is_gpu=False)


def _cpu_capabilities():
    get = getattr(getattr(torch, "cpu", None), "get_capabilities", None)
    if get is not None:  # recent torch; older ones only name the vector ISA
        return dict(get())
    capability = torch.backends.cpu.get_cpu_capability().lower()  # "AVX2", "AVX512", "DEFAULT"
    return {"cpu_name": capability, "architecture": "x86_64"}


def cuda_support(name, major, minor, index=0):
    """LowPrecisionSupport of an NVIDIA GPU of compute capability major.minor."""
    units = {
        torch.float16: "Tensor Cores"
        if major >= 7
        else (
            "native half arithmetic (no Tensor Cores)" if (major, minor) in ((6, 0), (6, 2)) else ""
        ),
        torch.bfloat16: "Tensor Cores" if major >= 8 else "",
    }
    device = f"cuda:{index} ({name}, compute capability {major}.{minor})"
    return LowPrecisionSupport(device, units, is_gpu=True)


def support(device="cpu"):
    """LowPrecisionSupport of `device` ("cpu", "cuda", "cuda:1", or a torch.device)."""
    device = torch.device(device)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        properties = torch.cuda.get_device_properties(index)
        return cuda_support(properties.name, properties.major, properties.minor, index)
    if device.type == "cpu":
        return cpu_support()
    raise ValueError(f"amp.hardware.support: expected a cpu or cuda device; got {device}.")

"""amp.hardware: which low-precision dtypes a device runs on native units, read from its features."""

import pytest
import torch

from amp import hardware


def test_a_cpu_without_low_precision_units_is_reported_as_emulated():
    report = hardware.cpu_support({"cpu_name": "AMD EPYC", "architecture": "x86_64", "avx2": True})
    assert not report.fast(torch.float16) and not report.fast(torch.bfloat16)
    assert report.summary().startswith("cpu (AMD EPYC): float16 and bfloat16 have no fast units")
    assert "saves memory on this machine, not time" in report.summary()


@pytest.mark.parametrize(
    "features, fast16, fastbf16",
    [
        ({"architecture": "x86_64", "amx_bf16": True, "amx_tile": True}, False, True),
        ({"architecture": "x86_64", "avx512_fp16": True, "avx512_bf16": True}, True, True),
        ({"architecture": "arm64", "fp16_arith": True, "bf16": True}, True, True),
        ({"architecture": "arm64", "fp16_arith": True}, True, False),
    ],
)
def test_cpu_units(features, fast16, fastbf16):
    report = hardware.cpu_support(features)
    assert (report.fast(torch.float16), report.fast(torch.bfloat16)) == (fast16, fastbf16)
    assert ("several times faster" in report.summary()) is (fast16 or fastbf16)


@pytest.mark.parametrize(
    "major, minor, fast16, fastbf16",
    [(9, 0, True, True), (8, 0, True, True), (7, 5, True, False), (6, 1, False, False)],
)
def test_gpu_tensor_cores_by_compute_capability(major, minor, fast16, fastbf16):
    report = hardware.cuda_support("GPU", major, minor)
    assert (report.fast(torch.float16), report.fast(torch.bfloat16)) == (fast16, fastbf16)
    assert f"compute capability {major}.{minor}" in report.summary()


def test_this_machine_and_bad_devices():
    assert hardware.support("cpu").summary().startswith("cpu (")
    with pytest.raises(ValueError, match="expected a cpu or cuda device; got meta"):
        hardware.support("meta")

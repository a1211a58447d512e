"""examples/lightning.py runs in seconds on the CPU and shows what it says it shows."""

import os
import subprocess
import sys

import pytest

pytest.importorskip("lightning.pytorch")  # installed by `make test` (the `lightning` extra)

from helpers import subprocess_env  # noqa: E402

SCRIPT = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "examples", "lightning.py"
)


def _run(*args):
    result = subprocess.run(
        [sys.executable, SCRIPT, *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=subprocess_env(),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_help_shows_the_defaults():
    printed = _run("--help")
    assert "--device" in printed and "(default: 12)" in printed and "(default: 3)" in printed


def test_the_example_trains_skips_and_resumes_bit_for_bit():
    printed = _run("--steps", "6", "--overflow-step", "1", "--device", "cpu")
    rows = {line.split("  ")[1].strip(): line for line in printed.splitlines() if "  " in line}
    assert "nan" in rows["bf16-mixed (Lightning)"]  # no loss scaling: the inf stays
    for name in ("amp O1 bf16", "amp O2 bf16", "amp O1 fp16", "amp O2 fp16", "amp O2 compact int8"):
        assert "nan" not in rows[name], rows[name]
    assert "bfloat16  float32" in rows["amp O2 bf16"]  # bf16 weights, FP32 masters stepped
    assert "float16   float32" in rows["amp O2 fp16"]
    for name in ("amp O1 bf16", "amp O2 fp16", "amp O2 compact int8"):
        resumed = (
            f"{name}: model (FP32 values) bit-identical: True; optimizer state (with masters): "
            "True; amp state: True"
        )
        assert resumed in printed, printed
    assert "weights torch.bfloat16, stepped torch.float32; skipped 1" in printed

"""The benchmarks run (a smoke run: timing is for benchmarks/, never asserted here)."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(__file__))


def test_run_all_quick_prints_the_summary():
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "run_all.py"), "--quick"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = result.stdout[result.stdout.index("summary on") :]
    for row in ("transformer step", "loss scaling + step", "per-call overhead", "kernels"):
        assert row in summary

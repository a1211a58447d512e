"""Every example runs to completion with tiny settings; the demo's opt levels converge alike.
examples/checkpoint.py's resume is checked in tests/programs/test_resume.py."""

import os
import subprocess
import sys

import pytest
import torch

from helpers import ROOT, subprocess_env
from helpers.ranks import free_port

EXAMPLES = str(ROOT / "examples")
sys.path.insert(0, EXAMPLES)

import demo  # noqa: E402
import gan  # noqa: E402
import gradients  # noqa: E402
import transformer_lm  # noqa: E402
import what_went_wrong  # noqa: E402

SCRIPTS = [
    "demo.py",
    "transformer_lm.py",
    "gan.py",
    "gradients.py",
    "checkpoint.py",
    "ddp.py",
    "fsdp2.py",
    "what_went_wrong.py",
]


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_example_has_help(script):
    result = subprocess.run(
        [sys.executable, os.path.join(EXAMPLES, script), "--help"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert "--device" in result.stdout


def test_demo_prints_the_table_and_writes_the_plot(tmp_path, capsys):
    results = demo.main(
        ["--epochs", "1", "--dtypes", "bfloat16", "--out", str(tmp_path), "--device", "cpu"]
    )
    assert [(r["level"], r["dtype"]) for r in results] == [
        ("O0", "float32"),
        ("O1", "bfloat16"),
        ("O2", "bfloat16"),
        ("O3", "bfloat16"),
        ("GradScaler", "float16"),
    ]
    printed = capsys.readouterr().out
    assert printed.startswith("cpu (")  # what this CPU does with float16 and bfloat16, first
    assert "Measured here: a 256x256 matmul takes float32" in printed
    assert all(word in printed for word in ("accuracy", "vs O0", "ms per step", "skipped"))
    assert "torch.nn.functional.linear" in printed and "ran in" in printed  # O1's amp.trace()
    # The scaler at work: from 2**24 it backs off on overflow, then grows after clean steps.
    scaler_run = results[-1]
    scales = [demo.SCALER_START] + scaler_run["scales"]
    assert any(after < before for before, after in zip(scales, scales[1:]))
    assert any(after > before for before, after in zip(scales, scales[1:]))
    assert scaler_run["backoffs"] and scaler_run["growths"]
    assert scaler_run["skipped"] == len(scaler_run["backoffs"])
    assert (tmp_path / "demo.png").stat().st_size > 50_000


def test_demo_precision_table():
    table, trace = demo.precision_table(["O0", "O1", "O2", "O3"], torch.float16)
    assert set(table["O0"].values()) == {"float32"}
    assert table["O1"]["Linear (matmul)"] == "float16"
    assert table["O1"]["cross_entropy"] == "float32"
    assert table["O2"]["Linear (matmul)"] == "float16" and table["O2"]["BatchNorm1d"] == "float32"
    assert table["O3"]["BatchNorm1d"] == "float16"
    assert trace.ops().count("torch.nn.functional.linear") == 3


def test_mixed_precision_reaches_fp32_accuracy():
    """The demo's convergence claim: O1 and O2 end within 2 points of O0's test accuracy."""
    reference = demo.train("O0", torch.float16, epochs=6)["accuracy"]
    assert reference > 0.9
    for level in ("O1", "O2"):
        for dtype in (torch.float16, torch.bfloat16):
            accuracy = demo.train(level, dtype, epochs=6)["accuracy"]
            assert abs(accuracy - reference) <= 0.02, (level, dtype, accuracy, reference)


def test_transformer_lm_learns():
    result = transformer_lm.train(
        steps=30, batch=8, length=32, width=64, layers=1, log_every=0, show_progress=False
    )
    assert result["held-out loss"] < 3.5  # below ln(96): better than uniform over the characters


def test_gan_runs_with_three_loss_scalers():
    result = gan.train(steps=20, show_progress=False)
    assert len(result["loss scales"]) == 3
    assert all(
        torch.isfinite(torch.tensor(v))
        for v in (result["discriminator loss"], result["generator loss"])
    )


@pytest.mark.parametrize("technique", sorted(gradients.TECHNIQUES))
def test_gradient_techniques(technique):
    assert gradients.run(technique, steps=40) > 0.7


def test_what_went_wrong_names_the_layer_and_the_fix_works(capsys):
    result = what_went_wrong.main(["--steps", "4", "--device", "cpu"])
    broken, fixed = result["broken"], result["fixed"]
    assert broken["skipped"] == 4 and broken["scales"] == [2.0**16] * 4  # no scale spiral
    assert broken["report"].origin.module == "body.0"
    assert result["audit"].rows[0].module == "body.0"
    assert result["audit"].keep_fp32() == ["body"]
    assert fixed["skipped"] == 0
    printed = capsys.readouterr().out
    assert "it started in the output of module 'body.0' in forward" in printed
    assert "NonFiniteLossWarning" in printed and "fp32_modules=['body']" in printed


def _torchrun(script, *args):
    """Run `script` on two gloo ranks with the amp of this checkout (not an installed one)."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node=2",
            f"--master_port={free_port()}",
            os.path.join(EXAMPLES, script),
            "--device",
            "cpu",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=subprocess_env(),
    )
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_ddp_ranks_stay_identical_when_one_rank_overflows(tmp_path, opt_level):
    """Two real processes (gloo): an overflow on rank 1 only is skipped by both ranks."""
    _torchrun(
        "ddp.py",
        *("--opt-level", opt_level, "--steps", "8"),
        *("--inject-overflow-rank", "1", "--inject-overflow-step", "3", "--out", str(tmp_path)),
    )
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    assert ranks[0]["skipped"] == ranks[1]["skipped"] == [3]
    assert ranks[0]["scales"] == ranks[1]["scales"]
    assert ranks[0]["scales"][3] == ranks[0]["scales"][2] / 2
    for key, value in ranks[0]["model"].items():
        assert torch.equal(value, ranks[1]["model"][key]), key


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["O1", "scaler"])
def test_fsdp2_ranks_stay_identical_when_one_rank_overflows(tmp_path, recipe):
    """Two real processes (gloo), FSDP2: an overflow in rank 1's shard only is skipped by both."""
    _torchrun(
        "fsdp2.py",
        *("--recipe", recipe, "--steps", "6"),
        *("--inject-overflow-rank", "1", "--inject-overflow-step", "3", "--out", str(tmp_path)),
    )
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    assert ranks[0]["skipped"] == ranks[1]["skipped"] == [3]
    assert ranks[0]["scales"] == ranks[1]["scales"]
    assert ranks[0]["scales"][3] == ranks[0]["scales"][2] / 2
    for key, value in ranks[0]["model"].items():
        assert value.dtype is torch.float32, key
        assert torch.equal(value, ranks[1]["model"][key]), key

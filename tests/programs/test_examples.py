"""Every example runs to completion with tiny settings; the demo's opt levels converge alike.
examples/checkpoint.py's resume is checked in tests/programs/test_resume.py."""

import argparse
import ast
import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from helpers import ROOT, subprocess_env
from helpers.ranks import free_port

EXAMPLES = str(ROOT / "examples")
sys.path.insert(0, EXAMPLES)

import checkpoint  # noqa: E402
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
    "lightning.py",
    "transformers_finetune.py",
]


def _needs_lightning(script):
    """Skip where the example's framework is not installed (`make test` installs both extras)."""
    if script == "lightning.py":
        pytest.importorskip("lightning.pytorch")  # the `lightning` extra
    if script == "transformers_finetune.py":
        pytest.importorskip("transformers", minversion="5")  # the `transformers` extra


@pytest.mark.parametrize("script", SCRIPTS + ["common.py", "demo_plot.py"])
def test_every_example_has_help(script):
    _needs_lightning(script)
    result = subprocess.run(
        [sys.executable, os.path.join(EXAMPLES, script), "--help"],
        capture_output=True,
        text=True,
        env=subprocess_env(),
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: ")
    with open(os.path.join(EXAMPLES, script)) as source:
        first_line = ast.get_docstring(ast.parse(source.read())).splitlines()[0]
    assert first_line in result.stdout  # what the script is, and (for scripts) how to run it
    if script in SCRIPTS:
        assert "--device" in result.stdout


class _Parsed(Exception):
    pass


def _parser_of(script, monkeypatch):
    """The argparse parser that `script`'s main() builds (stopped before it parses)."""
    spec = importlib.util.spec_from_file_location(f"example_{script[:-3]}", f"{EXAMPLES}/{script}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    def stop(parser, *args, **kwargs):
        raise _Parsed(parser)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", stop)
    with pytest.raises(_Parsed) as parsed:
        module.main([])
    return parsed.value.args[0]


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_option_says_what_it_does_and_its_default(script, monkeypatch):
    _needs_lightning(script)
    parser = _parser_of(script, monkeypatch)
    text = parser.format_help()
    options = [a for a in parser._actions if a.help is not argparse.SUPPRESS and a.dest != "help"]
    assert options
    for action in options:
        assert action.help and action.help.strip(), action.option_strings
    # Every option with a default shows it (an option without one, such as --out, shows none).
    assert text.count("(default:") == sum(1 for a in options if a.default is not None), text


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
    assert "Timed here, a 256x256 matmul: float32" in printed
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


@pytest.mark.parametrize("busy", [False, True])
def test_demo_says_what_the_hardware_does_and_reports_timing_as_a_figure(monkeypatch, busy):
    """The speed statements come from the hardware facts; a timing blurred by load on the machine
    (the emulated matmul as fast as float32) is reported as such, never contradicting them."""
    from amp import hardware

    monkeypatch.setattr(hardware, "support", lambda device: hardware.cpu_support({}))
    times = {torch.float32: 25.0 if busy else 0.3, torch.float16: 25.1, torch.bfloat16: 25.6}
    monkeypatch.setattr(demo, "measure_matmul", lambda device, dtypes: (256, times))
    lines = demo.explain_hardware("cpu", [torch.float16, torch.bfloat16])
    assert "slower than float32 itself" in lines[0]
    assert lines[1].startswith("Timed here, a 256x256 matmul: float32")
    assert ("disagree with the hardware above: this machine is busy" in lines[1]) is busy
    assert lines[2].startswith("So O1-O3 in float16 and bfloat16 step slower than O0")
    fast = hardware.cpu_support({"amx_bf16": True})  # native bfloat16: faster than float32
    assert "disagree" not in demo.timing_line(256, {torch.float32: 1.0, torch.bfloat16: 0.4}, fast)
    assert "disagree" in demo.timing_line(256, {torch.float32: 1.0, torch.bfloat16: 1.3}, fast)


def test_checkpoint_prints_the_losses_and_what_the_checkpoint_holds(tmp_path):
    """What examples/checkpoint.py prints (its fresh-process resume: tests/programs/test_resume.py)."""
    path = str(tmp_path / "checkpoint.pt")
    straight = checkpoint.train("O2", "float16", "cpu", 6)
    first = checkpoint.train("O2", "float16", "cpu", 3, save=path, save_at=3)
    resumed = checkpoint.train("O2", "float16", "cpu", 6, load=path)
    assert first["losses"] + resumed["losses"] == straight["losses"]
    held = "\n".join(checkpoint.describe(path))
    for words in (
        "checkpoint.pt (",
        "after step 3 holds:",
        "model.state_dict(): 16 tensors (float32, int64)",
        "AdamW's state (exp_avg, exp_avg_sq, step)",
        "the master weights of 6 of them (master)",
        "amp.state_dict()['loss_scaler0']: {'loss_scale': ",
        "step       3",
    ):
        assert words in held, words
    table = checkpoint.loss_table(straight["losses"], resumed["losses"], 3)
    assert table[0] == "Losses:" and table[1].split() == ["step", "1", "2", "3", "4", "5", "6"]
    assert table[2].split()[1:-1] == [f"{loss:.4f}" for loss in straight["losses"]]
    assert table[3].split()[1:4] == [f"{loss:.4f}" for loss in resumed["losses"]]
    assert table[3].endswith("resumed in a fresh process")


def test_progress_bars_are_drawn_on_a_terminal_only():
    import io

    import common

    log = io.StringIO()  # what `make demo > log 2>&1` gives tqdm: no terminal
    assert list(common.progress(range(3), desc="O1", file=log)) == [0, 1, 2]
    assert log.getvalue() == ""


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


def test_transformers_finetune_skips_an_overflow_resumes_bit_for_bit_and_saves_fp32(
    monkeypatch, one_thread
):
    """AmpTrainer at O1 fp16 with an inf gradient at step 1, at tiny sizes."""
    _needs_lightning("transformers_finetune.py")
    spec = importlib.util.spec_from_file_location(
        "transformers_finetune", f"{EXAMPLES}/transformers_finetune.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sizes = ["--rows", "16", "--batch", "4", "--length", "16", "--width", "32"]
    result = module.main(
        ["--opt-level", "O1", "--dtype", "float16", "--overflow-step", "1", "--device", "cpu"]
        + sizes
    )
    assert result["skipped"] == 1 and result["dtypes"] == {(torch.float32, torch.float32)}
    assert result["resumed_equal"] and result["loaded_equal"]
    assert result["logits"] == "float32" and result["config_dtype"] == "float32"
    assert result["loaded_dtype"] is torch.float32 and result["losses"][-1] < result["losses"][0]


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
@pytest.mark.parametrize("recipe", ["O1", "O2", "compact", "compact-int8", "scaler"])
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

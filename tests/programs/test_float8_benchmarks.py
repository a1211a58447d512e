"""The float8 benchmarks run, and what they count is right (timings are never asserted)."""

import sys

import pytest
import torch

from helpers import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import device_work  # noqa: E402
import float8_layers  # noqa: E402
import float8_mlp  # noqa: E402
import float8_training  # noqa: E402
import float8_work  # noqa: E402
import step_costs  # noqa: E402
import workloads  # noqa: E402


def test_the_float8_row_counts_three_fp8_matmuls_per_linear_and_saves_what_o2_saves():
    workload = workloads.END_TO_END["gpt2-tiny"]  # 2 blocks of 4 linears; the head is 128 wide
    o2 = device_work.step_work(workload, "amp O2", torch.bfloat16, "foreach")
    fp8 = device_work.step_work(workload, "amp O2 + float8", torch.bfloat16, "foreach")
    matmuls = {key: n for key, n in fp8.ops.items() if "mm" in key[1]}
    assert matmuls == {("forward", "_scaled_mm.default"): 9, ("backward", "_scaled_mm.default"): 18}
    assert fp8.saved == o2.saved  # the high-precision input and weight, as a bf16 linear saves
    assert fp8.host_reads == o2.host_reads  # scales stay on the device
    assert fp8.phases["after backward"].launches == o2.phases["after backward"].launches
    names = [row for row, _, _ in step_costs.DEVICE_WORK_ROWS]
    assert "amp O2 + float8" in names


@pytest.mark.slow
def test_float8_layers_runs_at_toy_sizes():
    pytest.importorskip("torchao.float8")
    table = float8_layers.main(
        [
            "--tiny",
            "--device",
            "cpu",
            "--no-compile",
            "--layers",
            "1",
            "--steps",
            "1",
            "--warmup",
            "0",
        ]
    )
    assert [row["variant"] for row in table] == [
        "amp O2",
        "amp O2 + float8",
        "torchao under amp O2",
        "torchao, manual O2",
    ]
    assert all(row["finite loss"] for row in table)


@pytest.mark.slow
def test_float8_training_matches_torchao_step_for_step():
    pytest.importorskip("torchao.float8")
    settings = dict(device="cpu", steps=3, batch=2, length=16, width=32, layers=1, heads=2, lr=3e-3)
    ours, _ = float8_training.train("amp O2 + float8", **settings)
    theirs, _ = float8_training.train("torchao under O2", **settings)
    plain, _ = float8_training.train("amp O2", **settings)
    assert ours == theirs and ours != plain


def test_the_eager_fp8_linear_moves_the_floors_bytes_at_issue_50s_sizes():
    """One linear 4096 -> 14336 over 16,384 tokens (FakeTensors): the fused casts read each bf16
    tensor twice and write each FP8 layout once; the launches above the floor are the amaxes'
    zero fills (one a cast) and, rowwise, the matmuls' unit scales."""
    table = {(row["recipe"], row["variant"]): row for row in float8_work.main([])}
    for recipe in ("tensorwise", "rowwise"):
        for variant, casts in (("eager", 3), ("eager, cached", 2)):
            row = table[recipe, variant]
            scales = 0.01 if recipe == "rowwise" else 1e-7  # GB of scales, amaxes and inverses
            assert 0 <= row["GB moved"] - row["floor GB"] < scales, (recipe, variant)
            ones = 2 if recipe == "rowwise" else 0
            assert row["launches"] == row["floor launches"] + casts + ones, (recipe, variant)
        traced = table[recipe, "traced"]
        assert traced["GB / floor"] > 5 and traced["launches"] > 60


@pytest.mark.slow
def test_float8_work_counts_the_compiled_step():
    table = float8_work.main(
        ["--compiled", "--tokens", "256", "--in-features", "64", "--out-features", "224"]
    )
    compiled = [row for row in table if row["variant"] == "compiled"]
    assert len(compiled) == 2 and all(row["launches"] >= 9 for row in compiled)
    assert all(row["GB / floor"] >= 1 for row in compiled)


@pytest.mark.slow
def test_float8_mlp_runs_at_toy_sizes():
    table, same, fused = float8_mlp.main(
        ["--tiny", "--device", "cpu", "--modes", "eager", "--layers", "1", "--steps", "1",
         "--warmup", "0", "--batch", "1"]
    )
    assert same == {"tensorwise": True, "rowwise": True} and not fused
    assert [row["variant"] for row in table][:3] == [
        "amp O2 bf16", "amp O2 + float8 tensorwise", "amp O2 + float8 rowwise"
    ]
    assert all(row["finite loss"] for row in table)

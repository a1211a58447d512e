"""apex-era scripts on the apex package (tests/helpers/apex_scripts/): a data-parallel script
with apex's DDP and SyncBatchNorm on two gloo ranks, and a two-model script with apex's optimizers
at O0-O3, in process and as a program. Their checkpoints resume bit for bit:
tests/programs/test_resume.py."""

import math
import subprocess
import sys

import pytest
import torch

from helpers import TESTS, subprocess_env
from helpers.apex_scripts import ddp as ddp_script
from helpers.apex_scripts import two_models
from helpers.ranks import run_two_ranks

SCRIPTS = TESTS / "helpers" / "apex_scripts"


# --- apex's DistributedDataParallel with two gloo ranks --------------------------------------


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Both ranks' results of every scenario of tests/apex_scripts/ddp.py, from one gloo job."""
    out = tmp_path_factory.mktemp("apex_ddp")
    run_two_ranks(SCRIPTS / "ddp.py", out)
    return [torch.load(out / f"rank{rank}.pt", weights_only=True) for rank in (0, 1)]


@pytest.mark.slow
def test_apex_reducer_averages_over_ranks(ranks):
    for rank in ranks:
        assert torch.equal(rank["reducer"][0], torch.full((3,), 1.5))
        assert torch.equal(rank["reducer"][1], torch.full((2,), 5.0))


@pytest.mark.slow
def test_apex_flat_dist_call_averages_and_broadcasts_over_ranks(ranks):
    for rank in ranks:
        mean, half_mean, first, first_double = rank["flat_dist_call"]
        assert torch.equal(mean, torch.full((2,), 0.5))
        assert torch.equal(half_mean, torch.full((3,), 2.0, dtype=torch.float16))
        assert torch.equal(first, torch.full((2,), 1.0))
        assert torch.equal(first_double, torch.full((1,), 7.0, dtype=torch.float64))


@pytest.mark.slow
@pytest.mark.parametrize("scenario", list(ddp_script.SCENARIOS))
def test_apex_ddp_with_sync_batchnorm_matches_one_process(ranks, scenario):
    """Two ranks of B samples with apex's DDP and SyncBatchNorm train as one process on 2B:
    the batch statistics (running_mean/var) are the global batch's."""
    rank0, rank1 = ranks[0][scenario], ranks[1][scenario]
    expected = ddp_script.train(scenario)
    assert sorted(rank0) == sorted(rank1) == sorted(expected)
    for name, value in expected.items():
        assert torch.equal(rank0[name], rank1[name]), name
        # FP16 gradients summed per rank vs over the global batch: a few FP16 ulps apart.
        torch.testing.assert_close(rank0[name], value, rtol=1e-3, atol=5e-4, msg=name)


# --- an apex-style script: two models, three losses ------------------------------------------


@pytest.fixture(scope="module")
def o0_runs():
    return {
        name: two_models.main(["--opt-level", "O0", "--optimizer", name])
        for name in ("adam", "lamb")
    }


@pytest.mark.parametrize("opt_level", ["O0", "O1", "O2", "O3"])
@pytest.mark.parametrize("optimizer", ["adam", "lamb"])
def test_apex_style_script_trains_at_every_level_close_to_o0(o0_runs, opt_level, optimizer):
    found = two_models.main(["--opt-level", opt_level, "--optimizer", optimizer])
    reference = o0_runs[optimizer]
    losses = torch.tensor(found["losses"])
    assert torch.isfinite(losses).all()
    # The same three batches come back every three steps: each loss falls from one pass to the next.
    assert (losses[3:] < losses[:3]).all(), losses
    torch.testing.assert_close(losses, torch.tensor(reference["losses"]), rtol=1e-2, atol=1e-2)
    for name, value in reference["params"].items():
        torch.testing.assert_close(found["params"][name], value, rtol=2e-2, atol=1e-2, msg=name)


def test_apex_style_script_runs_as_a_program_with_the_lamb_optimizer():
    result = subprocess.run(
        [
            sys.executable,
            str(SCRIPTS / "two_models.py"),
            "--opt-level",
            "O2",
            "--optimizer",
            "lamb",
        ],
        capture_output=True,
        text=True,
        env=subprocess_env(),
    )
    assert result.returncode == 0, result.stderr
    assert len(result.stdout.split()) == 3 and all(
        math.isfinite(float(v)) for v in result.stdout.split()
    )

"""float8 under torch.distributed, two real gloo processes (tests/helpers/float8_ranks.py): DDP at
O2, FSDP2 at O1 and with amp.autocast + amp.GradScaler. Each linear runs in FP8 on each rank (its
own scales, from its own batch); an inf on rank 1 alone skips the step on both; both end with the
same parameters, bit for bit."""

import pytest
import torch

from helpers import TESTS
from helpers import float8_ranks as helper
from helpers.ranks import run_two_ranks


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("float8_ranks")
    run_two_ranks(TESTS / "helpers" / "float8_ranks.py", out)
    return [torch.load(out / f"rank{rank}.pt", weights_only=False) for rank in (0, 1)]


@pytest.mark.slow
@pytest.mark.parametrize("engine, mode", helper.SCENARIOS)
def test_ranks_train_in_fp8_and_agree(ranks, engine, mode):
    rank0, rank1 = (rank[(engine, mode)] for rank in ranks)
    for result in (rank0, rank1):
        assert "crash" not in result, result["crash"]
        assert result["ran_in"] == [[torch.float8_e4m3fn] * 2] * helper.STEPS
    scales = rank0["scales"]
    assert rank1["scales"] == scales
    assert scales[helper.OVERFLOW_STEP] == scales[helper.OVERFLOW_STEP - 1] / 2  # both skipped
    start = [p.float() for p in helper.make_model().parameters()]
    for ours, theirs, initial in zip(rank0["params"], rank1["params"], start):
        assert torch.equal(ours, theirs)
        assert torch.isfinite(ours).all() and not torch.equal(ours, initial)

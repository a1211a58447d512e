"""O2 under DistributedDataParallel (amp/weights/engines.py): the wrap's broadcast of rank 0's
parameters takes rank 0's FP32 masters along, so that ranks initialised differently hold
bit-identical masters and FP16 weights from the wrap on, with torch's DDP and apex.parallel's."""

import pytest
import torch

from helpers import TESTS
from helpers.ranks import run_two_ranks


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp_masters")
    run_two_ranks(TESTS / "helpers" / "ddp_masters_rank.py", out)
    return [torch.load(out / f"rank{rank}.pt", weights_only=False) for rank in (0, 1)]


@pytest.mark.parametrize("wrapper", ["torch", "apex"])
def test_ranks_initialised_differently_hold_identical_masters_after_the_wrap(ranks, wrapper):
    zero, one = (rank[wrapper] for rank in ranks)
    masters, weights = zero["before the wrap"][0], zero["before the wrap"][1]
    assert not torch.equal(masters, one["before the wrap"][0])
    assert not torch.equal(weights, one["before the wrap"][1])
    for when in ("after the wrap", "after two steps"):
        assert torch.equal(zero[when][0], one[when][0]), when  # the FP32 masters
        assert torch.equal(zero[when][1], one[when][1]), when  # the FP16 weights
    assert torch.equal(zero["after the wrap"][0], masters)  # rank 0's own, exactly

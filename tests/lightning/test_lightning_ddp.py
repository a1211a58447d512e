"""AmpPrecision under DDP on two gloo CPU ranks (the Trainer and Fabric), one job of two processes."""

import os

import pytest
import torch

pytest.importorskip("lightning.pytorch")  # installed by `make test` (the `lightning` extra)

from helpers.ranks import run_two_ranks  # noqa: E402

HELPER = os.path.join(os.path.dirname(__file__), "lightning_ddp_rank.py")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Both ranks' results of every scenario, from one two-process gloo job."""
    out = tmp_path_factory.mktemp("ddp")
    run_two_ranks(HELPER, out, timeout=300)
    return {
        scenario: [torch.load(out / f"{scenario}-rank{r}.pt", weights_only=True) for r in (0, 1)]
        for scenario in ("trainer", "fabric", "fabric-two-models")
    }


def _same(a, b):
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a, b)
    return a == b


@pytest.mark.parametrize("scenario", ["trainer", "fabric", "fabric-two-models"])
def test_ranks_reduce_gradients_and_skip_together(ranks, scenario):
    rank0, rank1 = ranks[scenario]
    # Each rank saw its own data...
    assert rank0["losses"] != rank1["losses"]
    # ...and both end with the same model, masters, optimizer state and loss scale, bit for bit:
    # the gradients were reduced (DDP built again around the cast model), and the overflow that
    # rank 1 alone saw skipped the step on both.
    for key in ("weights", "masters", "optimizer", "plugin"):
        assert _same(rank0[key], rank1[key]), key
    skipped = 2 if scenario == "fabric-two-models" else 1  # each optimizer's step
    assert rank0["plugin"]["skipped_steps"] == rank1["plugin"]["skipped_steps"] == skipped
    assert not _same(rank0["weights"], rank0["initial"])  # the other steps trained
    assert rank0["masters"][0].dtype is torch.float32
    assert all(torch.isfinite(w).all() for w in rank0["weights"].values())
    if scenario == "trainer":
        assert rank0["steps"] == 4  # 8 batches per rank, 2 micro-batches per step

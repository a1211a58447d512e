"""AmpTrainer under DDP (torchrun's environment, two gloo CPU ranks): the ranks reduce their
gradients, skip together when one overflows, and resume bit for bit."""

import os

import pytest
import torch

pytest.importorskip("transformers", minversion="5")  # the `transformers` extra (make test)

from helpers.ranks import run_two_ranks  # noqa: E402

HELPER = os.path.join(os.path.dirname(__file__), "trainer_ddp_rank.py")


def test_two_ranks_train_skip_together_and_resume_bit_for_bit(tmp_path):
    run_two_ranks(HELPER, tmp_path, timeout=300)
    rank0, rank1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1))
    straight = rank0["straight"]
    assert straight["wrapper"] == "DistributedDataParallel"
    assert straight["dtype"] is torch.bfloat16  # built around the cast model
    # Each rank saw its own half of the data (every row once an epoch)...
    rows = rank0["straight"]["rows"], rank1["straight"]["rows"]
    assert len(rows[0]) == len(rows[1]) == 16 and set(rows[0]) != set(rows[1])
    # ...and both end with the same FP32 weights, loss scale and held scheduler: the gradients
    # were reduced, and rank 1's overflow skipped the step on both.
    for run in ("straight", "resumed"):
        for name, value in rank0[run]["weights"].items():
            assert torch.equal(value, rank1[run]["weights"][name]), (run, name)
        assert rank0[run]["amp"] == rank1[run]["amp"]
        assert rank0[run]["amp"]["loss_scaler0"]["loss_scale"] == 2.0**15
        assert rank0[run]["skipped"] == rank1[run]["skipped"] == 1
        assert rank0[run]["scheduler_steps"] == rank1[run]["scheduler_steps"] == 3
    assert [e["amp/skipped"] for e in straight["logs"]] == [0, 1, 0, 0]
    # Fresh weights resumed from the checkpoint of epoch 1 end where the uninterrupted run ended.
    for name, value in straight["weights"].items():
        assert torch.equal(rank0["resumed"]["weights"][name], value), name

"""The distributed engines (amp/weights/engines.py) with two real gloo processes: DDP (no_sync
accumulation with delay_unscale), FSDP2, FSDP1 and ZeroRedundancyOptimizer, at O1, O2 (DDP and
ZeRO here; refused with FSDP1; FSDP2's: test_fsdp2.py), O3 (DDP and ZeRO) and with
amp.GradScaler; ZeRO stepping O2's masters in one process; parameters a late wrapper replaced or
moved.

One pair of processes runs every scenario (tests/helpers/distributed_scenarios.py); rank 1 alone
injects an inf into its gradient (its own shard under FSDP) at one step. Both ranks must skip that
step together, keep the same scale history, name the same parameter in amp.last_overflow(), and
end with identical parameters and optimizer state, equal to training the same global batches in
one process within TOLERANCE.
"""

import pytest
import torch

import amp
from helpers import TESTS
from helpers import distributed_scenarios as helper
from helpers.ranks import run_two_ranks

# Two ranks vs one process: the same arithmetic but for the order of the gradient sums (per-rank
# backward passes averaged by the engine, in FP16 under DDP at O2, vs one backward over the global
# batch), so the FP16 gradients round differently: a few units of FP16's 2**-11 relative precision
# on values below 0.5. The largest difference seen after five steps is 1.4e-4 (DDP and ZeRO at
# O2), 6e-5 at O3, 1.5e-5 elsewhere. Between ranks everything is bit-identical.
TOLERANCE = dict(rtol=1e-3, atol=5e-4)


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_a_parameter_replaced_after_initialize_raises_at_step_and_changes_nothing(opt_level):
    model, optimizer = helper.model_and_optimizer()
    model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level, verbosity=0)
    try:
        stepped = [p.detach().clone() for p in amp.master_params(optimizer)]
        model[2].weight = torch.nn.Parameter(model[2].weight.detach().clone())  # as a wrapper would
        with pytest.raises(
            RuntimeError, match=r"optimizer.step\(\): the parameter '2.weight' that amp set up"
        ):
            helper.one_step(model, optimizer)
        for before, after in zip(stepped, amp.master_params(optimizer)):
            assert torch.equal(before, after)
    finally:
        amp.deinitialize()


def test_a_parameter_that_only_moved_is_followed_and_trained():
    """torch.nn.utils.parametrize keeps the parameter, under parametrizations.weight.original."""

    class Double(torch.nn.Module):
        def forward(self, weight):
            return weight * 2

    model, optimizer = helper.model_and_optimizer()
    model, optimizer = amp.initialize(model, optimizer, opt_level="O1", verbosity=0)
    try:
        weight = model[0].weight
        before = weight.detach().clone()
        torch.nn.utils.parametrize.register_parametrization(model[0], "weight", Double())
        assert model[0].parametrizations.weight.original is weight
        for _ in range(2):
            helper.one_step(model, optimizer)
        assert not torch.equal(before, weight)
    finally:
        amp.deinitialize()


def test_zero_at_o2_steps_the_masters_and_deinitialize_gives_its_parameters_back(one_rank_group):
    model = helper.make_model()
    optimizer = helper.make_optimizer(model.parameters(), zero=True)
    own = list(model.parameters())
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
    try:
        masters = list(amp.master_params(optimizer))
        before = [m.detach().clone() for m in masters]
        helper.one_step(model, optimizer)
        assert all(not torch.equal(b, m) for b, m in zip(before, masters))
        assert all(torch.equal(p, m.half()) for p, m in zip(model.parameters(), masters))
    finally:
        amp.deinitialize()
    own = list(map(id, own))
    assert list(map(id, optimizer._all_params)) == own
    local = optimizer.optim  # this rank's partition, ordered by size
    assert sorted(id(p) for g in local.param_groups for p in g["params"]) == sorted(own)
    assert sorted(map(id, local.state)) == sorted(own)
    model[0].weight.grad = torch.ones_like(model[0].weight)
    weight = model[0].weight.detach().clone()
    optimizer.step()
    assert not torch.equal(weight, model[0].weight)


def test_zero_with_bucket_views_is_refused_at_o2(one_rank_group):
    from torch.distributed.optim import ZeroRedundancyOptimizer

    model = helper.make_model()
    optimizer = ZeroRedundancyOptimizer(
        model.parameters(), torch.optim.SGD, lr=0.1, parameters_as_bucket_view=True
    )
    with pytest.raises(RuntimeError, match="parameters_as_bucket_view=True"):
        amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
    assert all(p.dtype is torch.float32 for p in model.parameters())


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Both ranks' results of every scenario, from one 2-process gloo job."""
    out = tmp_path_factory.mktemp("distributed")
    run_two_ranks(TESTS / "helpers" / "distributed_scenarios.py", out)
    return [torch.load(out / f"rank{rank}.pt", weights_only=False) for rank in (0, 1)]


def _results(ranks, key):
    found = [rank[key] for rank in ranks]
    for result in found:
        assert "crash" not in result, result["crash"]
    return found


@pytest.mark.slow
@pytest.mark.parametrize("engine, mode", helper.SCENARIOS)
def test_ranks_agree_and_match_one_process(ranks, engine, mode):
    rank0, rank1 = _results(ranks, (engine, mode))
    expected = helper.reference(engine, mode)
    # The overflow seen by rank 1 only is skipped by both: the scale halves at that step.
    scales = expected["scales"]
    assert scales[helper.OVERFLOW_STEP] == scales[helper.OVERFLOW_STEP - 1] / 2
    assert rank0["scales"] == rank1["scales"] == scales
    if mode != "scaler":
        overflows = [None] * helper.STEPS
        overflows[helper.OVERFLOW_STEP] = ("0.weight",)  # named on both ranks, from any shard
        assert rank0["overflows"] == rank1["overflows"] == overflows
    assert sorted(rank0["params"]) == sorted(rank1["params"]) == sorted(expected["params"])
    for name, value in rank0["params"].items():
        assert value.dtype is torch.float32, name
        assert torch.equal(value, rank1["params"][name]), name
        torch.testing.assert_close(value, expected["params"][name], **TOLERANCE, msg=name)
    # ZeRO: each rank holds its partition's state; together they hold all of it, once.
    momentum = {**rank0["momentum"], **rank1["momentum"]}
    assert sorted(momentum) == sorted(expected["momentum"])
    if engine == "zero":
        assert not set(rank0["momentum"]) & set(rank1["momentum"])
    for name in set(rank0["momentum"]) & set(rank1["momentum"]):
        assert torch.equal(rank0["momentum"][name], rank1["momentum"][name]), name
    for name, value in momentum.items():
        torch.testing.assert_close(value, expected["momentum"][name], **TOLERANCE, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("engine, mode, order", helper.REFUSED)
def test_o2_o3_with_fsdp_are_refused_and_change_nothing(ranks, engine, mode, order):
    for result in _results(ranks, (engine, mode, order)):
        message = result["error"]
        assert message is not None, "trained without an error"
        assert "MixedPrecision" in message and "O1" in message and "amp.GradScaler" in message
        if order == "after":
            assert message.startswith("amp.initialize: models[0] is sharded by")
        else:
            assert message.startswith("optimizer.step(): the parameter '0.weight' that amp set up")
        assert result["compared"] and result["unchanged"]

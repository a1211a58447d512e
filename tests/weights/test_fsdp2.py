"""O2 under FSDP2 (amp/weights/shards.py): `fully_shard`, then the optimizer, then
amp.initialize(opt_level="O2") trains each rank's shards with exact, compact (bf16) or FP32
(fp16) masters, FP32, bf16 or 8-bit moments.

In one process (a gloo group of one rank): what amp refuses, changing nothing; one rank sharded
training bit for bit as no sharding (8-bit and bf16 moments too) and resuming from a
distributed checkpoint bit for bit; deinitialize giving FSDP2 its FP32 shards back; what the
memory benchmark counts. Two ranks of torch's fake process group (a process each): each rank's
bf16 and 8-bit moments the rows of the replicated ones, bit for bit. With real gloo jobs
(tests/helpers/fsdp2_ranks.py, run once for the module: one rank, two ranks, one rank; about
10 s in all, so in make test): ranks that agree on a skip rank 1 alone saw, each rank
holding its shards only, clipping that takes the global norm, a resume bit for bit with an
uninterrupted run, checkpoints loaded at another world size (2 -> 1, 1 -> 2) bit for bit, two
ranks training as one process, and 8-bit or bf16 moments of weights sharded along dim 1 refused.
"""

import math
import sys

import pytest
import torch
import torch.nn.functional as F

import amp
from amp.weights import forms
from helpers import ROOT, TESTS
from helpers import fsdp2_ranks as helper
from helpers.ranks import run_ranks

sys.path.insert(0, str(ROOT / "benchmarks"))
import fsdp2_memory  # noqa: E402

TWO_RANK_FORMS = list(helper.FORMS)
# Two ranks against one: the same global batches, but each rank's gradients summed apart and
# averaged by FSDP2's reduce-scatter (in FP32 for exact masters, else in the model's dtype), so
# they round differently: AdamW's steps of lr 1e-2 land within a few bf16 ulps.
TOLERANCE = dict(rtol=2e-2, atol=5e-3)


# -- one process --------------------------------------------------------------------------------


def _sharded(batch_norm=False, policy=None):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = policy or MixedPrecisionPolicy()
    model = helper.make_model()
    layers = (model[0], model[3])
    if batch_norm:  # in the root's group, with the head's parameters
        model[1] = torch.nn.BatchNorm1d(helper.HIDDEN)
        layers = (model[0],)
    for layer in layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def _shards(optimizer):
    """The local shards of the optimizer's parameters (the model's sharded ones, even while it
    holds them gathered)."""
    return [p._local_tensor.clone() for group in optimizer.param_groups for p in group["params"]]


def _unchanged(optimizer, before):
    now = _shards(optimizer)
    return not optimizer.state and all(
        a.dtype is torch.float32 and torch.equal(a, b) for a, b in zip(now, before, strict=True)
    )


def _train(model, optimizer, steps=2, scaled=True):
    """`steps` steps through amp.scale_loss, or (scaled=False) torch's plain backward."""
    for step in range(steps):
        inputs, targets = helper.batch(step, (0,), 0)
        loss = F.cross_entropy(model(inputs).float(), targets)
        if scaled:
            with amp.scale_loss(loss, optimizer) as scaled_loss:
                scaled_loss.backward()
        else:
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()


@pytest.mark.usefixtures("one_rank_group")
@pytest.mark.parametrize(
    "case, match",
    [
        ("amsgrad", r"param_groups\[0\] cannot be: it asks for amsgrad"),
        ("gathered", r"gathered now .* Call model.reshard\(\) before amp.initialize"),
        ("batch norm", r"parameters it keeps FP32 \(1.weight, 1.bias: .*Call fully_shard on"),
        ("policy", r"computes in torch.float16 .* Leave param_dtype unset"),
    ],
    ids=["amsgrad", "gathered", "batch norm", "policy"],
)
def test_what_o2_cannot_train_under_fully_shard_is_refused_changing_nothing(case, match):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    policy = MixedPrecisionPolicy(param_dtype=torch.float16) if case == "policy" else None
    model = _sharded(batch_norm=case == "batch norm", policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, amsgrad=case == "amsgrad")
    if case == "gathered":
        with torch.no_grad():  # FSDP2's root keeps its parameters gathered after this
            model(helper.batch(0, (0,), 0)[0])
        model.reshard()  # what the error asks for: then it is taken
        amp.initialize(model, optimizer, opt_level="O2", dtype=torch.bfloat16, verbosity=0)
        amp.deinitialize()
        with torch.no_grad():
            model(helper.batch(0, (0,), 0)[0])
    before = _shards(optimizer)
    with pytest.raises(RuntimeError, match=match):
        amp.initialize(model, optimizer, opt_level="O2", dtype=torch.bfloat16, verbosity=0)
    assert _unchanged(optimizer, before)
    model.reshard()
    _train(model, optimizer, steps=1, scaled=False)  # FSDP2 still trains its FP32 shards


@pytest.mark.usefixtures("one_rank_group")
def test_deinitialize_gives_fsdp2_its_fp32_shards_which_train_on():
    model = _sharded()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = amp.initialize(
        model, optimizer, opt_level="O2", dtype=torch.bfloat16, verbosity=0
    )
    try:
        _train(model, optimizer)  # FSDP2 gathers and reduces bf16 from its first forward on
        assert all(p._local_tensor.dtype is torch.bfloat16 for p in model.parameters())
        masters = {n: v.full_tensor() for n, v in model.state_dict().items()}
    finally:
        amp.deinitialize()
    for name, param in model.named_parameters():  # the FP32 values, in the shards FSDP2 gathers
        assert param._local_tensor.dtype is torch.float32
        assert torch.equal(param.full_tensor(), masters[name])
    inputs, _ = helper.batch(0, (0,), 0)
    assert model(inputs).dtype is torch.float32
    _train(model, optimizer, scaled=False)


@pytest.mark.usefixtures("one_rank_group")
@pytest.mark.parametrize("form", list(helper.FORMS))
def test_one_rank_sharded_trains_as_unsharded_and_resumes_bit_for_bit(form, tmp_path):
    """The global batches, with accumulation, a second loss, clipping and a skip
    (fsdp2_ranks.train_step), under fully_shard over one rank and without it; a fresh run
    resumed from the distributed checkpoint saved on the way."""
    ended = {}
    for sharded in (True, False):
        model, optimizer = helper.train_globally(form, sharded, tmp_path if sharded else None)
        ended[sharded] = helper.gathered(model, optimizer)
        amp.deinitialize()
    _equal(ended[True], ended[False])
    model, optimizer = helper.build(form)
    helper.load(model, optimizer, tmp_path)
    for step in range(helper.CHECKPOINT_STEP + 1, helper.STEPS):
        helper.train_step(model, optimizer, step, range(helper.WORLD), form)
    try:
        _equal(helper.gathered(model, optimizer), ended[True])
    finally:
        amp.deinitialize()


def test_two_ranks_hold_the_replicated_tensors_rows_of_8_bit_and_bf16_moments_bit_for_bit(
    tmp_path,
):
    """Each rank of two (torch's fake process group: given its shards of the gradients) holds,
    after three steps, the rows of what the same model replicated holds: weights, masters'
    rests, bf16 or 8-bit moments and their scales, bit for bit, at shards that start inside a
    tensor (a [100, 48] weight at element 2400, a bias of 100 at 50, a [64, 64] one with codes
    at 2048). Under "int8" only the [64, 64] weight holds codes (its rows are whole blocks); the
    others FP32 moments, equal but where torch's CPU op steps a shard's or the whole's last
    elements in its scalar loop (without the vector body's fused multiply-adds; the CUDA
    kernels have none): the bias's rank 0 elements 48 and 49, rank 1's 46 to 49."""
    run_ranks(TESTS / "helpers" / "fsdp2_fake_ranks.py", tmp_path, world=2, timeout=120)
    for rank in range(2):
        results = torch.load(tmp_path / f"fake-rank{rank}.pt", weights_only=False)
        for form, (sharded, replicated) in results.items():
            assert sorted(sharded) == sorted(replicated), form
            held = {key.split(" ", 1)[1] for key in sharded}
            moments = {"exp_avg_bf16"} if form == "compact-bf16" else {"exp_avg_codes"}
            assert moments <= held, form
            for key, value in sharded.items():
                expected = replicated[key]
                assert value.dtype == expected.dtype and value.shape == expected.shape, key
                if value.dtype is torch.float32 and key.startswith("1 exp_avg"):
                    torch.testing.assert_close(value, expected, rtol=1e-6, atol=0)
                    tail = slice(48, 50) if rank == 0 else slice(46, 50)
                    value, expected = value[: tail.start], expected[: tail.start]
                bits = [t.view(torch.uint8) if t.dim() else t for t in (value, expected)]
                assert torch.equal(*bits), (rank, form, key)


@pytest.mark.usefixtures("one_rank_group")
def test_the_memory_benchmark_counts_what_each_recipe_holds():
    """benchmarks/fsdp2_memory.py's bytes a parameter between steps, one rank: FSDP2's FP32
    shards and FP32 moments, amp's bf16 shards with 2-byte remainders or 1-byte corrections,
    8-bit moments with a scale per 32 where rows are whole blocks (FP32 ones elsewhere: the
    biases and norms); nothing gathered, no gradient."""
    params = list(fsdp2_memory.SmallLM(32, 1).parameters())
    coded = sum(p.numel() for p in params if forms.coded(p))
    total = sum(p.numel() for p in params)
    int8 = (coded * (2 + 2 * 4 / 32) + (total - coded) * 8) / total
    expected = {
        "FSDP2 mixed precision": (4, 0, 8),
        "amp O2 exact": (2, 2, 8),
        "amp O2 compact": (2, 1, 8),
        "amp O2 compact + int8": (2, 1, int8),
    }
    for recipe, (weights, rests, state) in expected.items():
        row = fsdp2_memory.measure(recipe, width=32, layers=1)
        assert row["weights"] == pytest.approx(weights, abs=0.02), recipe
        assert row["rests"] == pytest.approx(rests, abs=0.02), recipe
        assert row["optimizer state"] == pytest.approx(state, abs=0.05), recipe
        assert row["gathered"] == row["gradients"] == 0, recipe


# -- gloo jobs: one rank, two ranks, one rank -----------------------------------------------------


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """{job: [each rank's results]}: "one" first (its checkpoints are loaded by "two"), then
    "two", then "load" (which loads two's)."""
    out = tmp_path_factory.mktemp("fsdp2")
    script = TESTS / "helpers" / "fsdp2_ranks.py"
    found = {}
    for job, world in (("one", 1), ("two", 2), ("load", 1)):
        run_ranks(script, out, job, world=world)
        found[job] = [
            torch.load(out / f"{job}-rank{rank}.pt", weights_only=False) for rank in range(world)
        ]
    return found


def _result(jobs, job, form):
    results = [rank[form] for rank in jobs[job]]
    for result in results:
        assert "crash" not in result, result["crash"]
    return results


def _equal(a, b, path=""):
    """Bit for bit, dtypes included (a sharded state dict's int32 remainders read as int16)."""
    if isinstance(a, dict):
        assert sorted(a) == sorted(b), path
        for key in a:
            _equal(a[key], b[key], f"{path}/{key}")
        return
    if isinstance(a, torch.Tensor):
        if "master_remainder" in path:
            a, b = a.to(torch.int16), b.to(torch.int16)
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), path
        return
    assert a == b, path


@pytest.mark.parametrize("form", TWO_RANK_FORMS)
def test_a_skip_rank_1_alone_saw_is_every_ranks_and_changes_no_bit(jobs, form):
    rank0, rank1 = _result(jobs, "two", form)
    assert [s["scales"] for s in rank0["steps"]] == [s["scales"] for s in rank1["steps"]]
    scales = [s["scales"] for s in rank0["steps"]]
    step = helper.OVERFLOW_STEP
    assert scales[step][1] == scales[step - 1][1] / 2  # the second loss's scaler backed off
    assert scales[step][0] == scales[step - 1][0]
    for rank in (rank0, rank1):
        assert [s["overflow"] for s in rank["steps"]] == [
            ("3.bias",) if i == step else None for i in range(helper.STEPS)
        ]
        # every local shard: weights, master rests, moments, step counts
        _equal(rank["before skip"], rank["after skip"])


@pytest.mark.parametrize("form", TWO_RANK_FORMS)
def test_each_rank_holds_its_shards_only(jobs, form):
    """Between steps each rank holds its share of the weights, the masters' rests and the
    moments (in any form: a moment's bf16 values or 8-bit codes); together, every element
    once."""
    rank0, rank1 = _result(jobs, "two", form)
    total = sum(value.numel() for value in rank0["end"]["model"].values())
    for kind in ("weight", "rest", "exp_avg", "exp_avg_sq"):
        names = (kind, f"{kind}_bf16", f"{kind}_codes")
        held = [
            sum(v.numel() for k, v in rank["end local"].items() if k.split()[0] in names)
            for rank in (rank0, rank1)
        ]
        assert sum(held) == total and 0 < held[1] <= held[0] < total, kind


@pytest.mark.parametrize("form", TWO_RANK_FORMS)
def test_clipping_takes_the_global_norm(jobs, form):
    """Through amp.master_params (FP32), or torch's clip_grad_norm_ on the model's bf16 gradients
    (CLIP_MODEL: torch sums their squares in bf16)."""
    rel_tol = 1e-2 if form in helper.CLIP_MODEL else 1e-6
    rank0, rank1 = _result(jobs, "two", form)
    for step, (a, b) in enumerate(zip(rank0["steps"], rank1["steps"])):
        if step == helper.OVERFLOW_STEP:
            continue
        (norm, local0, every), (norm1, local1, _) = a["norms"], b["norms"]
        assert norm == norm1 and norm > helper.MAX_NORM  # clipped, by the same norm
        assert math.isclose(norm, every, rel_tol=rel_tol)  # both ranks' gradients
        assert math.isclose(every, math.hypot(local0, local1), rel_tol=1e-6)
        assert not math.isclose(norm, local0, rel_tol=0.1)


@pytest.mark.parametrize("form", TWO_RANK_FORMS)
def test_resumed_at_the_same_world_size_bit_for_bit(jobs, form):
    for rank in _result(jobs, "two", form):
        _equal(rank["end"], rank["resumed"])
        _equal(rank["end local"], rank["resumed local"])


@pytest.mark.parametrize("form", TWO_RANK_FORMS)
def test_a_two_rank_checkpoint_loads_at_one_rank_bit_for_bit(jobs, form):
    """The head's bias of 100 splits at element 50, inside a block of 32."""
    rank0, rank1 = _result(jobs, "two", form)
    _equal(rank0["end"], rank1["end"])
    (loaded,) = _result(jobs, "load", form)
    _equal(loaded["from two"], rank0["end"])


@pytest.mark.parametrize("form", TWO_RANK_FORMS)
def test_a_one_rank_checkpoint_loads_at_two_ranks_bit_for_bit(jobs, form):
    (one,) = _result(jobs, "one", form)
    for rank in _result(jobs, "two", form):
        _equal(rank["from one"], one["end"])


@pytest.mark.parametrize("form", TWO_RANK_FORMS)
def test_two_ranks_train_the_global_batches_as_one_process(jobs, form):
    (one,) = _result(jobs, "one", form)  # bit for bit one process's (the test above)
    rank0, _ = _result(jobs, "two", form)
    for name, value in rank0["end"]["model"].items():
        torch.testing.assert_close(value, one["end"]["model"][name], **TOLERANCE, msg=name)


@pytest.mark.parametrize("form", helper.MOMENT_FORMS)
def test_8_bit_and_bf16_moments_of_weights_sharded_along_dim_1_are_refused_changing_nothing(
    jobs, form
):
    """Under "int8" only a weight holding codes: 3.weight (rows of 32); 0.weight's rows of 8 keep
    FP32 moments, which depend on no element's place."""
    name = "3.weight" if form == "compact-int8" else "0.weight"
    for rank in _result(jobs, "two", form):
        message = rank["dim 1"]["error"]
        assert message is not None, "trained without an error"
        assert f"'{name}' is split along dim 1 (fully_shard's shard_placement_fn)" in message
        assert "Shard it along dim 0" in message and "optimizer_state='fp32'" in message
        assert rank["dim 1"]["unchanged"]

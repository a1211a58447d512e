"""apex.parallel from the apex package: SyncBatchNorm and convert_syncbn_model, and
DistributedDataParallel's arguments in one process (two gloo ranks: test_scripts.py)."""

import apex
import pytest
import torch
from apex.parallel import DistributedDataParallel, SyncBatchNorm, convert_syncbn_model

import amp


# --- SyncBatchNorm and convert_syncbn_model ------------------------------------------------------


def test_sync_batchnorm_alone_is_batchnorm_with_apex_channel_last_and_fuse_relu():
    torch.manual_seed(0)
    plain = torch.nn.BatchNorm2d(3)
    synced = SyncBatchNorm(3)
    last = SyncBatchNorm(3, channel_last=True)
    fused = SyncBatchNorm(3, fuse_relu=True)
    x, z = torch.randn(4, 3, 5, 5), torch.randn(4, 3, 5, 5)
    expected = plain(x)
    assert torch.equal(synced(x), expected)
    assert torch.equal(last(x.permute(0, 2, 3, 1)), expected.permute(0, 2, 3, 1))
    assert torch.equal(fused(x, z), torch.relu(expected + z))
    for module in (synced, last, fused):
        assert torch.equal(module.running_mean, plain.running_mean)
        assert torch.equal(module.running_var, plain.running_var)


def test_convert_syncbn_model_keeps_statistics_and_weights_and_skips_instance_norm():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.InstanceNorm2d(4, affine=True)
    )
    model[1].running_mean.fill_(0.5)
    with torch.no_grad():
        model[1].weight.fill_(2.0)
    model.eval()
    before = model(torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(1)))
    converted = convert_syncbn_model(model, channel_last=False)
    assert type(converted[1]) is SyncBatchNorm and isinstance(converted[2], torch.nn.InstanceNorm2d)
    assert converted[1].running_mean is model[1].running_mean and not converted[1].training
    after = converted(torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(1)))
    assert torch.equal(before, after)
    assert type(convert_syncbn_model(torch.nn.BatchNorm1d(3))) is SyncBatchNorm


def test_convert_syncbn_model_keeps_the_layers_dtype_and_frozen_weights():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 6), torch.nn.Sequential(torch.nn.BatchNorm1d(6), torch.nn.ReLU())
    ).double()
    model[1][0].weight.requires_grad_(False)
    x = torch.randn(5, 4, dtype=torch.float64)
    expected = model(x)  # training mode: batch statistics, running stats updated once
    model[1][0].running_mean.zero_()
    model[1][0].running_var.fill_(1.0)
    model[1][0].num_batches_tracked.zero_()
    converted = convert_syncbn_model(model)
    bn = converted[1][0]
    assert type(bn) is apex.parallel.SyncBatchNorm
    assert bn.weight.dtype is bn.bias.dtype is torch.float64
    assert not bn.weight.requires_grad and bn.bias.requires_grad
    assert torch.equal(converted(x), expected)
    assert [p for p in converted.parameters() if p.requires_grad] == [
        converted[0].weight,
        converted[0].bias,
        bn.bias,
    ]


def test_amp_o2_keeps_apex_sync_batchnorm_in_float32():
    model = convert_syncbn_model(
        torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
    try:
        assert model[0].weight.dtype is torch.float16 and model[1].weight.dtype is torch.float32
        assert torch.isfinite(model(torch.randn(8, 4))).all()
    finally:
        amp.deinitialize()


# --- DistributedDataParallel in one process ----------------------------------------------------


def _ddp_gradients(**arguments):
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(4, 2), **arguments)
    model(torch.ones(3, 4)).sum().backward()
    return model, model.module.weight.grad


# apex's no-op arguments are passed on purpose: ApexCompatWarning is tested in
# test_ignored_arguments.py (in a fresh process: it warns once per argument and process).
@pytest.mark.filterwarnings("ignore::apex.ApexCompatWarning")
@pytest.mark.parametrize(
    "arguments, factor",
    [
        (dict(), 1.0),
        (dict(delay_allreduce=True, message_size=1, num_allreduce_streams=2, prof=True), 1.0),
        (dict(gradient_predivide_factor=4.0), 1.0),  # divided by 4, then times 4 / world size
        (dict(gradient_average=False, gradient_predivide_factor=4.0), 0.25),  # apex's warning
        (dict(gradient_average_split_factor=2.0, gradient_average=False), 0.5),
        (dict(allreduce_always_fp32=True), 1.0),
    ],
)
def test_ddp_honours_apex_gradient_arithmetic(one_rank_group, arguments, factor):
    _, expected = _ddp_gradients()
    _, found = _ddp_gradients(**arguments)
    torch.testing.assert_close(found, expected * factor, rtol=0, atol=0)


def test_sync_batchnorm_on_cpu_in_a_one_rank_group_is_batchnorm(one_rank_group):
    # torch's SyncBatchNorm raises on CPU once a process group exists, whatever its size.
    torch.manual_seed(0)
    plain, synced = torch.nn.BatchNorm1d(3), SyncBatchNorm(3)
    x = torch.randn(6, 3)
    assert torch.equal(synced(x), plain(x))
    assert torch.equal(synced.running_var, plain.running_var)


def test_ddp_refuses_what_it_cannot_honour_and_toggles_allreduce(one_rank_group):
    module = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="shared_param is not supported"):
        DistributedDataParallel(module, shared_param=True)
    with pytest.raises(ValueError, match="retain_allreduce_buffers=True is not supported"):
        DistributedDataParallel(module, retain_allreduce_buffers=True)
    with pytest.raises(ValueError, match="only valid with delay_allreduce=False"):
        DistributedDataParallel(
            module, delay_allreduce=True, allreduce_trigger_params=[module.weight]
        )
    with pytest.raises(ValueError, match="gradient_predivide_factor must be positive"):
        DistributedDataParallel(module, gradient_predivide_factor=0)
    model = DistributedDataParallel(module, find_unused_parameters=True)  # torch's, passed on
    model.disable_allreduce()
    assert model.require_backward_grad_sync is False
    model.enable_allreduce()
    assert model.require_backward_grad_sync is True


# --- apex.parallel.distributed's flat helpers (two ranks: test_scripts.py) ------------------------


def test_flat_dist_call_runs_the_call_once_per_type_on_a_flat_buffer(one_rank_group):
    from apex.parallel.distributed import (
        apply_flat_dist_call,
        flat_dist_call,
        flatten,
        split_by_type,
        unflatten,
    )

    tensors = [torch.ones(2), torch.ones(3).half(), torch.full((2, 2), 2.0), torch.ones(1).half()]
    buckets = split_by_type(tensors)
    assert list(buckets) == ["torch.FloatTensor", "torch.HalfTensor"]
    assert [len(b) for b in buckets.values()] == [2, 2]
    flat = flatten(buckets["torch.FloatTensor"])
    assert flat.shape == (6,)
    assert [t.shape for t in unflatten(flat, buckets["torch.FloatTensor"])] == [(2,), (2, 2)]
    seen = []

    def double(buffer, factor=2.0):
        seen.append((buffer.dtype, buffer.numel()))
        buffer.mul_(factor)

    flat_dist_call(tensors, double)
    assert seen == [(torch.float32, 6), (torch.float16, 4)]
    assert torch.equal(tensors[2], torch.full((2, 2), 4.0)) and tensors[3].item() == 2.0
    apply_flat_dist_call(tensors[:1], double, (0.5,))
    assert torch.equal(tensors[0], torch.ones(2))
    flat_dist_call(tensors, torch.distributed.all_reduce)  # the mean over one rank
    assert torch.equal(tensors[2], torch.full((2, 2), 4.0))

"""Cast policies and the weight-cast cache (amp/casting/casts.py): amp's own cache is checked
against each weight at every use, both caches count as filled while amp casts, and FakeTensors
are cached without reading their data pointer."""

import warnings

import torch

import amp
from amp._state import amp_state
from amp.casting.casts import policy_for, with_device


def test_policies_are_shared_and_regions_change_one_device():
    policy = policy_for(torch.bfloat16, torch.bfloat16)
    assert policy is policy_for(torch.bfloat16, torch.bfloat16)
    cuda_off = with_device(policy, "cuda", None, True)
    assert (cuda_off.cpu, cuda_off.cuda) == (torch.bfloat16, None)
    assert with_device(None, None, None, True) is None


def test_the_caches_count_as_filled_while_amp_casts():
    """torch's cache fills without amp seeing it: while a region or O1 holds the patches the
    caches count as filled, so that scale_loss and optimizer steps empty them."""
    cache = amp_state.cast_cache
    weight = torch.nn.Parameter(torch.randn(4, 4))
    cache.clear()
    assert not cache.filled
    with amp.autocast(dtype=torch.bfloat16):
        assert cache.filled
        torch.einsum("ij,kj->ik", torch.randn(2, 4), weight)  # amp casts einsum on the CPU
        assert len(cache) == 1
    amp.deinitialize()
    assert not cache.filled and len(cache) == 0


def test_a_cast_made_under_no_grad_serves_no_grad_and_is_made_again_for_grad_mode():
    cast = amp_state.cast_cache.get_cast(torch.bfloat16)
    weight = torch.nn.Parameter(torch.randn(4, 4))
    try:
        with torch.no_grad():
            first = cast(weight)
            assert cast(weight) is first
        trained = cast(weight)
        assert trained is not first and trained.requires_grad
        with torch.no_grad():
            assert cast(weight) is trained  # a grad-mode cast serves no_grad uses too
    finally:
        amp_state.cast_cache.clear()


def test_a_fake_tensor_is_cached_without_reading_its_data_pointer():
    """FakeTensors (device_work.py counts real sizes with them) warn when their data pointer is
    read: the cache compares storages by address instead."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    cast = amp_state.cast_cache.get_cast(torch.bfloat16)
    try:
        with FakeTensorMode(), warnings.catch_warnings():
            warnings.simplefilter("error")
            weight = torch.nn.Parameter(torch.randn(4, 4))
            first = cast(weight)
            assert cast(weight) is first
            weight.data = torch.randn(4, 4)
            assert cast(weight) is not first
    finally:
        amp_state.cast_cache.clear()

"""torch's own autocast state as amp sets it (amp/casting/native_autocast.py): every change is put
back exactly, a region's two devices set through their dispatch keys read as torch's setters
would leave them, and a write of a thread's policy to None excludes torch's autocast until the
write that ends it."""

import pytest
import torch

from amp._state import amp_state
from amp.casting import native_autocast as native
from helpers.state import torch_autocast_state


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("cache_enabled", [True, False])
def test_enter_on_sets_both_devices_as_torchs_setters_would_and_exit_on_undoes_it(
    dtype, cache_enabled
):
    before = torch_autocast_state()
    saved = native.enter_on(dtype, cache_enabled)
    assert torch_autocast_state() == (True, True, dtype, dtype, cache_enabled)
    assert native.exit_on(saved)  # the outermost region
    assert torch_autocast_state() == before
    native.increment_nesting()  # inside another region, it is not the outermost
    try:
        assert not native.exit_on(native.enter_on(dtype, cache_enabled))
    finally:
        assert native.decrement_nesting() == 0


def test_switch_changes_only_its_targets_and_restore_puts_them_back():
    before = torch_autocast_state()
    outer = native.switch(native.TARGETS["cpu", torch.bfloat16], True)
    inner = native.switch((("cpu", None), ("cuda", torch.float16)), False)
    assert torch_autocast_state() == (False, True, torch.bfloat16, torch.float16, False)
    assert inner[2] is False  # cuda's dtype was float16 already
    native.restore(inner)
    assert torch_autocast_state() == (True, False, torch.bfloat16, torch.float16, True)
    native.restore(outer)
    assert torch_autocast_state() == before


def test_writing_a_threads_policy_to_none_excludes_torchs_autocast_until_it_is_put_back():
    thread = amp_state.thread
    saved = native.enter_on(torch.bfloat16, True)
    try:
        outer = thread.own_policy
        thread.policy = None  # as amp's optimizer step writes it
        assert not torch.is_autocast_enabled("cpu") and not native.any_enabled()
        a = torch.randn(2, 2)
        assert torch.mm(a, a).dtype is torch.float32
        thread.policy = outer
        assert torch.is_autocast_enabled("cpu") and torch.mm(a, a).dtype is torch.bfloat16
        assert thread.saved_native == []
    finally:
        native.exit_on(saved)

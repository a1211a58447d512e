"""torch.jit.script under amp's patches (amp/casting/torchscript.py): scripting works while the
patches are installed and after `amp.deinitialize()`, scripted code runs torch's ops under torch's
autocast state (amp's), as under torch.autocast, and deinitialize takes amp's registrations out
of torch.jit exactly."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch import _jit_internal
from torch.jit import _builtins

import amp
from amp.casting import torchscript
from helpers.models import make_model

pytestmark = pytest.mark.filterwarnings(
    "ignore:`torch.jit.script` is deprecated:DeprecationWarning"
)


def _fresh_module():
    """A module of classes TorchScript has not met: it caches what it compiled per class, so a
    class scripted before amp patched torch would not be resolved again.

    It calls each kind of patched function TorchScript resolves differently: builtins
    (F.linear, F.conv1d, F.gelu, torch.matmul), a boolean_dispatch function (F.max_pool3d) and
    functions compiled from their source (F.cross_entropy, F.interpolate, torch.norm)."""

    class Linear(nn.Linear):
        pass

    class Conv1d(nn.Conv1d):
        pass

    class Scriptable(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = Linear(8, 8)
            self.conv = Conv1d(2, 2, 3, padding=1)
            self.norm = nn.LayerNorm(8)

        def forward(self, x, target):
            h = self.norm(F.gelu(self.linear(x)))
            h = self.conv(h.view(2, 2, 8)).view(1, 1, 1, 4, 8)
            h = F.max_pool3d(h, (1, 1, 2)).view(1, 4, 4)
            h = F.interpolate(h, scale_factor=2.0).squeeze(0)
            loss = F.cross_entropy(h, target) + torch.norm(h) + torch.softmax(h, -1).sum()
            return torch.matmul(h, h.t()).sum() + loss

    return Scriptable()


def _inputs():
    return torch.randn(4, 8), torch.tensor([0, 1, 2, 3])


def _scripted(state):
    module = torch.jit.script(_fresh_module())
    module.load_state_dict(state)
    return module


@pytest.mark.parametrize("installed_by", ["autocast", "O1"])
def test_scripting_works_under_amps_patches_and_after_deinitialize(installed_by):
    torch.manual_seed(0)
    eager = _fresh_module()
    state = eager.state_dict()
    x, target = _inputs()
    if installed_by == "O1":
        amp.initialize(make_model(), opt_level="O1", dtype=torch.bfloat16, verbosity=0)
        under = _scripted(state)(x, target)
    else:
        with amp.autocast(dtype=torch.bfloat16):
            scripted = _scripted(state)
            under = scripted(x, target)
            # TorchScript calls torch's ops, which torch's autocast (amp's state) casts.
            assert scripted.linear(x).dtype is torch.bfloat16
            assert F.linear(x, state["linear.weight"]).dtype is torch.bfloat16
    amp.deinitialize()
    after = _scripted(state)(x, target)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # torch's own, amp's patches gone
        expected = _scripted(state)(x, target)
    assert torch.equal(under, expected)  # as a scripted module runs under torch.autocast
    assert after.dtype is torch.float32
    torch.testing.assert_close(after, eager(x, target))


def test_a_function_scripted_under_amp_keeps_torch_autocast_regions():
    with amp.autocast(dtype=torch.bfloat16):

        @torch.jit.script
        def square(x):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return torch.mm(x, x)

        assert square(torch.randn(2, 2)).dtype is torch.bfloat16
    amp.deinitialize()


def test_torchscript_sees_originals_only_while_the_patches_are_installed():
    resolvers = [getattr(module, name) for module, name in torchscript._RESOLVERS]
    table = dict(_builtins._get_builtin_table())
    with amp.autocast(dtype=torch.bfloat16):
        assert _builtins._find_builtin(F.linear) == "aten::linear"
        assert _jit_internal._try_get_dispatched_fn(F.max_pool3d) is not None
    amp.deinitialize()
    assert [getattr(module, name) for module, name in torchscript._RESOLVERS] == resolvers
    assert all(
        getattr(module, name) is resolver
        for (module, name), resolver in zip(torchscript._RESOLVERS, resolvers)
    )
    assert _builtins._get_builtin_table() == table  # nothing of amp's was left in torch.jit

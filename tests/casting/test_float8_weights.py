"""The FP8 weight cache (float8_weights.py): each weight cast once between optimizer steps and
served to every micro-batch, the weights of the last step cast together, and never a stale
layout: after a step (amp's fused one too, which writes through raw pointers), a write, a load,
new data, or in calls that train nothing."""

import gc

import pytest
import torch
from torch.optim import optimizer as torch_optimizer

import amp
from amp.casting import float8, float8_weights
from amp.kernels import float8 as kernels8

RECIPE = float8.RECIPES["tensorwise"]
CACHE = float8_weights.CACHE


@pytest.fixture(autouse=True)
def empty_cache():
    CACHE.clear()
    yield
    CACHE.clear()


@pytest.fixture
def casts(monkeypatch):
    """The matrices kernels.float8.cast is called with, one list per call."""
    calls = []
    cast = kernels8.cast

    def recording(matrices, *args):
        calls.append(list(matrices))
        return cast(matrices, *args)

    monkeypatch.setattr(kernels8, "cast", recording)
    return calls


def _weight_casts(calls, *weights):
    """How many calls cast any of `weights`, and how many of them each call cast."""
    found = [sum(any(m is w for w in weights) for m in call) for call in calls]
    return [count for count in found if count]


def _layer(seed=0, out_features=32, in_features=48):
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=generator) * 0.1
    return torch.nn.Parameter(weight.to(torch.bfloat16))


def _batch(seed, in_features=48):
    generator = torch.Generator().manual_seed(100 + seed)
    return torch.randn(16, in_features, generator=generator).to(torch.bfloat16)


def _fresh(x, weight):
    """The traced Function's output on the weight as it is now: what a stale cast would miss."""
    return float8.Float8Linear.apply(x, weight.detach(), RECIPE)


def _train(x, *weights):
    out = x
    for weight in weights:
        out = float8.linear(out, weight, None, RECIPE)
    out.float().square().mean().backward()
    return out


def test_micro_batches_of_a_step_share_one_cast_of_each_weight(casts):
    weight = _layer()
    optimizer = torch.optim.SGD([weight], lr=0.5)
    for step in range(2):
        for micro in range(3):
            out = _train(_batch(micro), weight)
            assert torch.equal(out, _fresh(_batch(micro), weight))
        assert _weight_casts(casts, weight) == [1] * (step + 1)
        optimizer.step()
        optimizer.zero_grad()


def test_the_first_forward_after_a_step_casts_the_last_steps_weights_together(casts):
    first, second = _layer(1, 32, 48), _layer(2, 16, 32)
    optimizer = torch.optim.SGD([first, second], lr=0.5)
    _train(_batch(0), first, second)
    assert _weight_casts(casts, first, second) == [1, 1]  # each at its first use
    optimizer.step()
    casts.clear()
    out = _train(_batch(1), first, second)
    assert _weight_casts(casts, first, second) == [2]  # both at the first linear
    hidden = float8.Float8Linear.apply(_batch(1), first.detach(), RECIPE)
    assert torch.equal(out, _fresh(hidden, second))


def _data_add(weight):
    weight.data.add_(1.0)  # in place through .data: no version counter sees it


class DataSGD(torch.optim.Optimizer):
    """An optimizer that writes through `.data` in place, as raw-pointer kernels do."""

    def __init__(self, params):
        super().__init__(params, {})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for param in group["params"]:
                param.data.add_(param.grad, alpha=-0.5)


def _load(weight):
    holder = torch.nn.Linear(48, 32, bias=False).to(torch.bfloat16)
    holder.weight = weight
    holder.load_state_dict({"weight": torch.ones(32, 48, dtype=torch.bfloat16)})


WRITES = {
    "in place": lambda w: w.detach().mul_(2.0),
    "new data": lambda w: setattr(w, "data", w.detach() * 3.0),
    "load_state_dict": _load,
    "a step through .data": lambda w: DataSGD([w]).step(),
}


@pytest.mark.parametrize("write", WRITES.values(), ids=WRITES.keys())
def test_a_written_weight_is_cast_again(casts, write):
    weight = _layer()
    _train(_batch(0), weight)
    write(weight)
    casts.clear()
    out = _train(_batch(1), weight)
    assert _weight_casts(casts, weight) == [1]
    assert torch.equal(out, _fresh(_batch(1), weight))


def test_a_write_through_data_between_micro_batches_is_not_seen(casts):
    """The documented limit: no version counter, no step: the layouts made before it serve."""
    weight = _layer()
    _train(_batch(0), weight)
    _data_add(weight)
    out = _train(_batch(1), weight)
    assert _weight_casts(casts, weight) == [1]
    assert not torch.equal(out, _fresh(_batch(1), weight))


def test_calls_that_train_nothing_neither_read_nor_fill_the_cache(casts):
    """Evaluation that swaps weights in through .data is answered with the weights it swapped
    in, and the training after it with the ones it swapped back."""
    weight = _layer()
    _train(_batch(0), weight)
    kept = weight.detach().clone()
    weight.data.copy_(torch.full_like(kept, 0.25))  # evaluation weights, no version bump
    for mode in (torch.no_grad, torch.inference_mode):
        with mode():
            assert torch.equal(float8.linear(_batch(1), weight, None, RECIPE),
                               _fresh(_batch(1), weight))
    weight.requires_grad_(False)  # frozen: cast every call
    assert torch.equal(float8.linear(_batch(2), weight, None, RECIPE), _fresh(_batch(2), weight))
    weight.requires_grad_(True)
    weight.data.copy_(kept)
    optimizer = torch.optim.SGD([weight], lr=0.1)
    optimizer.step()  # no gradient: nothing changes, the layouts go
    assert torch.equal(_train(_batch(3), weight), _fresh(_batch(3), weight))
    assert _weight_casts(casts, weight) == [1] * 5


def _hooked():
    return any(
        getattr(hook, "__self__", None) is CACHE
        for hook in torch_optimizer._global_optimizer_post_hooks.values()
    )


def test_layouts_go_with_the_step_and_the_hook_with_the_weights():
    weight = _layer()
    _train(_batch(0), weight)
    assert len(CACHE) == 1 and _hooked()
    torch.optim.SGD([weight], lr=0.1).step()
    assert all(entry.casts is None for entry in CACHE._entries.values())  # nothing held
    del weight
    gc.collect()
    assert len(CACHE) == 0 and not _hooked()


def test_deinitialize_empties_the_cache():
    model = torch.nn.Sequential(torch.nn.Linear(48, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp.initialize(
        model, optimizer, opt_level="O2", dtype=torch.bfloat16, float8="tensorwise", verbosity=0
    )
    try:
        model(torch.randn(16, 48)).square().mean().backward()
        assert len(CACHE) == 2
    finally:
        amp.deinitialize()
    assert len(CACHE) == 0 and not _hooked()


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_amps_fused_step_on_cupy_is_seen(emulated_cupy, recipe):
    """amp's O2 step on the CuPy kernels (the emulated grid) writes the bf16 weights through raw
    pointers: the step hook, not a version counter, makes the next forward cast them again."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(48, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    model, optimizer = amp.initialize(
        model, optimizer, opt_level="O2", dtype=torch.bfloat16, float8=recipe, verbosity=0
    )
    try:
        for step in range(2):
            x = _batch(step).float()
            out = model(x)
            hidden = torch.relu(float8.Float8Linear.apply(
                x.to(torch.bfloat16), model[0].weight.detach(), float8.RECIPES[recipe]
            ) + model[0].bias)
            expected = float8.Float8Linear.apply(hidden, model[2].weight.detach(),
                                                 float8.RECIPES[recipe]) + model[2].bias
            assert torch.equal(out, expected.float()), step
            versions = [p._version for p in model.parameters()]
            with amp.scale_loss(out.square().mean(), optimizer) as scaled:
                scaled.backward()
            optimizer.step()
            optimizer.zero_grad()
        assert [p._version for p in model.parameters()] == versions  # raw writes: unseen
        assert any(c[0].startswith("amp_compact_adam<") for c in emulated_cupy.calls)
    finally:
        amp.deinitialize()

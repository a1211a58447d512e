"""amp.initialize(..., fp32_modules=[...]) (amp/casting/fp32_modules.py): by class or by name,
at O1 and O2/O3; a kept module tied to a cast one is refused."""

import copy

import pytest
import torch

import amp
from amp._state import INHERIT, amp_state


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.norm = torch.nn.LayerNorm(8)

    def forward(self, x):
        return self.norm(self.lin(x))


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(4, 8)
        self.blocks = torch.nn.ModuleList([Block(), Block()])
        self.head = torch.nn.Linear(8, 2)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def make():
    torch.manual_seed(0)
    model = Net()
    return model, torch.optim.SGD(model.parameters(), lr=1.0)


def dtypes_seen(model):
    """module name -> (input dtype, output dtype) of its last call."""
    seen = {}
    for name, module in model.named_modules():
        module.register_forward_hook(
            lambda m, args, out, name=name: seen.__setitem__(name, (args[0].dtype, out.dtype))
        )
    return seen


X = torch.randn(16, 4, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("spec", [["blocks.1"], ["blocks.1.*", "blocks.1"], [Block]])
def test_o1_runs_them_without_casting_on_fp32_inputs(spec):
    model, optimizer = make()
    seen = dtypes_seen(model)
    model, optimizer = amp.initialize(
        model, optimizer, opt_level="O1", verbosity=0, fp32_modules=spec
    )
    try:
        model(X)
    finally:
        amp.deinitialize()
    assert seen["inp"][1] is torch.float16 and seen["head"][1] is torch.float16
    assert seen["blocks.1.lin"] == (torch.float32, torch.float32)  # casting off inside
    assert seen["blocks.1"][0] is torch.float32
    if spec == [Block]:
        assert seen["blocks.0.lin"] == (torch.float32, torch.float32)
    else:
        assert seen["blocks.0.lin"][1] is torch.float16  # the other block still casts


@pytest.mark.parametrize("opt_level", ["O2", "O3"])
@pytest.mark.parametrize("spec", [["blocks.0"], [torch.nn.LayerNorm]])
def test_o2_o3_keep_their_weights_fp32_with_inputs_and_outputs_cast(opt_level, spec):
    model, optimizer = make()
    kept = [
        "blocks.0.lin.weight",
        "blocks.0.lin.bias",
        "blocks.0.norm.weight",
        "blocks.0.norm.bias",
    ]
    if spec != ["blocks.0"]:
        kept = [name for name in kept if ".norm." in name] + [
            "blocks.1.norm.weight",
            "blocks.1.norm.bias",
        ]
    seen = dtypes_seen(model)
    model, optimizer = amp.initialize(
        model, optimizer, opt_level=opt_level, verbosity=0, fp32_modules=spec, max_loss_scale=256
    )
    try:
        for name, param in model.named_parameters():
            assert param.dtype is (torch.float32 if name in kept else torch.float16), name
        before = {name: p.detach().clone() for name, p in model.named_parameters()}
        with amp.scale_loss(model(X).float().pow(2).mean(), optimizer) as scaled:
            scaled.backward()
        optimizer.step()
        for name, param in model.named_parameters():
            assert not torch.equal(param, before[name]), name  # every parameter trains
        kept_module = "blocks.0" if spec == ["blocks.0"] else "blocks.0.norm"
        assert seen[kept_module][0] is torch.float32  # FP32 inside ...
        assert seen["blocks.1"][0] is torch.float16  # ... and the model's dtype after it
        if spec == ["blocks.0"]:
            assert seen["blocks.0.lin"] == (torch.float32, torch.float32)
        if opt_level == "O2":
            masters = {id(p) for p in amp.master_params(optimizer)}
            for name, param in model.named_parameters():  # kept ones are stepped directly
                assert (id(param) in masters) is (name in kept), name
        state = model.state_dict()
        assert all(value.dtype is torch.float32 for value in state.values())
    finally:
        amp.deinitialize()
    assert all(p.dtype is torch.float32 for p in model.parameters())


def test_a_model_with_fp32_modules_copies_and_pickles(tmp_path):
    model, optimizer = make()
    model, optimizer = amp.initialize(
        model, optimizer, opt_level="O2", verbosity=0, fp32_modules=["blocks.0"]
    )
    try:
        twin = copy.deepcopy(model)
        torch.save(model, tmp_path / "model.pt")
        assert torch.equal(twin(X), model(X))
    finally:
        amp.deinitialize()


def test_an_exception_inside_a_kept_module_restores_casting():
    model, optimizer = make()

    def fail(module, args):
        raise RuntimeError("boom")

    model.blocks[0].lin.register_forward_pre_hook(fail)
    model, optimizer = amp.initialize(
        model, optimizer, opt_level="O1", verbosity=0, fp32_modules=["blocks.0"]
    )
    try:
        with pytest.raises(RuntimeError, match="boom"):
            model(X)
        assert amp_state.thread.policy is INHERIT
        with amp.trace() as trace:
            model.head(torch.randn(2, 8))
        assert trace.records[0].ran_in is torch.float16
    finally:
        amp.deinitialize()


@pytest.mark.parametrize(
    "spec, error, message",
    [
        ("blocks.0", TypeError, "must be a list or tuple; got str"),
        (Block, TypeError, "must be a list or tuple; got type"),
        ([3], TypeError, r"fp32_modules\[0\] is 3 \(int\)"),
        ([torch.nn.Linear, "blocks.9"], ValueError, r"fp32_modules\[1\], pattern 'blocks.9'"),
        ([torch.nn.Conv2d], ValueError, "class Conv2d, matches no module"),
    ],
)
def test_bad_specs_raise_and_change_nothing(spec, error, message):
    model, optimizer = make()
    with pytest.raises(error, match=message):
        amp.initialize(model, optimizer, opt_level="O2", verbosity=0, fp32_modules=spec)
    assert not amp_state.initialized and not amp_state.fp32_modules
    assert all(p.dtype is torch.float32 for p in model.parameters())
    assert "_amp_record" not in vars(optimizer)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


class _TiedLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(10, 8)
        self.mid = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens):
        return self.head(self.mid(self.emb(tokens)))


@pytest.mark.parametrize("opt_level", ["O2", "O3"])
@pytest.mark.parametrize("kept", ["head", "emb"])
def test_a_kept_module_tied_to_a_cast_one_is_refused_and_nothing_changes(opt_level, kept):
    torch.manual_seed(0)
    model = _TiedLM()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="tied weights"):
        amp.initialize(model, optimizer, opt_level=opt_level, verbosity=0, fp32_modules=[kept])
    assert model.head.weight is model.emb.weight and model.emb.weight.dtype is torch.float32
    assert optimizer.param_groups[0]["params"][0] is model.emb.weight
    # Keeping both holders works: the tied weight stays FP32 for both.
    model, optimizer = amp.initialize(
        model, optimizer, opt_level=opt_level, verbosity=0, fp32_modules=["head", "emb"]
    )
    try:
        assert model.emb.weight.dtype is torch.float32 and model.mid.weight.dtype is torch.float16
        assert model(torch.randint(0, 10, (4, 5))).isfinite().all()
    finally:
        amp.deinitialize()

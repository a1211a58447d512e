"""The training-step variants every precision benchmark compares, each set up on a fresh model.

  fp32               plain FP32: loss.backward(); optimizer.step()
  torch.autocast     torch.autocast + torch.amp.GradScaler (the reference of every ratio)
  amp O1             amp.initialize(opt_level="O1") + amp.scale_loss
  amp.autocast       amp.autocast + amp.GradScaler
  amp O2             amp.initialize(opt_level="O2"): model in `dtype`, FP32 masters
  amp O3             amp.initialize(opt_level="O3"): everything in `dtype`
  manual O2 fused    the O2 a torch user writes by hand, with AdamW(fused=True); see below
  manual O2 foreach  the same with AdamW(foreach=True)
  amp O2 + float8    amp O2 with float8="tensorwise" (or "rowwise"): F.linear's matmuls in FP8;
                     set up here, counted by step_costs' device-work table only
  torchao float8     manual O2 foreach with torchao's Float8Linear swapped in (the FP8 peer)
  amp O2 compact     amp O2 with master_weights="compact" (and "... int8": optimizer_state="int8");
                     "amp O2 bf16 no masters": master_weights=False (benchmarks/compact_state.py)

The manual O2 peer: every module but batch norm is cast to `dtype` (batch norm stays FP32, as amp
O2 keeps it); the optimizer holds an FP32 master copy of every parameter and a persistent FP32
gradient for each. A step: the model's forward and backward under torch.amp.GradScaler's scaled
loss; one `torch._foreach_copy_` of the model's gradients into the master gradients, the model's
gradients freed; `scaler.step` (unscale, inf/NaN check, AdamW on the masters; fused AdamW takes
the unscale into its kernel) and `scaler.update`; one `torch._foreach_copy_` of the masters back
into the model. The host work per step is a constant number of foreach calls.

Every variant steps `torch.optim.AdamW(lr=1e-3)` with torch's default implementation (on CPU a
loop over the parameters, on CUDA foreach) unless `optimizer="foreach"` or `"fused"`; "sgd",
"sgd-foreach" and "sgd-fused" make it `torch.optim.SGD(lr=1e-3, momentum=0.9)` instead (the
manual O2 peers then use SGD with their own implementation). Each setup returns a Trainer;
`Trainer.close()` undoes amp's initialize.
"""

import torch

import amp

VARIANTS = (
    "fp32",
    "torch.autocast",
    "amp O1",
    "amp.autocast",
    "amp O2",
    "amp O3",
    "manual O2 fused",
    "manual O2 foreach",
)
REFERENCE = "torch.autocast"


class Trainer:
    """`step(inputs, targets)` runs one training step and returns the loss (detached);
    `loss_scale()` the current loss scale (None without one); `zero_grad()` drops the gradients
    as the next step would (what is left is what the variant holds between steps)."""

    def __init__(self, model, step, close=lambda: None, loss_scale=lambda: None, zero_grad=None):
        self.model, self._step, self._close, self.loss_scale = model, step, close, loss_scale
        self.zero_grad = zero_grad or (lambda: model.zero_grad(set_to_none=True))

    def step(self, inputs, targets):
        return self._step(inputs, targets)

    def close(self):
        self._close()


_IMPLEMENTATIONS = {"default": {}, "foreach": {"foreach": True}, "fused": {"fused": True}}
OPTIMIZERS = ("default", "foreach", "fused", "sgd", "sgd-foreach", "sgd-fused")


def _adamw(params, optimizer, implementation=None):
    """The optimizer `optimizer` names (OPTIMIZERS); `implementation` overrides its own."""
    family, _, own = optimizer.partition("-")
    if family != "sgd":
        family, own = "adamw", optimizer
    options = _IMPLEMENTATIONS[implementation or own or "default"]
    if family == "sgd":
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9, **options)
    return torch.optim.AdamW(params, lr=1e-3, **options)


def _fp32(model, loss_fn, dtype, optimizer):
    opt = _adamw(model.parameters(), optimizer)

    def step(inputs, targets):
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        opt.step()
        return loss.detach()

    return Trainer(model, step, zero_grad=lambda: opt.zero_grad(set_to_none=True))


def _torch_autocast(model, loss_fn, dtype, optimizer):
    opt = _adamw(model.parameters(), optimizer)
    device = next(model.parameters()).device.type
    scaler = torch.amp.GradScaler(device)

    def step(inputs, targets):
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device, dtype=dtype):
            loss = loss_fn(model(inputs), targets)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        return loss.detach()

    return Trainer(
        model, step, loss_scale=scaler.get_scale, zero_grad=lambda: opt.zero_grad(set_to_none=True)
    )


def _amp_autocast(model, loss_fn, dtype, optimizer):
    opt = _adamw(model.parameters(), optimizer)
    scaler = amp.GradScaler()

    def step(inputs, targets):
        opt.zero_grad(set_to_none=True)
        with amp.autocast(dtype=dtype):
            loss = loss_fn(model(inputs), targets)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        return loss.detach()

    # amp.autocast installs amp's patches, which stay after the region: undo them.
    return Trainer(
        model, step, amp.deinitialize, scaler.get_scale, lambda: opt.zero_grad(set_to_none=True)
    )


def _amp_level(opt_level, float8=None, **options):
    def setup(model, loss_fn, dtype, optimizer):
        model, opt = amp.initialize(
            model,
            _adamw(model.parameters(), optimizer),
            opt_level=opt_level,
            dtype=dtype,
            verbosity=0,
            float8=float8,
            **options,
        )

        def step(inputs, targets):
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(inputs), targets)
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
            opt.step()
            return loss.detach()

        def loss_scale():
            return amp.state_dict()["loss_scaler0"]["loss_scale"]

        return Trainer(
            model, step, amp.deinitialize, loss_scale, lambda: opt.zero_grad(set_to_none=True)
        )

    return setup


def _cast_but_batch_norm(model, dtype):
    # Through `.data` and the buffer dict, as amp casts: FakeTensors (device_work.py) cannot be
    # swapped the way Module._apply would.
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
                continue
            for param in module.parameters(recurse=False):
                if param.dtype is torch.float32:
                    param.data = param.data.to(dtype)
            for name, buffer in module.named_buffers(recurse=False):
                if buffer.dtype is torch.float32:
                    module._buffers[name] = buffer.to(dtype)


def torchao_float8(model, recipe="tensorwise"):
    """`model` with its nn.Linear layers swapped for torchao's Float8Linear (in place), where
    their dimensions are multiples of 16 (amp's rule; torchao's own filter also skips small
    layers). Needs torchao; amp never imports it."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    def fits(module, name):
        return all(size % 16 == 0 for size in module.weight.shape)

    config = Float8LinearConfig.from_recipe_name(recipe)
    return convert_to_float8_training(model, module_filter_fn=fits, config=config)


def _manual_o2(kind, float8=None):
    def setup(model, loss_fn, dtype, optimizer):
        if float8 is not None:
            model = torchao_float8(model, float8)
        params = list(model.parameters())
        masters = [p.detach().clone() for p in params]
        master_grads = [torch.zeros_like(m) for m in masters]
        for master, grad in zip(masters, master_grads):
            master.grad = grad
        _cast_but_batch_norm(model, dtype)
        opt = _adamw(masters, optimizer, implementation=kind)
        scaler = torch.amp.GradScaler(params[0].device.type)

        def step(inputs, targets):
            if inputs.is_floating_point():
                inputs = inputs.to(dtype)
            loss = loss_fn(model(inputs), targets)
            scaler.scale(loss).backward()
            torch._foreach_copy_(master_grads, [p.grad for p in params])
            for param in params:  # no call per parameter, unlike model.zero_grad()
                param.grad = None
            scaler.step(opt)
            scaler.update()
            with torch.no_grad():
                torch._foreach_copy_(params, masters)
            return loss.detach()

        return Trainer(model, step, loss_scale=scaler.get_scale)

    return setup


SETUPS = {
    "fp32": _fp32,
    "torch.autocast": _torch_autocast,
    "amp O1": _amp_level("O1"),
    "amp.autocast": _amp_autocast,
    "amp O2": _amp_level("O2"),
    "amp O3": _amp_level("O3"),
    "manual O2 fused": _manual_o2("fused"),
    "manual O2 foreach": _manual_o2("foreach"),
    # Not in VARIANTS (FP8 matmuls need a GPU of compute capability 8.9+ to pay): counted in
    # step_costs' device-work table, timed by benchmarks/float8_layers.py on a GPU.
    "amp O2 + float8": _amp_level("O2", float8="tensorwise"),
    "amp O2 + float8 rowwise": _amp_level("O2", float8="rowwise"),
    # The peer: manual O2 (foreach AdamW) with torchao's Float8Linear swapped in.
    "torchao float8": _manual_o2("foreach", float8="tensorwise"),
    # Compact state (bfloat16 only): benchmarks/compact_state.py
    "amp O2 compact": _amp_level("O2", master_weights="compact"),
    "amp O2 compact int8": _amp_level("O2", master_weights="compact", optimizer_state="int8"),
    "amp O2 bf16 no masters": _amp_level("O2", master_weights=False),
}


def setup(name, model, loss_fn, dtype, optimizer="default"):
    """Set `model` (FP32, on its device, not shared with any other variant) up for variant `name`;
    `loss_fn(output, targets)` gives the loss. Returns a Trainer."""
    return SETUPS[name](model, loss_fn, dtype, optimizer)

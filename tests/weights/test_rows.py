"""Rows (amp/weights/rows.py): reading a row never writes. A step hook, a state dict taken in
another thread or amp.master_params leave every bit of the run as it was: the model's weights,
the masters' rests, the moments and step counts (exact masters and compact ones alike)."""

import threading

import pytest
import torch

import amp
from helpers.models import loss_of, make_model

pytestmark = pytest.mark.usefixtures("deinitialized")

FORMS = {"exact": {}, "compact-int8": dict(master_weights="compact", optimizer_state="int8")}
WIDTH = 16


def _trained(form, steps, during_step=None, lr=1e-3):
    """An O2 bf16 model and its AdamW after `steps` steps; `during_step(model, optimizer)` runs in
    a step post-hook of the optimizer's. Returns (model, optimizer, their raw tensors)."""
    model = make_model(inputs=WIDTH, hidden=4 * WIDTH, outputs=WIDTH, batch_norm=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model, optimizer = amp.initialize(
        model, optimizer, opt_level="O2", dtype=torch.bfloat16, verbosity=0, **FORMS[form]
    )
    if during_step is not None:
        optimizer.register_step_post_hook(lambda *_: during_step(model, optimizer))
    for step in range(steps):
        optimizer.zero_grad()
        with amp.scale_loss(loss_of(model, step, inputs=WIDTH, outputs=WIDTH), optimizer) as scaled:
            scaled.backward()
        optimizer.step()
    return model, optimizer, _raw(model, optimizer)


def _raw(model, optimizer):
    """Every tensor of the run as amp holds it (no state dict: its reads are what is tested)."""
    tensors = [p.detach().clone() for p in model.parameters()]
    tensors += [b.clone() for b in model.buffers()]
    for param in model.parameters():
        for key, value in sorted(optimizer.state[param].items()):
            tensors.append((key, value.clone()))
    owner = vars(optimizer)["_amp_record"].owner  # the masters' rests
    return tensors + [rest.clone() for rest in owner.rests()]


def _assert_same_bits(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        if isinstance(x, tuple):
            assert x[0] == y[0]
            x, y = x[1], y[1]
        assert x.dtype == y.dtype and torch.equal(x, y)


def _read_everything(model, optimizer):
    model.state_dict()
    optimizer.state_dict()
    for master in amp.master_params(optimizer):
        master.sum()


@pytest.mark.parametrize("form", list(FORMS))
def test_reading_the_model_optimizer_and_masters_in_a_step_post_hook_changes_no_bit(form):
    """An EMA or a logger in a step post-hook: the step's own write is amp's, not an outside one
    (compact corrections were wiped by such a reader, compact becoming bf16 without masters)."""
    *_, plain = _trained(form, steps=12)
    amp.deinitialize()
    model, optimizer, read = _trained(form, steps=12, during_step=_read_everything)
    _assert_same_bits(read, plain)
    if form == "compact-int8":  # the corrections are alive: the test can tell
        saved = optimizer.state_dict()["state"].values()
        corrections = [e["master_correction"] for e in saved if "master_correction" in e]
        assert sum(int(c.count_nonzero()) for c in corrections) > 100


@pytest.mark.parametrize("form", list(FORMS))
def test_master_params_in_another_thread_hands_out_values_and_no_gradient(form):
    """amp.master_params called by another thread between a backward and the step: the FP32
    values without gradients (handing one out makes it and notes it for the step, which is the
    training thread's), and the step is the one without the call."""
    *_, plain = _trained(form, steps=3)
    amp.deinitialize()
    handed = []

    def read(optimizer):
        handed.extend((v.dtype, v.dim(), v.grad) for v in amp.master_params(optimizer))

    def read_in_a_thread(model, optimizer):
        thread = threading.Thread(target=read, args=(optimizer,))
        thread.start()
        thread.join()

    model = make_model(inputs=WIDTH, hidden=4 * WIDTH, outputs=WIDTH, batch_norm=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = amp.initialize(
        model, optimizer, opt_level="O2", dtype=torch.bfloat16, verbosity=0, **FORMS[form]
    )
    optimizer.register_step_pre_hook(lambda *_: read_in_a_thread(model, optimizer))
    for step in range(3):
        optimizer.zero_grad()
        with amp.scale_loss(loss_of(model, step, inputs=WIDTH, outputs=WIDTH), optimizer) as scaled:
            scaled.backward()
        optimizer.step()
    cast = [grad for dtype, dim, grad in handed if dtype is torch.float32 and dim == 2]
    assert cast and all(grad is None for grad in cast)
    _assert_same_bits(_raw(model, optimizer), plain)


@pytest.mark.parametrize("form", list(FORMS))
def test_state_dicts_taken_from_another_thread_during_training_change_no_bit(form):
    """A checkpointing or metrics thread reading the model, the optimizer and amp.master_params
    (its values: the gradients are the training thread's to hand out) while the training thread
    steps (weights moved by up to 5e-3 after ~200 reads before)."""
    *_, plain = _trained(form, steps=30, lr=1e-2)
    amp.deinitialize()
    stop, reads, failures = threading.Event(), [], []
    holder = {}

    def reader():
        while not stop.is_set():
            if "model" in holder:
                try:
                    holder["model"].state_dict()
                    holder["optimizer"].state_dict()
                    list(amp.master_params(holder["optimizer"]))
                    reads.append(1)
                except Exception as error:  # noqa: BLE001 - reported below
                    failures.append(error)

    def during_step(model, optimizer):
        holder.update(model=model, optimizer=optimizer)

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    try:
        *_, read = _trained(form, steps=30, during_step=during_step, lr=1e-2)
    finally:
        stop.set()
        thread.join()
    assert not failures, failures
    assert len(reads) > 0
    _assert_same_bits(read, plain)


# -- a model that moves ---------------------------------------------------------------------------

MOVES = {**FORMS, "fp16": dict(dtype=torch.float16), "general": dict(general=True)}


def _set_up_on(device, form):
    """An O2 model on `device` and its optimizer (`general`: one amp's fused step does not
    step, so its FP32 masters are parameters of their own), after two steps."""
    options = dict(MOVES[form])
    dtype = options.pop("dtype", torch.bfloat16)
    model = make_model(inputs=WIDTH, hidden=4 * WIDTH, outputs=WIDTH, batch_norm=True).to(device)
    cls = torch.optim.RMSprop if options.pop("general", False) else torch.optim.AdamW
    optimizer = cls(model.parameters(), lr=1e-3)
    model, optimizer = amp.initialize(
        model, optimizer, opt_level="O2", dtype=dtype, verbosity=0, **options
    )
    for step in range(2):
        optimizer.zero_grad()
        x, y = (t.to(device) for t in _batch(step))
        with amp.scale_loss((model(x).float() - y).square().mean(), optimizer) as scaled:
            scaled.backward()
        optimizer.step()
    return model, optimizer


def _batch(step):
    generator = torch.Generator().manual_seed(step)
    return torch.randn(8, WIDTH, generator=generator), torch.randn(8, WIDTH, generator=generator)


@pytest.mark.parametrize("form", list(MOVES))
def test_deinitialize_after_a_conversion_that_made_new_parameters_gives_them_the_values(form):
    """Lightning's teardown moves the module before the precision plugin's teardown undoes amp
    (the order that crashed on a GPU). A conversion torch makes with new parameter objects
    (model.to("meta") here; torch's swap on conversion) leaves the model's own parameters in
    FP32 at deinitialize, on their device; a step before that names the conversion."""
    model, optimizer = _set_up_on("cpu", form)
    model.to("meta")
    optimizer.zero_grad()
    with pytest.raises(RuntimeError, match=r"no longer in the model.*model\.to\('meta'\)"):
        optimizer.step()
    amp.deinitialize()
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert {b.dtype for b in model.buffers() if b.is_floating_point()} == {torch.float32}


@pytest.mark.cuda
@pytest.mark.parametrize("form", list(MOVES))
def test_a_model_moved_between_devices_takes_its_masters_and_state_along(form):
    """model.cpu() after training on the GPU (Lightning's teardown order), then deinitialize:
    FP32 weights on the CPU equal to the masters; a step after model.cuda() back follows the
    move (masters, moments and scale on the parameters' device)."""
    model, optimizer = _set_up_on("cuda", form)
    masters = [m.detach().cpu().clone() for m in amp.master_params(optimizer)]
    model.cpu()
    for master, value in zip(masters, amp.master_params(optimizer)):  # a read: nothing moves
        assert torch.equal(value.cpu(), master)
    model.cuda()
    optimizer.zero_grad()
    x, y = (t.cuda() for t in _batch(5))
    with amp.scale_loss((model(x).float() - y).square().mean(), optimizer) as scaled:
        scaled.backward()
    optimizer.step()
    stepped = [m.detach().cpu().clone() for m in amp.master_params(optimizer)]
    assert any(not torch.equal(a, b) for a, b in zip(stepped, masters))
    model.cpu()
    amp.deinitialize()
    for param, value in zip(model.parameters(), stepped):
        assert param.device.type == "cpu" and param.dtype is torch.float32
        assert torch.equal(param.detach(), value)


@pytest.mark.parametrize("form", list(FORMS))
def test_a_layout_conversion_of_the_model_keeps_the_masters(form):
    """model.to(memory_format=torch.channels_last) gives the parameters new data of the same
    values, their versions unchanged: the remainders and corrections stay theirs (they were
    dropped, as after a write, losing the masters' low bits)."""
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Conv2d(8, 4, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = amp.initialize(
        model, optimizer, opt_level="O2", dtype=torch.bfloat16, verbosity=0, **FORMS[form]
    )
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    with amp.scale_loss(model(x).float().square().mean(), optimizer) as scaled:
        scaled.backward()
    optimizer.step()
    masters = [m.detach().clone() for m in amp.master_params(optimizer)]
    assert any(not torch.equal(m, p.float()) for m, p in zip(masters, model.parameters()))
    model.to(memory_format=torch.channels_last)
    assert model[0].weight.is_contiguous(memory_format=torch.channels_last)
    amp.deinitialize()
    for param, master in zip(model.parameters(), masters):
        assert param.dtype is torch.float32 and torch.equal(param.detach(), master)


@pytest.mark.parametrize("form", list(FORMS))
def test_a_model_converted_to_fp32_keeps_its_masters(form):
    """model.float() (an FP32 export or eval) converts the weights to the same values in FP32:
    the rests still hold, so the state dicts taken then are the masters' and the rests, and
    deinitialize gives the masters."""
    model, optimizer, _ = _trained(form, steps=2)
    masters = {k: v.clone() for k, v in model.state_dict().items()}
    rests = [rest.clone() for rest in vars(optimizer)["_amp_record"].owner.rests()]
    model.float()
    converted = model.state_dict()
    assert all(torch.equal(converted[k], v) for k, v in masters.items())
    key = "master_remainder" if form == "exact" else "master_correction"
    saved = [e[key] for _, e in sorted(optimizer.state_dict()["state"].items()) if key in e]
    assert len(saved) == len(rests) and all(map(torch.equal, saved, rests))
    amp.deinitialize()
    assert all(torch.equal(p, masters[k]) for k, p in model.state_dict().items())

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
        corrections = [entry["master_correction"] for entry in saved if "master_correction" in entry]
        assert sum(int(c.count_nonzero()) for c in corrections) > 100


@pytest.mark.parametrize("form", list(FORMS))
def test_state_dicts_taken_from_another_thread_during_training_change_no_bit(form):
    """A checkpointing or metrics thread reading the model and the optimizer while the training
    thread steps (weights moved by up to 5e-3 after ~200 reads before)."""
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

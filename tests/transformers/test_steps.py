"""The optimizer step under AmpTrainer (amp/transformers/steps.py): gradient accumulation,
max_grad_norm and a skipped step give the weights of a hand-written amp loop, bit for bit."""

import math
import os
import sys

import pytest
import torch

pytest.importorskip("transformers", minversion="5")  # the `transformers` extra (make test)

sys.path.insert(0, os.path.dirname(__file__))

from hf_helpers import (  # noqa: E402
    InfGradient,
    fp32_weights,
    make_data,
    make_model,
    train_logs,
    training_args,
)
from transformers import Trainer  # noqa: E402

import amp  # noqa: E402
from amp.transformers import AmpTrainer  # noqa: E402
from amp.transformers.steps import scaled_backward  # noqa: E402

ACCUMULATE, BATCH, MAX_NORM, SKIP_AT = 2, 2, 0.05, 1
ARGS = dict(
    gradient_accumulation_steps=ACCUMULATE,
    per_device_train_batch_size=BATCH,
    max_grad_norm=MAX_NORM,
    train_sampling_strategy="sequential",
)


def hand_written_loop(output_dir, options, data):
    """amp by hand on the Trainer's optimizer and LR schedule: scale_loss with delay_unscale
    before the last micro-batch, clip the masters, step, hold the scheduler after a skip."""
    model = make_model()
    plain = Trainer(model=model, args=training_args(output_dir, **ARGS))  # FP32, not trained
    steps = len(data) // (ACCUMULATE * BATCH)
    optimizer = plain.create_optimizer()
    scheduler = plain.create_scheduler(steps, optimizer)
    armed = [False]
    model.transformer.wte.weight.register_hook(lambda g: g * math.inf if armed[0] else g)
    model, optimizer = amp.initialize(model, optimizer, **options)
    model.train()
    losses = []
    try:
        for step in range(steps):
            rows = [data[(step * ACCUMULATE + i) * BATCH :][:BATCH] for i in range(ACCUMULATE)]
            batches = [{k: torch.stack([r[k] for r in row]) for k in row[0]} for row in rows]
            items = sum(b["labels"][..., 1:].ne(-100).sum() for b in batches) / 1
            total = 0.0
            for i, batch in enumerate(batches):
                armed[0] = step == SKIP_AT and i == 0
                loss = model(**batch, num_items_in_batch=items).loss
                with amp.scale_loss(loss, optimizer, delay_unscale=i < ACCUMULATE - 1) as scaled:
                    scaled.backward()
                total += loss.item()
            losses.append(total)
            torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), MAX_NORM)
            before = amp.last_overflow()
            optimizer.step()
            if amp.last_overflow() is before:
                scheduler.step()
            optimizer.zero_grad()
        return dict(
            weights=fp32_weights(model),
            losses=losses,
            amp=amp.state_dict(),
            scheduler_steps=scheduler.last_epoch,
        )
    finally:
        amp.deinitialize()


@pytest.mark.parametrize(
    "opt_level,dtype", [("O2", torch.bfloat16), ("O1", torch.float16)], ids=["O2-bf16", "O1-fp16"]
)
def test_accumulation_clipping_and_a_skip_match_a_hand_written_amp_loop(tmp_path, opt_level, dtype):
    options = {"opt_level": opt_level, "dtype": dtype, "verbosity": 0}
    data = make_data()
    model = make_model()
    trainer = AmpTrainer(
        model=model,
        args=training_args(tmp_path, **ARGS),
        train_dataset=data,
        amp_options=options,
        callbacks=[InfGradient(model.transformer.wte.weight, at={SKIP_AT})],
    )
    try:
        trainer.train()
        run = dict(
            weights=fp32_weights(model),
            logs=train_logs(trainer),
            amp=amp.state_dict(),
            scheduler_steps=trainer.lr_scheduler.last_epoch,
        )
    finally:
        trainer.deinitialize()
    expected = hand_written_loop(tmp_path, options, data)
    for name, value in expected["weights"].items():
        assert torch.equal(run["weights"][name], value), name
    assert [entry["loss"] for entry in run["logs"]] == pytest.approx(expected["losses"], rel=1e-6)
    assert run["amp"] == expected["amp"]
    # The skipped step is in the logs, and the scheduler was held on it (4 steps, 3 taken).
    skipped = [entry["step"] for entry in run["logs"] if entry["amp/skipped"]]
    assert skipped == [SKIP_AT + 1]  # the Trainer logs a step by its number after it
    assert run["scheduler_steps"] == expected["scheduler_steps"] == 3
    rates = [entry["learning_rate"] for entry in run["logs"]]
    assert rates[SKIP_AT] == rates[SKIP_AT + 1]
    scales = [entry["amp/loss_scale"] for entry in run["logs"]]
    assert scales == [2.0**16, 2.0**15, 2.0**15, 2.0**15]
    assert not math.isfinite(run["logs"][SKIP_AT]["grad_norm"])
    assert all(math.isfinite(entry["grad_norm"]) for i, entry in enumerate(run["logs"]) if i != 1)


class _Accelerator:
    sync_gradients = True

    def backward(self, loss, **kwargs):
        raise KeyError("the backward failed")


def test_scaled_backward_gives_the_accelerator_its_method_back_when_backward_raises():
    accelerator = _Accelerator()
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O1", verbosity=0)
    try:
        with pytest.raises(KeyError, match="the backward failed"):
            with scaled_backward(accelerator, optimizer):
                assert "backward" in vars(accelerator)
                accelerator.backward(model(torch.ones(1, 2)).sum())
        assert "backward" not in vars(accelerator)
    finally:
        amp.deinitialize()


@pytest.mark.parametrize("optim,held", [("adamw_torch", True), ("adamw_torch_fused", False)])
def test_what_the_trainers_own_grad_scaler_does_with_the_scheduler_after_a_skip(
    tmp_path, optim, held
):
    """The rule AmpTrainer follows, seen on the Trainer's own path. Accelerate refuses fp16 on the
    CPU, so its GradScaler is put in by hand (FP32 compute). The Trainer holds the scheduler after
    a skipped step (`if not self.accelerator.optimizer_step_was_skipped`), but with a fused AdamW
    (the default optim) torch's GradScaler lets the kernel skip inside step(), Accelerate sees the
    step called, and the scheduler advances. AmpTrainer holds it with every optimizer."""
    model = make_model()
    trainer = Trainer(
        model=model,
        args=training_args(tmp_path, num_train_epochs=2, optim=optim),
        train_dataset=make_data(),
        callbacks=[InfGradient(model.transformer.wte.weight, at={2})],
    )
    trainer.accelerator.scaler = torch.amp.GradScaler("cpu")
    trainer.train()
    assert trainer.accelerator.scaler.get_scale() == 2.0**15  # the skip happened
    assert trainer.lr_scheduler.last_epoch == (7 if held else 8)

"""AmpTrainer (amp/transformers/trainer.py): a GPT-2 made from a config trains at O2 bf16 with
bf16 weights and FP32 masters, skips an overflow at O1 fp16 with the skip in its logs, evaluates
and predicts in the level's precision with FP32 logits, and sets amp up once per process."""

import gc
import math
import os
import sys
import weakref

import pytest
import torch

pytest.importorskip("transformers", minversion="5")  # the `transformers` extra (make test)

sys.path.insert(0, os.path.dirname(__file__))

from hf_helpers import (  # noqa: E402
    InfGradient,
    StepDtypes,
    assert_same,
    fp32_weights,
    make_data,
    make_model,
    train_logs,
    training_args,
)

from transformers import TrainerCallback  # noqa: E402

import amp  # noqa: E402
from amp.transformers import AmpTrainer  # noqa: E402


def _logits(prediction):
    predictions = prediction.predictions
    return predictions[0] if isinstance(predictions, tuple) else predictions


def test_o2_bf16_trains_bf16_weights_through_fp32_masters_and_predicts_fp32_logits(tmp_path):
    dtypes = StepDtypes()
    model = make_model()
    trainer = AmpTrainer(
        model=model,
        args=training_args(tmp_path, num_train_epochs=3, eval_strategy="epoch"),
        train_dataset=make_data(),
        eval_dataset=make_data()[:4],  # random tokens: only what it trained on can improve
        callbacks=[dtypes],
        amp_options={"opt_level": "O2", "dtype": torch.bfloat16, "verbosity": 0},
    )
    try:
        trainer.train()
        logs = train_logs(trainer)
        evaluations = [e["eval_loss"] for e in trainer.state.log_history if "eval_loss" in e]
        assert len(evaluations) == 3 and evaluations[-1] < evaluations[0]  # at O2, in training
        assert dtypes.seen == {(torch.bfloat16, torch.float32)}  # bf16 model, FP32 masters
        assert len(logs) == 12 and logs[-1]["loss"] < logs[0]["loss"] - 0.1
        assert {entry["amp/loss_scale"] for entry in logs} == {2.0**16}
        assert {entry["amp/skipped"] for entry in logs} == {0} and trainer.skipped_steps == 0
        assert trainer.lr_scheduler.last_epoch == 12  # no skip: the scheduler stepped every time
        prediction = trainer.predict(make_data(rows=4, seed=7))
        assert _logits(prediction).dtype == "float32"  # numpy, as the Trainer returns it
        assert math.isfinite(prediction.metrics["test_loss"])
        assert model.transformer.wte.weight.dtype is torch.bfloat16  # amp stays set up
        masters = fp32_weights(model)
    finally:
        trainer.deinitialize()
    assert model.transformer.wte.weight.dtype is torch.float32
    assert_same(fp32_weights(model), masters)  # the FP32 weights back, from the masters


def test_o1_fp16_skips_an_overflow_says_so_in_the_logs_and_holds_the_scheduler(tmp_path, caplog):
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3)  # passed in: amp sets it up
    trainer = AmpTrainer(
        model=model,
        args=training_args(tmp_path, num_train_epochs=2, max_grad_norm=0.0),
        train_dataset=make_data(),
        optimizers=(optimizer, None),
        callbacks=[InfGradient(model.transformer.wte.weight, at={2})],
        amp_options={"opt_level": "O1", "dtype": torch.float16},
    )
    try:
        with caplog.at_level("INFO", logger="amp"):
            trainer.train()
        logs = train_logs(trainer)
        assert trainer.optimizer.optimizer is optimizer
        assert [entry["amp/skipped"] for entry in logs] == [0, 0, 1, 0, 0, 0, 0, 0]
        assert [entry["amp/loss_scale"] for entry in logs] == [2.0**16] * 2 + [2.0**15] * 6
        # Not clipped (max_grad_norm=0): the logged norm is still that of what the step uses.
        norms = [entry["grad_norm"] for entry in logs]
        assert not math.isfinite(norms[2]) and all(0 < n < math.inf for n in norms[:2] + norms[3:])
        assert logs[2]["learning_rate"] == logs[3]["learning_rate"]  # held on the skipped step
        assert trainer.lr_scheduler.last_epoch == 7 and trainer.skipped_steps == 1
        assert (
            "Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to 32768.0"
            in (caplog.text)
        )
        assert amp.last_overflow().params == ("transformer.wte.weight",)
        assert model.transformer.wte.weight.dtype is torch.float32  # O1: FP32 weights
        assert _logits(trainer.predict(make_data(rows=4, seed=7))).dtype == "float32"
    finally:
        trainer.deinitialize()


def test_evaluate_before_train_runs_at_the_level_and_training_starts_from_the_fp32_weights(
    tmp_path,
):
    options = {"opt_level": "O3", "dtype": torch.bfloat16, "verbosity": 0}
    held_out = make_data(rows=4, seed=7)

    def run(evaluate_first):
        model = make_model()
        trainer = AmpTrainer(
            model=model,
            args=training_args(tmp_path),
            train_dataset=make_data(),
            eval_dataset=held_out,
            amp_options=options,
        )
        try:
            if evaluate_first:
                metrics = trainer.evaluate()
                assert math.isfinite(metrics["eval_loss"])
                assert model.transformer.wte.weight.dtype is torch.bfloat16
            trainer.train()
            return fp32_weights(model), train_logs(trainer)
        finally:
            trainer.deinitialize()

    (weights, logs), (expected_weights, expected_logs) = run(True), run(False)
    assert_same(weights, expected_weights)
    assert [e["loss"] for e in logs] == [e["loss"] for e in expected_logs]


def _trainer(tmp_path, model, **options):
    return AmpTrainer(
        model=model,
        args=training_args(tmp_path, max_steps=1),
        train_dataset=make_data(),
        eval_dataset=make_data(rows=4, seed=7),
        amp_options={"opt_level": "O2", "dtype": torch.bfloat16, **options},
    )


def test_a_second_trainer_takes_amp_over_from_one_that_finished(tmp_path, caplog):
    """A notebook's second run: the first trainer keeps amp after train(); the second's train()
    deinitializes it (its model exactly the masters' FP32 values) and says so in amp's log."""
    first_model, second_model = make_model(), make_model(seed=1)
    first, second = _trainer(tmp_path, first_model), _trainer(tmp_path, second_model)
    third = _trainer(tmp_path, first_model, verbosity=0)  # a re-run cell: the first's model
    try:
        first.train()
        masters = fp32_weights(first_model)
        with caplog.at_level("INFO", logger="amp"):
            second.train()
        assert "amp was held by another AmpTrainer, not training; deinitialized it" in caplog.text
        assert first_model.transformer.wte.weight.dtype is torch.float32
        assert_same(fp32_weights(first_model), masters)  # back in FP32, bit for bit
        assert second_model.transformer.wte.weight.dtype is torch.bfloat16
        # and on: the third takes amp from the second, for evaluation alone
        second_masters = fp32_weights(second_model)
        assert math.isfinite(third.evaluate()["eval_loss"])
        assert_same(fp32_weights(second_model), second_masters)
        assert first_model.transformer.wte.weight.dtype is torch.bfloat16
    finally:
        for trainer in (first, second, third):
            trainer.deinitialize()


def test_a_trainer_that_is_gone_leaves_amp_to_the_next(tmp_path):
    model = make_model()
    first = _trainer(tmp_path, model, verbosity=0)
    first.train()
    masters = fp32_weights(model)
    gone = weakref.ref(first)
    del first
    gc.collect()
    assert gone() is None
    second = _trainer(tmp_path, make_model(seed=1), verbosity=0)
    try:
        second.train()
        assert_same(fp32_weights(model), masters)
        assert model.transformer.wte.weight.dtype is torch.float32
    finally:
        second.deinitialize()


class _StartsAnother(TrainerCallback):
    """At the first step's end, starts `other`: amp is held by a trainer that is training."""

    def __init__(self, other):
        self.other, self.refused = other, None

    def on_step_end(self, args, state, control, **kwargs):
        try:
            self.other.evaluate()
        except RuntimeError as error:
            self.refused = error


def test_amp_is_not_taken_from_a_trainer_while_it_trains(tmp_path):
    second = _trainer(tmp_path, make_model(seed=1), verbosity=0)
    starts = _StartsAnother(second)
    first = _trainer(tmp_path, make_model(), verbosity=0)
    first.add_callback(starts)
    try:
        first.train()
        assert "holds amp and is training" in str(starts.refused)
        assert first.model.transformer.wte.weight.dtype is torch.bfloat16  # still first's
        second.train()  # once first.train() has returned
    finally:
        first.deinitialize()
        second.deinitialize()


def test_amp_set_up_by_hand_is_not_taken_over(tmp_path):
    trainer = _trainer(tmp_path, make_model(), verbosity=0)
    other = make_model(seed=1)
    amp.initialize(other, opt_level="O1", verbosity=0)
    try:
        with pytest.raises(RuntimeError, match=r"by amp\.initialize.*amp\.deinitialize\(\) first"):
            trainer.train()
    finally:
        amp.deinitialize()
    trainer.train()
    trainer.deinitialize()


def test_model_init_gives_each_train_a_new_model_set_up_anew(tmp_path):
    trainer = AmpTrainer(
        model_init=lambda: make_model(),
        args=training_args(tmp_path, max_steps=2),
        train_dataset=make_data(),
        amp_options={"opt_level": "O2", "verbosity": 0},
    )
    try:
        first = [e["loss"] for e in (trainer.train(), train_logs(trainer))[1]]
        model = trainer.model
        second = [e["loss"] for e in (trainer.train(), train_logs(trainer))[1]]
        assert trainer.model is not model and model.transformer.wte.weight.dtype is torch.float32
        assert first == second and trainer.model.transformer.wte.weight.dtype is torch.bfloat16
    finally:
        trainer.deinitialize()

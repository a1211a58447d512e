"""AmpTrainer (amp/transformers/trainer.py): a GPT-2 made from a config trains at O2 bf16 with
bf16 weights and FP32 masters, skips an overflow at O1 fp16 with the skip in its logs, evaluates
and predicts in the level's precision with FP32 logits, and sets amp up once per process."""

import math
import os
import sys

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


def test_one_trainer_at_a_time_in_a_process(tmp_path):
    first = AmpTrainer(
        model=make_model(),
        args=training_args(tmp_path, max_steps=1),
        train_dataset=make_data(),
        amp_options={"verbosity": 0},
    )
    second = AmpTrainer(
        model=make_model(),
        args=training_args(tmp_path, max_steps=1),
        train_dataset=make_data(),
        amp_options={"verbosity": 0},
    )
    try:
        first.train()
        with pytest.raises(RuntimeError, match=r"already initialized.*deinitialize\(\)"):
            second.train()
    finally:
        first.deinitialize()
        second.deinitialize()
    second.train()  # once the first is undone
    second.deinitialize()


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

"""AmpTrainer's checkpoints (amp/transformers/checkpoints.py): amp's state rides in them and a
resumed run ends bit-identical to an uninterrupted one; save_model writes FP32 safetensors with a
float32 config, which from_pretrained loads."""

import json
import os
import sys

import pytest
import torch

pytest.importorskip("transformers", minversion="5")  # the `transformers` extra (make test)

sys.path.insert(0, os.path.dirname(__file__))

from hf_helpers import (  # noqa: E402
    InfGradient,
    assert_same,
    fp32_weights,
    make_data,
    make_model,
    train_logs,
    training_args,
)
from safetensors.torch import load_file  # noqa: E402
from transformers import GPT2LMHeadModel  # noqa: E402

import amp  # noqa: E402
from amp.transformers import AmpTrainer  # noqa: E402
from amp.transformers.checkpoints import AMP_STATE_NAME, load_amp_state  # noqa: E402
from helpers.state import saved_masters  # noqa: E402

OPTIONS = {"opt_level": "O2", "dtype": torch.bfloat16, "verbosity": 0}


COMPACT = {**OPTIONS, "master_weights": "compact", "optimizer_state": "int8"}


def _run(output_dir, seed, resume=None, save_strategy="no", overflow_at=(), options=OPTIONS):
    model = make_model(seed)
    trainer = AmpTrainer(
        model=model,
        args=training_args(output_dir, num_train_epochs=3, save_strategy=save_strategy),
        train_dataset=make_data(),
        callbacks=[InfGradient(model.transformer.wte.weight, at=overflow_at)],
        amp_options=options,
    )
    try:
        trainer.train(resume_from_checkpoint=resume)
        return dict(
            weights=fp32_weights(model),
            optimizer=trainer.optimizer.state_dict(),
            amp=amp.state_dict(),
            skipped=trainer.skipped_steps,
            losses={entry["step"]: entry["loss"] for entry in train_logs(trainer)},
            scheduler=trainer.lr_scheduler.state_dict(),
        )
    finally:
        trainer.deinitialize()


def _same(a, b):
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a, b)
    return a == b


@pytest.mark.parametrize("options", [OPTIONS, COMPACT], ids=["fp32-masters", "compact-int8"])
def test_resume_after_epoch_one_ends_bit_identical_to_the_uninterrupted_run(tmp_path, options):
    # An overflow at step 2 halves the loss scale before the checkpoint of epoch 1 (step 4): the
    # resumed run must continue from 32768, with one skipped step counted. Compact state rides in
    # the same files (the corrections as master_correction, the moments as codes and scales).
    straight = _run(
        tmp_path / "straight", seed=0, save_strategy="epoch", overflow_at={1}, options=options
    )
    checkpoint = tmp_path / "straight" / "checkpoint-4"
    saved = torch.load(checkpoint / AMP_STATE_NAME, weights_only=True)
    assert saved == {
        "amp": {"loss_scaler0": {"loss_scale": 2.0**15, "unskipped": 2, "dynamic": True}},
        "skipped_steps": 1,
    }
    optimizer = torch.load(checkpoint / "optimizer.pt", weights_only=True)
    assert saved_masters(optimizer)
    if options is COMPACT:
        # codes where a weight's rows are whole blocks of 32, FP32 moments elsewhere (norms, biases)
        held = [s.get("exp_avg_sq_codes", s.get("exp_avg_sq")) for s in optimizer["state"].values()]
        assert {t.dtype for t in held} == {torch.uint8, torch.float32}
    assert {v.dtype for v in load_file(checkpoint / "model.safetensors").values()} == {
        torch.float32
    }
    # Other initial weights: everything must come from the checkpoint.
    resumed = _run(tmp_path / "resumed", seed=123, resume=str(checkpoint), options=options)
    assert_same(resumed["weights"], straight["weights"])
    assert _same(resumed["optimizer"], straight["optimizer"])
    assert resumed["amp"] == straight["amp"] and resumed["skipped"] == straight["skipped"] == 1
    assert resumed["scheduler"] == straight["scheduler"]
    # The resumed log starts with the checkpoint's (steps 1-4); steps 5-12 were run again.
    assert resumed["losses"] == straight["losses"] and len(straight["losses"]) == 12


def test_save_model_writes_fp32_safetensors_and_a_float32_config_that_from_pretrained_loads(
    tmp_path,
):
    model = make_model()
    trainer = AmpTrainer(
        model=model,
        args=training_args(tmp_path, max_steps=2),
        train_dataset=make_data(),
        amp_options=OPTIONS,
    )
    try:
        trainer.train()
        trainer.save_model(str(tmp_path / "saved"))
        masters = fp32_weights(model)
        assert model.transformer.wte.weight.dtype is torch.bfloat16
    finally:
        trainer.deinitialize()
    saved = load_file(tmp_path / "saved" / "model.safetensors")
    assert {value.dtype for value in saved.values()} == {torch.float32}
    for name, value in saved.items():  # the masters' values (lm_head is tied to wte: not saved)
        assert torch.equal(value, masters[name]), name
    with open(tmp_path / "saved" / "config.json") as handle:
        assert json.load(handle)["dtype"] == "float32"
    loaded = GPT2LMHeadModel.from_pretrained(tmp_path / "saved")
    assert loaded.dtype is torch.float32
    assert_same(fp32_weights(loaded), masters)


def test_a_checkpoint_without_amp_state_warns_that_the_loss_scale_starts_again(tmp_path):
    with pytest.warns(UserWarning, match=f"has no {AMP_STATE_NAME}.*starts again"):
        assert load_amp_state(str(tmp_path)) is None
    torch.save({"loss_scale": 1.0}, tmp_path / AMP_STATE_NAME)
    with pytest.raises(
        ValueError, match=r"holds dict \['loss_scale'\]; expected a dict with 'amp'"
    ):
        load_amp_state(str(tmp_path))

"""What AmpTrainer refuses (amp/transformers/refusals.py): the Trainer's own mixed precision,
DeepSpeed and FSDP, each with a message that says what to do instead."""

import os
import sys

import pytest

pytest.importorskip("transformers", minversion="5")  # the `transformers` extra (make test)

sys.path.insert(0, os.path.dirname(__file__))

from hf_helpers import make_data, make_model, training_args  # noqa: E402

from amp.transformers import AmpTrainer  # noqa: E402


@pytest.mark.parametrize("flag", ["bf16", "fp16", "bf16_full_eval", "fp16_full_eval"])
def test_the_trainers_own_mixed_precision_with_amp_options_is_refused_pick_one(tmp_path, flag):
    if flag.startswith("fp16"):
        args = training_args(tmp_path)  # Accelerate refuses fp16 on the CPU itself
        setattr(args, flag, True)
    else:
        args = training_args(tmp_path, **{flag: True})
    with pytest.raises(ValueError, match=rf"TrainingArguments\({flag}=True\).*pick one") as error:
        AmpTrainer(model=make_model(), args=args, amp_options={"opt_level": "O2"})
    assert f"leave {flag}=False and choose the precision in amp_options" in str(error.value)
    assert "transformers.Trainer" in str(error.value)


def test_deepspeed_and_fsdp_are_refused_with_their_own_mixed_precision_as_the_route(tmp_path):
    args = training_args(tmp_path)
    args.deepspeed = {"zero_optimization": {"stage": 2}}  # set after: DeepSpeed is not installed
    with pytest.raises(ValueError, match=r"deepspeed=.*engine's own mixed precision"):
        AmpTrainer(model=make_model(), args=args, train_dataset=make_data())
    args = training_args(tmp_path)
    args.fsdp = ["full_shard"]
    with pytest.raises(ValueError, match=r"fsdp=\['full_shard'\].*engine's own mixed precision"):
        AmpTrainer(model=make_model(), args=args, train_dataset=make_data())


def test_accelerates_own_mixed_precision_from_the_environment_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    with pytest.raises(ValueError, match=r"mixed_precision is 'bf16'.*it must be 'no'"):
        AmpTrainer(model=make_model(), args=training_args(tmp_path), train_dataset=make_data())

"""What the AmpTrainer tests share: a tiny GPT-2 made from a config (no download), token data,
TrainingArguments for the CPU, an inf gradient at chosen steps, and readers of a run."""

import math
import os

import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments

import amp

VOCAB, LENGTH = 64, 16


def make_model(seed=0):
    torch.manual_seed(seed)
    config = GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=2,
        vocab_size=VOCAB,
        n_positions=LENGTH,
        bos_token_id=0,
        eos_token_id=0,
        # no dropout: a run depends on the data and the steps, not on where the RNG stands
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    model = GPT2LMHeadModel(config)
    # GPT2LMHeadModel's name maps to no loss type, so the Trainer would count unshifted labels in
    # num_items_in_batch while the loss shifts them (and warn); the name the loss has fixes both.
    model.loss_type = "ForCausalLM"
    return model


def make_data(rows=16, seed=1):
    """`rows` random sequences; each is its own label (the model shifts them)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (rows, LENGTH), generator=generator)
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def training_args(output_dir, **overrides):
    options = dict(
        output_dir=str(output_dir),
        per_device_train_batch_size=4,
        num_train_epochs=1,
        learning_rate=5e-3,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        seed=42,
        dataloader_num_workers=0,
    )
    options.update(overrides)
    return TrainingArguments(**options)


class InfGradient(TrainerCallback):
    """An inf gradient in `param` during the backward of optimizer step `at` (its first
    micro-batch only, with gradient accumulation): amp sees it as it would see an overflow."""

    def __init__(self, param, at, rank=None):
        self.at, self.rank, self.armed = set(at), rank, False
        param.register_hook(lambda grad: grad * math.inf if self.armed else grad)

    def on_step_begin(self, args, state, control, **kwargs):
        rank = int(os.environ.get("RANK", "0"))
        self.armed = state.global_step in self.at and self.rank in (None, rank)

    def on_substep_end(self, args, state, control, **kwargs):
        self.armed = False


class StepDtypes(TrainerCallback):
    """The dtypes of a weight and of what the optimizer steps, seen at each step's end."""

    def __init__(self):
        self.seen = set()

    def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        stepped = next(iter(amp.master_params(optimizer.optimizer)))
        self.seen.add((model.transformer.h[0].attn.c_attn.weight.dtype, stepped.dtype))


def train_logs(trainer):
    return [entry for entry in trainer.state.log_history if "loss" in entry]


def fp32_weights(model):
    """model.state_dict(), FP32 at every level (the masters' values at O2), cloned."""
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


def assert_same(a, b):
    assert a.keys() == b.keys()
    different = [k for k in a if not (a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]))]
    assert not different, different

"""A GPT-2 trained by the Hugging Face Trainer with amp: AmpTrainer, O1-O3 in one argument.

The GPT-2 is built from a config (no download: 2 layers, width 64, characters as tokens) and
learns the Python reference text in examples/data. `AmpTrainer(..., amp_options={"opt_level":
..., "dtype": ...})` runs the Trainer's own loop under amp. Printed: the training log with amp's
keys (amp/loss_scale, amp/skipped), the dtype of the weights while training and of what the
optimizer steps; then a fresh model resumed from the checkpoint taken after epoch 1, compared
with the uninterrupted run bit for bit; save_model's files loaded back by from_pretrained; the
held-out loss and the dtype of predict's logits. `--overflow-step` puts an inf into one step's
gradients: amp skips that step and the log says so.

    python examples/transformers_finetune.py                        # O2 bfloat16, CPU
    python examples/transformers_finetune.py --opt-level O1 --dtype float16 --overflow-step 3
"""

import json
import math
import os
import sys
import tempfile

import torch

try:
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments
    from transformers.trainer_callback import PrinterCallback
except ImportError:  # pragma: no cover - the message is the point
    sys.exit(
        "This example needs Hugging Face Transformers 5: pip install 'amp[transformers]' "
        "(transformers and accelerate, after your torch)."
    )
sys.path.insert(0, os.path.dirname(__file__))
from common import device_argument, dtype_argument, opt_level_argument  # noqa: E402
from common import parser as example_parser  # noqa: E402

import amp  # noqa: E402
from amp.transformers import AmpTrainer  # noqa: E402

TEXT = os.path.join(os.path.dirname(__file__), "data", "python_reference.txt")


def load_rows(length, rows, held_out_rows, seed=0):
    """(vocabulary, training rows, held-out rows): `length` characters each, as token ids; the
    held-out rows come from the last tenth of the text."""
    with open(TEXT) as handle:
        text = handle.read()
    vocabulary = sorted(set(text))
    index = {char: i for i, char in enumerate(vocabulary)}
    data = torch.tensor([index[char] for char in text])
    split = int(0.9 * len(data))
    generator = torch.Generator().manual_seed(seed)

    def sample(part, count):
        starts = torch.randint(0, len(part) - length, (count,), generator=generator)
        return [{"input_ids": part[s : s + length], "labels": part[s : s + length]} for s in starts]

    return vocabulary, sample(data[:split], rows), sample(data[split:], held_out_rows)


def make_model(vocabulary, length, width, layers, seed=0):
    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=len(vocabulary),
        n_positions=length,
        n_embd=width,
        n_layer=layers,
        n_head=4,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = GPT2LMHeadModel(config)
    # GPT2LMHeadModel's class name maps to no loss type: the Trainer would count unshifted labels
    # for the loss's normaliser (and warn). This is the loss it computes.
    model.loss_type = "ForCausalLM"
    return model


class Watch(TrainerCallback):
    """Records the dtypes at each step's end; puts an inf into the gradients of one step."""

    def __init__(self, model, overflow_step):
        self.overflow_step, self.armed, self.dtypes = overflow_step, False, set()
        model.transformer.wte.weight.register_hook(
            lambda grad: grad * math.inf if self.armed else grad
        )

    def on_step_begin(self, args, state, control, **kwargs):
        self.armed = state.global_step == self.overflow_step

    def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        stepped = next(iter(amp.master_params(optimizer.optimizer)))
        self.dtypes.add((model.transformer.h[0].attn.c_attn.weight.dtype, stepped.dtype))


def run(args, data, output_dir, seed=0, resume=None):
    """Train (or resume) one AmpTrainer; returns it with amp still set up, and its watch."""
    vocabulary, rows, held_out = data
    model = make_model(vocabulary, args.length, args.width, args.layers, seed)
    watch = Watch(model, args.overflow_step)
    training_args = TrainingArguments(
        output_dir=output_dir,
        num_train_epochs=args.epochs,
        per_device_train_batch_size=args.batch,
        learning_rate=args.lr,
        logging_steps=1,
        save_strategy="epoch",
        report_to="none",
        use_cpu=args.device == "cpu",
        disable_tqdm=True,
        seed=0,
    )
    trainer = AmpTrainer(
        model=model,
        args=training_args,
        train_dataset=rows,
        eval_dataset=held_out,
        callbacks=[watch],
        amp_options={
            "opt_level": args.opt_level,
            "dtype": getattr(torch, args.dtype),
            "verbosity": 0,
            **compact_options(args),
        },
    )
    trainer.remove_callback(PrinterCallback)  # the table below shows the log
    trainer.train(resume_from_checkpoint=resume)
    return trainer, watch


def compact_options(args):
    """--compact: bf16 weights with 8-bit corrections for masters, AdamW's moments in 8 bits."""
    if not args.compact:
        return {}
    return {"master_weights": "compact", "optimizer_state": "int8"}


def print_log(trainer):
    keys = ("loss", "grad_norm", "learning_rate", "amp/loss_scale", "amp/skipped")
    print("  step  " + "  ".join(f"{key:>14}" for key in keys))
    for entry in trainer.state.log_history:
        if "loss" in entry:
            cells = [f"{entry[key]:>14.4g}" for key in keys]
            print(f"  {entry['step']:>4}  " + "  ".join(cells))


def fp32_weights(model):
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


def main(argv=None):
    parser = example_parser(__doc__)
    device_argument(parser)
    opt_level_argument(parser, "O2")
    dtype_argument(parser, "bfloat16")
    parser.add_argument("--epochs", type=int, default=2, help="epochs (a checkpoint after each)")
    parser.add_argument("--rows", type=int, default=64, help="training sequences per epoch")
    parser.add_argument("--batch", type=int, default=8, help="sequences per step")
    parser.add_argument("--length", type=int, default=64, help="characters per sequence")
    parser.add_argument("--width", type=int, default=64, help="the model's width")
    parser.add_argument("--layers", type=int, default=2, help="transformer layers")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW's peak learning rate")
    parser.add_argument(
        "--overflow-step", type=int, default=-1, help="step with an inf gradient (-1: none)"
    )
    parser.add_argument(
        "--compact",
        action="store_true",
        help="O2 bf16 with compact masters and 8-bit AdamW moments (master_weights='compact', "
        "optimizer_state='int8')",
    )
    args = parser.parse_args(argv)
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    data = load_rows(args.length, args.rows, held_out_rows=16)
    extra = "".join(f', "{key}": "{value}"' for key, value in compact_options(args).items())
    options = (
        f'{{"opt_level": "{args.opt_level}", "dtype": torch.{args.dtype}, "verbosity": 0{extra}}}'
    )
    steps = math.ceil(args.rows / args.batch)
    with tempfile.TemporaryDirectory() as folder:
        trainer, watch = run(args, data, os.path.join(folder, "run"))
        try:
            model = trainer.model
            params = sum(p.numel() for p in model.parameters())
            print(
                f"AmpTrainer(amp_options={options}) on {args.device}, transformers "
                f"{transformers.__version__}: GPT-2 from a config ({args.layers} layers, width "
                f"{args.width}, {params / 1e6:.2f}M parameters), {args.epochs} epochs of {steps} "
                "steps, a checkpoint after each"
            )
            print_log(trainer)
            losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
            weights, stepped = sorted(watch.dtypes)[0] if len(watch.dtypes) == 1 else (None, None)
            print(f"weights while training: {weights}; what the optimizer steps: {stepped}")
            print(
                f"loss {losses[0]:.3f} -> {losses[-1]:.3f}; steps amp skipped: "
                f"{trainer.skipped_steps}; loss scale {amp.state_dict()['loss_scaler0']}"
            )
            metrics = trainer.evaluate()
            logits = trainer.predict(data[2][:4]).predictions
            logits = logits[0] if isinstance(logits, tuple) else logits
            print(
                f"held-out loss {metrics['eval_loss']:.3f} (evaluated at {args.opt_level}); "
                f"predict's logits: {logits.dtype}"
            )
            trained = fp32_weights(model)
            saved = os.path.join(folder, "saved")
            trainer.save_model(saved)
            scale = amp.state_dict()
        finally:
            trainer.deinitialize()
        loaded = GPT2LMHeadModel.from_pretrained(saved)
        with open(os.path.join(saved, "config.json")) as handle:
            config_dtype = json.load(handle)["dtype"]
        same_loaded = all(torch.equal(v, trained[k]) for k, v in fp32_weights(loaded).items())
        print(
            f"save_model: config dtype {config_dtype}; from_pretrained gives {loaded.dtype} "
            f"weights equal to the trained ones: {same_loaded}"
        )

        checkpoint = os.path.join(folder, "run", f"checkpoint-{steps}")
        resumed, _ = run(args, data, os.path.join(folder, "resumed"), seed=1, resume=checkpoint)
        try:
            after = fp32_weights(resumed.model)
            same = after.keys() == trained.keys() and all(
                torch.equal(after[k], trained[k]) for k in trained
            )
            same_scale = amp.state_dict() == scale
        finally:
            resumed.deinitialize()
        print(
            f"resumed a fresh model from checkpoint-{steps} (after epoch 1): bit-identical to the "
            f"uninterrupted run: {same} ({len(trained)} tensors); same loss scale: {same_scale}"
        )
    return dict(
        losses=losses,
        dtypes=watch.dtypes,
        skipped=trainer.skipped_steps,
        logits=str(logits.dtype),
        config_dtype=config_dtype,
        loaded_dtype=loaded.dtype,
        loaded_equal=same_loaded,
        resumed_equal=same and same_scale,
        eval_loss=metrics["eval_loss"],
    )


if __name__ == "__main__":
    main()

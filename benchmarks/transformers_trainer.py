"""The Hugging Face Trainer's own bf16 against AmpTrainer at O1 and O2, on the same run.

    python benchmarks/transformers_trainer.py [--steps N] [--warmup N] [--tiny]

Every variant trains a fresh copy of the same GPT-2 (built from a config: 4 layers of width 128,
64 tokens, batch 8; --tiny: 2 layers of width 32, 16 tokens, batch 4) on the same data (the
Python reference text of examples/data, bytes as tokens), through `Trainer.train()`:
  Trainer fp32          transformers.Trainer, no mixed precision (for scale)
  Trainer bf16=True     transformers.Trainer(bf16=True): Accelerate's torch.autocast (the reference)
  AmpTrainer O1 bf16    AmpTrainer(amp_options={"opt_level": "O1", "dtype": torch.bfloat16})
  AmpTrainer O2 bf16    AmpTrainer(amp_options={"opt_level": "O2", "dtype": torch.bfloat16})
Columns:
  loss          the Trainer's logged loss at the last step
  calls/step    cProfile's total_calls from on_step_begin to on_step_end (forward, backward,
                clipping, the optimizer and the scheduler steps, the Trainer's bookkeeping),
                averaged over the steps after --warmup
  start MiB     bytes live when the last step begins (model, optimizer state, masters, data)
  peak MiB      their peak during the last step. CPU: torch.profiler's allocation events of the
                whole run (the model is built inside it, so their running sum is the live total;
                benchmarks/measure.py); CUDA: torch.cuda's memory_allocated counters
Ratios are to Trainer bf16=True (below 1.00: fewer calls, less memory). Calls and bytes are
counts, not times: the load of the machine does not move them. torch runs on one thread.
"""

import argparse
import cProfile
import gc
import os
import pstats
import sys
import tempfile

import torch
from torch.autograd.profiler import record_function
from torch.profiler import ProfilerActivity, profile
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_callback import PrinterCallback

sys.path.insert(0, os.path.dirname(__file__))
from harness import print_table  # noqa: E402
from measure import marked_peak  # noqa: E402

from amp.transformers import AmpTrainer  # noqa: E402

MIB = 2.0**20
TEXT = os.path.join(os.path.dirname(__file__), "..", "examples", "data", "python_reference.txt")
_MARK = "benchmarks::trainer_step"
VARIANTS = {
    "Trainer fp32": {},
    "Trainer bf16=True": {"bf16": True},
    "AmpTrainer O1 bf16": {"amp_options": {"opt_level": "O1", "dtype": torch.bfloat16}},
    "AmpTrainer O2 bf16": {"amp_options": {"opt_level": "O2", "dtype": torch.bfloat16}},
}
REFERENCE = "Trainer bf16=True"
SIZES = {
    "default": dict(layers=4, width=128, length=64, batch=8),
    "tiny": dict(layers=2, width=32, length=16, batch=4),
}


def make_model(layers, width, length):
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=256,
        n_positions=length,
        n_embd=width,
        n_layer=layers,
        n_head=4,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    model = GPT2LMHeadModel(config)
    model.loss_type = "ForCausalLM"  # the class name maps to none (the Trainer would warn)
    return model


def make_data(rows, length):
    """`rows` consecutive stretches of the Python reference text (examples/data), bytes as
    tokens."""
    with open(TEXT, "rb") as handle:
        text = torch.frombuffer(bytearray(handle.read(rows * length)), dtype=torch.uint8)
    ids = text.long().view(rows, length)
    return [{"input_ids": row, "labels": row} for row in ids]


class StepWatch(TrainerCallback):
    """cProfile on from each step's begin to its end after `warmup` steps; the last step inside a
    record_function mark for the memory profile."""

    def __init__(self, warmup, steps, profiler=None):
        self.warmup, self.steps, self.profiler = warmup, steps, profiler
        self.measured, self.mark, self.cuda = 0, None, None

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.steps - 1:
            if torch.cuda.is_available() and args.device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                self.cuda = [torch.cuda.memory_allocated()]
            self.mark = record_function(_MARK)
            self.mark.__enter__()
        if self.profiler is not None and state.global_step >= self.warmup:
            self.profiler.enable()

    def on_step_end(self, args, state, control, **kwargs):
        if self.profiler is not None and state.global_step > self.warmup:
            self.profiler.disable()
            self.measured += 1
        if self.mark is not None:
            self.mark.__exit__(None, None, None)
            self.mark = None
            if self.cuda is not None:
                torch.cuda.synchronize()
                self.cuda.append(torch.cuda.max_memory_allocated())


def train(name, size, steps, warmup, device, output_dir, profiler=None):
    """Train variant `name` for `steps` steps; returns (its last logged loss, its StepWatch)."""
    options = dict(VARIANTS[name])
    amp_options = options.pop("amp_options", None)
    watch = StepWatch(warmup, steps, profiler)
    args = TrainingArguments(
        output_dir=output_dir,
        max_steps=steps,
        per_device_train_batch_size=size["batch"],
        learning_rate=3e-3,
        logging_steps=steps,
        save_strategy="no",
        report_to="none",
        use_cpu=device == "cpu",
        disable_tqdm=True,
        seed=0,
        **options,
    )
    model = make_model(size["layers"], size["width"], size["length"])
    data = make_data(steps * size["batch"], size["length"])
    if amp_options is None:
        trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[watch])
    else:
        amp_options = {**amp_options, "verbosity": 0}
        trainer = AmpTrainer(
            model=model, args=args, train_dataset=data, callbacks=[watch], amp_options=amp_options
        )
    trainer.remove_callback(PrinterCallback)
    try:
        trainer.train()
        return [e["loss"] for e in trainer.state.log_history if "loss" in e][-1], watch
    finally:
        if isinstance(trainer, AmpTrainer):
            trainer.deinitialize()


def measure(name, size, steps, warmup, device, folder):
    """One row: the loss, calls per step and the memory of the last step of `name`."""
    profiler = cProfile.Profile()
    loss, watch = train(name, size, steps, warmup, device, folder, profiler)
    row = {"variant": name, "loss": loss}
    row["calls/step"] = pstats.Stats(profiler).total_calls / watch.measured
    gc.collect()
    if device == "cuda":
        _, watch = train(name, size, steps, warmup, device, folder)
        start, peak = watch.cuda
    else:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as memory:
            train(name, size, steps, warmup, device, folder)
        start, peak = marked_peak(memory, _MARK)
    row["start MiB"], row["peak MiB"] = start / MIB, peak / MIB
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=4, help="steps before counting calls")
    parser.add_argument("--tiny", action="store_true", help="CI sizes: a smoke run")
    default = "cuda" if torch.cuda.is_available() else "cpu"
    parser.add_argument("--device", default=default, help="cpu or cuda")
    args = parser.parse_args(argv)
    size = SIZES["tiny" if args.tiny else "default"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with tempfile.TemporaryDirectory() as folder:
            rows = [
                measure(name, size, args.steps, args.warmup, args.device, folder)
                for name in VARIANTS
            ]
    finally:
        torch.set_num_threads(threads)
    (reference,) = [row for row in rows if row["variant"] == REFERENCE]
    for row in rows:
        row["calls / bf16=True"] = row["calls/step"] / reference["calls/step"]
        row["peak / bf16=True"] = row["peak MiB"] / reference["peak MiB"]
    title = (
        f"Trainer vs AmpTrainer, GPT-2 ({size['layers']} layers, width {size['width']}, batch "
        f"{size['batch']} x {size['length']}), {args.steps} steps, {args.device}"
    )
    columns = ["variant", "loss", "calls/step", "calls / bf16=True", "start MiB", "peak MiB"]
    print_table(title, rows, columns + ["peak / bf16=True"])
    return rows


if __name__ == "__main__":
    main()

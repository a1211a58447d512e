"""One rank of the two-rank gloo test of AmpTrainer under DDP.

Run as `python trainer_ddp_rank.py OUT` with RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT set (as torchrun sets them). AmpTrainer trains the tiny GPT-2 at O2 bf16 on its half
of the data, accumulating two micro-batches per step, with an inf gradient on rank 1 only at one
step and a checkpoint after each epoch; then a fresh model resumes from the first checkpoint.
Each rank saves what it ended with to OUT/rank<r>.pt.
"""

import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))

from hf_helpers import InfGradient, fp32_weights, make_data, make_model, training_args  # noqa: E402
from transformers import default_data_collator  # noqa: E402

import amp  # noqa: E402
from amp.transformers import AmpTrainer  # noqa: E402

RANK = int(os.environ["RANK"])
OVERFLOW_STEP = 1  # optimizer steps 0-3: two per epoch on each rank


def run(out, seed, resume=None):
    model = make_model(seed)
    args = training_args(
        os.path.join(out, "run"),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        num_train_epochs=2,
        save_strategy="no" if resume else "epoch",
        ddp_backend="gloo",
    )
    rows = []  # the first token of each row this rank trained on

    def collate(features):
        rows.extend(int(f["input_ids"][0]) for f in features)
        return default_data_collator(features)

    trainer = AmpTrainer(
        model=model,
        args=args,
        train_dataset=make_data(),
        data_collator=collate,
        callbacks=[InfGradient(model.transformer.wte.weight, at={OVERFLOW_STEP}, rank=1)],
        amp_options={"opt_level": "O2", "dtype": torch.bfloat16, "verbosity": 0},
    )
    try:
        trainer.train(resume_from_checkpoint=resume)
        return dict(
            wrapper=type(trainer.model_wrapped).__name__,
            dtype=model.transformer.wte.weight.dtype,
            weights=fp32_weights(model),
            amp=dict(amp.state_dict()),
            skipped=trainer.skipped_steps,
            scheduler_steps=trainer.lr_scheduler.last_epoch,
            logs=[e for e in trainer.state.log_history if "loss" in e],
            rows=rows,
        )
    finally:
        trainer.deinitialize()


def main(out):
    start = time.perf_counter()
    straight = run(out, seed=0)
    resumed = run(out, seed=123, resume=os.path.join(out, "run", "checkpoint-2"))
    print(f"rank {RANK}: trained and resumed in {time.perf_counter() - start:.1f} s", flush=True)
    torch.save(dict(straight=straight, resumed=resumed), os.path.join(out, f"rank{RANK}.pt"))
    sys.stdout.flush()
    sys.stderr.flush()
    torch.distributed.destroy_process_group()
    os._exit(0)  # gloo aborts in C++ static destructors at a normal exit


if __name__ == "__main__":
    main(sys.argv[1])

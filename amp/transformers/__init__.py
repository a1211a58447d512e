"""amp inside Hugging Face Transformers 5: `AmpTrainer`, a Trainer that trains at O0-O3.

``from amp.transformers import AmpTrainer`` imports Transformers and Accelerate; ``import amp`` and
``import amp.transformers`` do not.

    trainer = AmpTrainer(model=model, args=args, train_dataset=data,
                         amp_options={"opt_level": "O2", "dtype": torch.bfloat16})

trainer.py holds the class; options.py reads `amp_options`; refusals.py says which Trainer
settings cannot run with amp and what to use instead; steps.py puts backward, clipping and skipped
steps under amp; checkpoints.py carries amp's state in checkpoints and writes FP32 configs;
versions.py checks the Transformers and Accelerate versions whose private methods AmpTrainer uses.
"""

from typing import Any

__all__ = ["AmpTrainer"]


def __getattr__(name: str) -> Any:
    # The class derives from transformers.Trainer, so Transformers is imported on first use.
    if name == "AmpTrainer":
        from .trainer import AmpTrainer

        globals()[name] = AmpTrainer
        return AmpTrainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

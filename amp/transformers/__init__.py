"""amp inside Hugging Face Transformers 5: `AmpTrainer`, a Trainer that trains at O0-O3.

``from amp.transformers import AmpTrainer`` imports Transformers and Accelerate; ``import amp`` and
``import amp.transformers`` do not.

    trainer = AmpTrainer(model=model, args=args, train_dataset=data,
                         amp_options={"opt_level": "O2", "dtype": torch.bfloat16})

trainer.py holds the class; options.py reads `amp_options`; refusals.py says which Trainer
settings cannot run with amp and what to use instead; steps.py puts backward, clipping and skipped
steps under amp; checkpoints.py carries amp's state in checkpoints and writes FP32 configs;
holder.py hands amp's one set-up from one AmpTrainer to the next; versions.py checks the
Transformers and Accelerate versions whose private methods AmpTrainer uses.
"""

from typing import Any

__all__ = ["AmpTrainer"]

_FRAMEWORK = ("transformers", "accelerate")  # the `transformers` extra


def __getattr__(name: str) -> Any:
    # The class derives from transformers.Trainer, so Transformers is imported on first use.
    if name == "AmpTrainer":
        try:
            from .trainer import AmpTrainer
        except ModuleNotFoundError as error:
            # Python's own message names only the first module missing (accelerate, imported
            # first), not what to install; anything else missing is not ours to explain.
            if error.name is None or error.name.split(".")[0] not in _FRAMEWORK:
                raise
            from .versions import install_hint

            raise ModuleNotFoundError(install_hint(error.name), name=error.name) from error

        globals()[name] = AmpTrainer
        return AmpTrainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

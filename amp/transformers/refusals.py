"""What AmpTrainer refuses to run with, and the route each refusal names.

Two mixed precisions on one model (the Trainer's through Accelerate, and amp's) would cast twice
and scale nothing right, so `bf16`/`fp16` are refused. DeepSpeed and FSDP bring their own mixed
precision and optimizer handling, and build or shard the optimizer where amp cannot follow (FSDP
creates it after sharding; FSDP2 swaps its parameters for DTensors; DeepSpeed builds its own), so
they are refused with the route: their own mixed precision. One process and DDP (torchrun) run.
"""

from typing import Any

__all__ = ["refuse_arguments", "refuse_set_up"]

_ENGINE_ROUTE = (
    "use that engine's own mixed precision instead (transformers.Trainer with bf16=True, or the "
    "engine's mixed-precision config); AmpTrainer runs in one process or under DDP (torchrun)."
)


def refuse_arguments(args: Any) -> None:
    """Refuse TrainingArguments that cannot run with amp, before the Trainer sets anything up.

    Raises:
        ValueError: ``bf16``, ``fp16``, ``bf16_full_eval`` or ``fp16_full_eval``; ``deepspeed``;
            ``fsdp``.
    """
    if args is None:
        return
    for flag in ("bf16", "fp16", "bf16_full_eval", "fp16_full_eval"):
        if getattr(args, flag, False):
            raise ValueError(
                f"AmpTrainer: TrainingArguments({flag}=True) turns on the Trainer's own mixed "
                "precision (Accelerate's torch.autocast and GradScaler, or a model cast for "
                "evaluation), and amp_options turns on amp's: pick one. For amp, leave "
                f"{flag}=False and choose the precision in amp_options (e.g. "
                '{"opt_level": "O2", "dtype": torch.bfloat16}); for the Trainer\'s own, use '
                "transformers.Trainer."
            )
    if getattr(args, "deepspeed", None):
        raise ValueError(
            f"AmpTrainer: TrainingArguments(deepspeed={args.deepspeed!r}): DeepSpeed builds its "
            "own optimizer and keeps its own FP32 weights and loss scale, which amp cannot set up; "
            + _ENGINE_ROUTE
        )
    if getattr(args, "fsdp", None):
        raise ValueError(
            f"AmpTrainer: TrainingArguments(fsdp={args.fsdp!r}): FSDP creates the optimizer after "
            "sharding the model and keeps its own FP32 shards, which amp's O2/O3 casts and master "
            "weights cannot follow; " + _ENGINE_ROUTE
        )


def refuse_set_up(trainer: Any) -> None:
    """Refuse what only the Trainer's set-up reveals: Accelerate's own mixed precision (from
    ACCELERATE_MIXED_PRECISION or an accelerate config), DeepSpeed or FSDP turned on through
    Accelerate, SageMaker model parallelism, a model sharded at load time, DataParallel.

    Raises:
        ValueError: one of those.
    """
    accelerator = trainer.accelerator
    if accelerator.mixed_precision != "no":
        raise ValueError(
            f"AmpTrainer: Accelerate's mixed_precision is {accelerator.mixed_precision!r} (set by "
            "ACCELERATE_MIXED_PRECISION or an accelerate config), which would run torch.autocast "
            "on top of amp: pick one. Unset it (it must be 'no') and choose the precision in "
            "amp_options, or use transformers.Trainer for Accelerate's own."
        )
    if trainer.is_deepspeed_enabled:
        raise ValueError("AmpTrainer: DeepSpeed is on through Accelerate; " + _ENGINE_ROUTE)
    if trainer.is_fsdp_enabled or trainer.is_fsdp_xla_enabled:
        raise ValueError("AmpTrainer: FSDP is on through Accelerate; " + _ENGINE_ROUTE)
    from transformers.utils import is_sagemaker_mp_enabled

    if is_sagemaker_mp_enabled():
        raise ValueError("AmpTrainer: SageMaker model parallelism is on; " + _ENGINE_ROUTE)
    if trainer.is_distributed_loading_by_transformers:
        raise ValueError(
            "AmpTrainer: the model was sharded when it was loaded (from_pretrained with a "
            "distributed config), so its parameters are DTensors that amp does not cast; load it "
            "whole and let AmpTrainer run it under DDP (torchrun), or use transformers.Trainer."
        )
    if trainer.args.n_gpu > 1:
        raise ValueError(
            f"AmpTrainer: this process sees {trainer.args.n_gpu} GPUs, so the Trainer would wrap "
            "the model in torch.nn.DataParallel, which amp does not support; launch one process "
            "per GPU with torchrun (DDP), or make one GPU visible (CUDA_VISIBLE_DEVICES)."
        )

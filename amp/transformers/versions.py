"""The Transformers and Accelerate versions AmpTrainer was checked against, and the check.

AmpTrainer overrides four private Trainer methods (no public hook does their work) and writes one
private Accelerate attribute. Their bodies were read, and the tests run, on the versions below; on
any other version AmpTrainer refuses to start unless AMP_TRANSFORMERS_UNCHECKED=1 is set.
"""

import inspect
import os
import warnings
from typing import Dict, Sequence, Tuple

__all__ = [
    "CHECKED_ACCELERATE",
    "CHECKED_TRANSFORMERS",
    "PRIVATE_METHODS",
    "UNCHECKED_VARIABLE",
    "check_versions",
    "install_hint",
]

# major.minor series; every patch release of a series is accepted.
CHECKED_TRANSFORMERS: Tuple[str, ...] = ("5.23", "5.24")
CHECKED_ACCELERATE: Tuple[str, ...] = ("1.15",)

# The private Trainer methods AmpTrainer overrides, each with the parameters it must have, and
# why no public hook serves.
PRIVATE_METHODS: Dict[str, Tuple[str, ...]] = {
    # max_grad_norm: the Trainer clips model.parameters(); at O2 the step uses the FP32 masters.
    # on_pre_optimizer_step runs after clipping, so no callback can clip instead.
    "_clip_grad_norm": ("self", "model"),
    # the logged grad_norm when max_grad_norm is 0: the masters' norm, not the model's.
    "_get_grad_norm": ("self", "model", "grad_norm"),
    # where the Trainer saves and loads its own GradScaler; on_save misses push_to_hub uploads and
    # the checkpoints the Trainer takes on SIGTERM, and no callback sees the resumed checkpoint.
    "_save_scaler": ("self", "output_dir"),
    "_load_scaler": ("self", "checkpoint"),
}
# AcceleratedOptimizer._is_overflow (read by its public step_was_skipped): set after a skipped step
# so that the Trainer holds the LR scheduler, as it does when its own GradScaler skips.

UNCHECKED_VARIABLE = "AMP_TRANSFORMERS_UNCHECKED"


def _series(version: str) -> str:
    return ".".join(version.split("+")[0].split(".")[:2])


def _listed(series: Sequence[str]) -> str:
    return ", ".join(f"{s}.x" for s in series)


def install_hint(missing: str) -> str:
    """What to install when importing AmpTrainer found `missing` (a module's name) absent."""
    return (
        f"amp.transformers.AmpTrainer needs Transformers and Accelerate, and {missing!r} is not "
        "installed: pip install 'amp[transformers]' (Transformers "
        f"{_listed(CHECKED_TRANSFORMERS)} and Accelerate {_listed(CHECKED_ACCELERATE)}; install "
        "it after torch, so that torch stays the build you chose)"
    )


def check_versions(transformers_version: str, accelerate_version: str, trainer_class: type) -> None:
    """Refuse Transformers or Accelerate versions AmpTrainer was not checked against.

    Args:
        transformers_version: ``transformers.__version__``.
        accelerate_version: ``accelerate.__version__``.
        trainer_class: the Trainer class whose private methods AmpTrainer overrides.

    Raises:
        RuntimeError: an unchecked version (a warning instead with AMP_TRANSFORMERS_UNCHECKED=1),
            or a Trainer without one of the private methods AmpTrainer overrides, as it has them.
    """
    unchecked = []
    if _series(transformers_version) not in CHECKED_TRANSFORMERS:
        unchecked.append(
            f"transformers {transformers_version} (checked: {_listed(CHECKED_TRANSFORMERS)})"
        )
    if _series(accelerate_version) not in CHECKED_ACCELERATE:
        unchecked.append(
            f"accelerate {accelerate_version} (checked: {_listed(CHECKED_ACCELERATE)})"
        )
    if unchecked:
        message = (
            f"amp.transformers.AmpTrainer was not checked against {' and '.join(unchecked)}. It "
            f"overrides the private Trainer methods {', '.join(PRIVATE_METHODS)} and sets "
            "Accelerate's AcceleratedOptimizer._is_overflow, which other versions may have "
            "changed. "
            "Install a checked version (pip install 'amp[transformers]'), or set "
            f"{UNCHECKED_VARIABLE}=1 to try this one."
        )
        if os.environ.get(UNCHECKED_VARIABLE) != "1":
            raise RuntimeError(message)
        warnings.warn(message, stacklevel=3)
    for name, parameters in PRIVATE_METHODS.items():
        method = getattr(trainer_class, name, None)
        found = tuple(inspect.signature(method).parameters) if callable(method) else None
        if found != parameters:
            have = f"{name}({', '.join(found[1:])})" if found else f"no {name}"
            wanted = f"{name}({', '.join(parameters[1:])})"
            raise RuntimeError(
                f"amp.transformers.AmpTrainer overrides Trainer.{wanted}, "
                f"but transformers {transformers_version} has {have}. Install a checked version: "
                f"transformers {_listed(CHECKED_TRANSFORMERS)}."
            )

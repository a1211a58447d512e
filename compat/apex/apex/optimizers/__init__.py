"""apex.optimizers: FusedAdam, FusedLAMB (apex's arithmetic with torch._foreach_*), FusedSGD
(torch.optim.SGD); apex's other fused optimizers are importable and refuse to be created,
naming the replacement."""

from .._not_provided import not_provided
from .fused_adam import FusedAdam
from .fused_lamb import FusedLAMB
from .fused_sgd import FusedSGD

FusedAdagrad = not_provided(
    "apex.optimizers.FusedAdagrad", "torch.optim.Adagrad(..., foreach=True)"
)
FusedNovoGrad = not_provided(
    "apex.optimizers.FusedNovoGrad", "another optimizer: torch has no NovoGrad"
)
FusedMixedPrecisionLamb = not_provided(
    "apex.optimizers.FusedMixedPrecisionLamb",
    "apex.optimizers.FusedLAMB with amp.initialize(..., opt_level='O2') (FP32 master weights)",
)

__all__ = [
    "FusedAdam",
    "FusedLAMB",
    "FusedSGD",
    "FusedAdagrad",
    "FusedNovoGrad",
    "FusedMixedPrecisionLamb",
]

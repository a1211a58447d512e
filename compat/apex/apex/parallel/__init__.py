"""apex.parallel: DistributedDataParallel, Reducer, SyncBatchNorm, convert_syncbn_model,
create_syncbn_process_group and (as apex: `from apex.parallel.LARC import LARC`) LARC."""

import torch.distributed

from . import LARC  # noqa: F401  (apex's module path: apex.parallel.LARC.LARC)
from .distributed import DistributedDataParallel, Reducer
from .sync_batchnorm import SyncBatchNorm, convert_syncbn_model, create_syncbn_process_group

ReduceOp = torch.distributed.ReduceOp

__all__ = [
    "DistributedDataParallel",
    "Reducer",
    "ReduceOp",
    "SyncBatchNorm",
    "convert_syncbn_model",
    "create_syncbn_process_group",
]

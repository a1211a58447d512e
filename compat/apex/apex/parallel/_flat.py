"""apex.parallel.distributed's flat collective helpers, on torch's: the tensors are grouped by
type, each group flattened into one buffer, the collective run on it, and the result copied back
(an all-reduce is averaged over the world, as apex's). apex's C++ flatten (`apex_C`) and torch's
`_flatten_dense_tensors`, which apex fell back to, give the same buffer."""

from collections import OrderedDict
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors


def flatten(bucket: Sequence[torch.Tensor]) -> torch.Tensor:
    """The tensors of `bucket` (one dtype and device) side by side in one 1-D tensor."""
    return _flatten_dense_tensors(bucket)


def unflatten(coalesced: torch.Tensor, bucket: Sequence[torch.Tensor]) -> tuple:
    """Views of `coalesced` shaped as the tensors of `bucket`."""
    return _unflatten_dense_tensors(coalesced, bucket)


def apply_flat_dist_call(
    bucket: Sequence[torch.Tensor], call: Callable, extra_args: Sequence | None = None
) -> None:
    """`call(flat, *extra_args)` on the bucket flattened, then the result copied into the
    bucket's tensors; after `dist.all_reduce` the sum is divided by the world size."""
    coalesced = flatten(bucket)
    call(coalesced, *(extra_args or ()))
    if call is dist.all_reduce:
        coalesced /= dist.get_world_size()
    for tensor, synced in zip(bucket, unflatten(coalesced, bucket)):
        tensor.copy_(synced)


def split_by_type(tensors: Sequence[torch.Tensor]) -> "OrderedDict[str, list[torch.Tensor]]":
    """The tensors grouped by `tensor.type()` ("torch.cuda.HalfTensor", ...), in first-seen order."""
    buckets: OrderedDict[str, list[torch.Tensor]] = OrderedDict()
    for tensor in tensors:
        buckets.setdefault(tensor.type(), []).append(tensor)
    return buckets


def flat_dist_call(
    tensors: Sequence[torch.Tensor], call: Callable, extra_args: Sequence | None = None
) -> None:
    """apply_flat_dist_call on each group of `split_by_type(tensors)` (BERT's pretraining script
    all-reduces its gradients and broadcasts its parameters this way)."""
    for bucket in split_by_type(tensors).values():
        apply_flat_dist_call(bucket, call, extra_args)

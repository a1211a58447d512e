"""The kernel functions on torch operations: the CPU path, and the CUDA path without CuPy.

Each function takes tensors of one device. Unscaling goes through
`torch._amp_foreach_non_finite_check_and_unscale_`, so this backend is torch's own arithmetic.
"""

import torch

_unscale_op = torch._amp_foreach_non_finite_check_and_unscale_


def _by_dtype(tensors):
    groups = {}
    for tensor in tensors:
        groups.setdefault(tensor.dtype, []).append(tensor)
    return groups.values()


def _unscale_one_by_one(tensors, inv_scale, found_inf):
    # For dtypes a torch build's CUDA kernel does not dispatch (bf16 in some releases): the same
    # arithmetic, fp32 multiply and round to the tensor's dtype, one tensor at a time.
    for tensor in tensors:
        found_inf.copy_(torch.maximum(found_inf, (~torch.isfinite(tensor)).any().float()))
        tensor.copy_(tensor.float() * inv_scale)


def unscale_(tensors, inv_scale, found_inf):
    """tensors *= inv_scale in place; found_inf = 1 if any element is inf or NaN."""
    if not tensors:
        return
    if tensors[0].device.type == "cpu":
        # The CPU kernel accepts a list of mixed dtypes.
        _unscale_op(tensors, found_inf, inv_scale)
        return
    for group in _by_dtype(tensors):
        try:
            _unscale_op(group, found_inf, inv_scale)
        except (RuntimeError, NotImplementedError):
            if group[0].dtype is not torch.bfloat16:
                raise
            _unscale_one_by_one(group, inv_scale, found_inf)


def unscale_to_(sources, destinations, inv_scale, found_inf):
    """destinations = sources * inv_scale (converted to the destinations' dtype)."""
    if not sources:
        return
    torch._foreach_copy_(destinations, sources)
    unscale_(destinations, inv_scale, found_inf)


def unscale_add_(sources, destinations, inv_scale, found_inf):
    """destinations += sources * inv_scale; only `sources` are checked for inf/NaN."""
    if not sources:
        return
    scaled = [
        source.to(destination.dtype, copy=True)
        for source, destination in zip(sources, destinations)
    ]
    unscale_(scaled, inv_scale, found_inf)
    torch._foreach_add_(destinations, scaled)


def copy_(sources, destinations):
    """destinations = sources, converted (round to nearest even) to the destinations' dtype."""
    if sources:
        torch._foreach_copy_(destinations, sources)


def l2_norm(tensors):
    """The L2 norm of all elements of `tensors` together, as a float32 0-dim tensor."""
    try:
        norms = torch._foreach_norm(tensors, 2.0, dtype=torch.float32)
    except TypeError:  # torch releases whose _foreach_norm has no dtype argument
        norms = [torch.linalg.vector_norm(tensor, dtype=torch.float32) for tensor in tensors]
    return torch.linalg.vector_norm(torch.stack(norms))

"""The rank agreement: every rank takes the same skip decision, on sharded gradients too.

- The overflow flag is reduced (MAX) over the default process group, one small collective per
  check, none when not distributed.
- Sharded gradients (FSDP2's DTensors, FSDP1's flat parameters) are unscaled and checked through
  their local shards, and overflow reports name the original parameters across all shards.
- O2 under FSDP2 steps DTensor parameters through their local shards (`shards`), runs amp's
  elementwise codecs shard by shard (`shardwise`: the same bits sharded or not), finds where a
  shard starts in its whole tensor (`shard_start`: the stochastic rounding's index), lays out
  an 8-bit moment's scales as their parameter's shards (`laid_out`) and swaps a DTensor
  parameter's data where `.data =` cannot (`set_data`).

What amp refuses or follows of the engines themselves lives in weights/engines.py.
"""

import functools
import itertools
import operator
import sys

import torch

__all__ = [
    "dtensor_class",
    "default_group",
    "is_distributed",
    "reduce_flag",
    "agree_on_flags",
    "local",
    "local_tensors",
    "shards",
    "shardwise",
    "shard_start",
    "laid_out",
    "set_data",
    "has_dtensors",
    "clean_name",
    "nonfinite_names",
]


def dtensor_class():
    """torch's DTensor class, or None while torch.distributed.tensor is not imported."""
    # No DTensor exists before torch.distributed.tensor is imported: look, never import.
    module = sys.modules.get("torch.distributed.tensor")
    return None if module is None else module.DTensor


_AVAILABLE = torch.distributed.is_available()  # fixed when torch was built
_C10D = torch.distributed.distributed_c10d if _AVAILABLE else None

# default_group(): torch's default process group, or None. It runs every step, so it is read in
# C (attrgetter; the property it reads is torch's), no frame of amp's: in one process that is the
# whole answer. The group is read now (one can be made or destroyed at any time), and the world
# too: torch's threaded process groups (its multi-threaded tests) put a thread-local one in place.
if _AVAILABLE:
    default_group = functools.partial(operator.attrgetter("_world.default_pg"), _C10D)
else:
    default_group = itertools.repeat(None).__next__


def is_distributed():
    """True when a default process group of more than one rank is initialized."""
    return default_group() is not None and torch.distributed.get_world_size() > 1


def reduce_flag(flag):
    """Make a float32 overflow flag the MAX over all ranks, in place (a no-op in one process)."""
    if is_distributed():
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)


def agree_on_flags(found_per_device, found_inf):
    """Make GradScaler's found-inf flags ({device: flag}) the MAX over all ranks, in one
    collective; a no-op in one process.

    A rank holding no gradient (an empty shard) still takes part, so no rank waits forever.
    """
    if not is_distributed():
        return
    if not found_per_device:
        found_per_device[found_inf.device] = found_inf
    combined = torch.stack([flag.to(found_inf.device) for flag in found_per_device.values()]).amax()
    reduce_flag(combined)
    for flag in found_per_device.values():
        flag.copy_(combined)


def local(tensor):
    """A DTensor's local shard (sharing its storage); any other tensor as it is."""
    dtensor = dtensor_class()
    return tensor.to_local() if dtensor is not None and isinstance(tensor, dtensor) else tensor


def local_tensors(tensors):
    """The tensors with every DTensor replaced by its local shard (which shares its storage)."""
    if dtensor_class() is None:
        return tensors
    return shards(tensors)


# A DTensor's local shard is its `_local_tensor`: read as an attribute, a whole list costs one
# C-level map (to_local() is an autograd function per tensor, and a step's lists need no autograd).
_LOCAL_NAMES = itertools.repeat("_local_tensor")


def shards(tensors):
    """Each DTensor of `tensors` as its local shard, other tensors (and None) as they are."""
    return list(map(getattr, tensors, _LOCAL_NAMES, tensors))


def _like(local, dtensor):
    """`local` as the shard of a DTensor laid out as `dtensor` (its mesh, placements, global shape
    and stride), in local's dtype."""
    return dtensor_class().from_local(
        local,
        dtensor.device_mesh,
        dtensor.placements,
        run_check=False,
        shape=dtensor.shape,
        stride=dtensor.stride(),
    )


def laid_out(local, like, shape):
    """`local` as the shard of a contiguous DTensor of global `shape` placed as `like` (its
    mesh and placements: an 8-bit moment's scales, by the rows of their parameter); `local` as
    it is where `like` is no DTensor."""
    dtensor = dtensor_class()
    if dtensor is None or not isinstance(like, dtensor):
        return local
    stride = torch.empty(shape, device="meta").stride()
    return dtensor.from_local(
        local, like.device_mesh, like.placements, run_check=False, shape=shape, stride=stride
    )


def shardwise(function, *args):
    """`function(*args)` for a `function` of tensors elementwise (amp's codecs: the same bits
    sharded or not), run on the local shards where the first argument is a DTensor: its results
    of the shard's shape come back as DTensors laid out as the first argument, others (an 8-bit
    moment's block scales) as they are."""
    first = args[0]
    dtensor = dtensor_class()
    if dtensor is None or not isinstance(first, dtensor):
        return function(*args)
    shape = first._local_tensor.shape
    result = function(*shards(args))
    parts = result if isinstance(result, tuple) else (result,)
    parts = tuple(_like(part, first) if part.shape == shape else part for part in parts)
    return parts if isinstance(result, tuple) else parts[0]


def shard_start(tensor):
    """The element of its flattened whole at which a DTensor's local shard starts (0 for any
    other tensor and for one no mesh dimension splits), or None where a mesh dimension splits it
    along another dim than 0 (its elements are no run of the whole's). Shard(0) splits as
    torch.chunk does (FSDP2's shards): ceil(rows / ranks) rows each, the last ones fewer or none.
    """
    dtensor = dtensor_class()
    if dtensor is None or not isinstance(tensor, dtensor) or tensor.dim() == 0:
        return 0
    mesh, rows = tensor.device_mesh, tensor.shape[0]
    first, count = 0, rows  # the rows of the whole the placements so far leave this rank
    for dim, placement in enumerate(tensor.placements):
        ranks = mesh.size(dim)
        if not placement.is_shard() or ranks == 1:
            continue
        if placement.dim % tensor.dim() != 0:
            return None
        chunk = -(-count // ranks)
        skipped = min(mesh.get_coordinate()[dim] * chunk, count)
        first, count = first + skipped, min(chunk, count - skipped)
    return first * (tensor.numel() // rows) if rows else 0


def set_data(param, data):
    """`param.data = data`, its gradient (if any) brought to the new dtype, for a DTensor parameter
    too.

    A DTensor's `.data =` changes the wrapper's dtype but not its local shard, so such a parameter
    is swapped with a new one holding `data` (its identity kept, as torch's nn.Module._apply swaps
    them); the engine's record of the shard is brought in step by its owner (weights/shards.py).
    """
    grad, param.grad = param.grad, None
    dtensor = dtensor_class()
    if dtensor is not None and isinstance(param, dtensor):
        new = torch.nn.Parameter(data.detach(), requires_grad=param.requires_grad)
        torch.utils.swap_tensors(param, new)
    else:
        param.data = data
    if grad is not None:
        param.grad = grad.to(param.dtype)


def has_dtensors(tensors):
    dtensor = dtensor_class()
    return dtensor is not None and any(isinstance(t, dtensor) for t in tensors)


# -- overflow reports across shards --------------------------------------------------------------


def clean_name(name):
    """A parameter's name without the wrappers' path segments (FSDP1's)."""
    return name.replace("_fsdp_wrapped_module.", "")


def _entries(param):
    """[(param, original parameter's name or None, local tensor to check or None)]: a flat
    parameter (FSDP1, use_orig_params=False) has one entry per original parameter."""
    grad = param.grad
    infos = getattr(param, "_shard_param_infos", None)
    fqns = getattr(param, "_fqns", None)
    if infos is None or fqns is None:
        if grad is not None:
            grad = local(grad)
            grad = grad._values() if grad.is_sparse else grad
        return [(param, None, grad)]
    found = []
    for fqn, info in zip(fqns, infos):
        piece = None
        if grad is not None and info.in_shard:
            start = info.offset_in_shard
            piece = grad.reshape(-1)[start : start + info.numel_in_shard]
        found.append((param, fqn, piece))
    return found


def _name(param, fqn, name_of):
    name = name_of(param)
    if fqn is not None:  # the flat parameter's module path, then the original's own path
        prefix = name.rpartition(".")[0]
        name = f"{prefix}.{fqn}" if prefix else fqn
    return clean_name(name)


def nonfinite_names(params, name_of):
    """The names of `params` whose gradients hold inf or NaN, on any rank.

    Only on a skipped step, which every rank takes together: one reduction per gradient, one
    host sync, and one small collective (MAX over a flag per entry) when distributed. Every
    rank lists the same entries in the same order, shards without gradients included.
    """
    entries = [entry for param in params for entry in _entries(param)]
    if not entries:
        return ()
    checked = [t for _, _, t in entries if t is not None]
    distributed = is_distributed()
    if distributed:
        device = _collective_device()
    else:
        device = checked[0].device if checked else torch.device("cpu")
    no = torch.zeros((), dtype=torch.bool, device=device)
    flags = [
        no if t is None or t.numel() == 0 else (~torch.isfinite(t)).any().to(device)
        for _, _, t in entries
    ]
    bad = torch.stack(flags).float()
    if distributed:
        torch.distributed.all_reduce(bad, op=torch.distributed.ReduceOp.MAX)
    names = []
    for (param, fqn, _), is_bad in zip(entries, bad.tolist()):
        if is_bad:
            name = _name(param, fqn, name_of)
            if name not in names:
                names.append(name)
    return tuple(names)


def _collective_device():
    if torch.distributed.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")

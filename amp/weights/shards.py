"""FSDP2 (`fully_shard`) at O2: what amp checks before it casts a sharded model, and FSDP2's
record of each sharded parameter kept in step when amp changes the parameter's dtype.

At O2 each rank holds what a replicated run holds, for its shards only: the bf16 shard (the
DTensor parameter FSDP2 all-gathers), its master's rest (a DTensor laid out as the parameter)
and its moments (torch's DTensors), stepped by amp's fused step on the local shards
(distributed.shards). The codecs of the masters and FP32 moments are elementwise, so a shard's
bits are the replicated tensor's, and a checkpoint of the DTensors (torch's distributed
checkpoint) loads at any world size.

8-bit and bf16 moments are stepped from the shard's place in the whole tensor: the second
moment's stochastic rounding is drawn by the element's index in the whole (the kernels take the
shard's start: distributed.shard_start), and 8-bit codes are held only by parameters whose rows
are whole blocks of 32 (forms.StateForm.coded), so that a shard along dim 0, FSDP2's, holds whole
blocks, and their scales, laid out as the rows, shard as the parameter does. So a shard's bits
are the replicated tensor's at any world size. A parameter split along another dim (FSDP2's
shard_placement_fn) holds no run of the whole's elements: those moments are refused for it
(`check`).

FSDP2 keeps, per parameter, the padded local shard it all-gathers and, from its first forward,
the dtype it gathers and reduces in with buffers of that dtype. amp swaps a cast parameter's data
(distributed.set_data: FSDP2's own `model.to(dtype)` swaps them too); `resync` then makes FSDP2
gather the new shard in its dtype (what FSDPModule._apply does, and what its first forward reads,
if it ran). FSDP2 has no public call for a dtype changed after its first forward: the
attributes read there are private, and named here only.
"""

import sys

import torch

from ..distributed import dtensor_class, shard_start
from . import forms, paths

__all__ = ["FSDP2", "check", "check_groups", "resync"]

FSDP2 = "fully_shard (FSDP2)"
_ROUTE = (
    "Or keep FP32 shards with FSDP2's own mixed precision "
    "(fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))) and "
    "amp.GradScaler, without amp.initialize."
)


def _groups(model):
    """FSDP2's parameter groups of `model` (each once: fully_shard([a, b]) shares one state)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")  # no FSDP2 model before it is imported
    found = {}
    for module in model.modules():
        if fsdp is not None and isinstance(module, fsdp.FSDPModule):
            for group in module._get_fsdp_state()._fsdp_param_groups:
                found[id(group)] = group
    return list(found.values())


def _split(param):
    """Whether a DTensor parameter is split between ranks (a mesh dimension of more than one
    rank shards it)."""
    mesh, placements = param.device_mesh, param.placements
    return any(p.is_shard() and mesh.size(dim) > 1 for dim, p in enumerate(placements))


# -- at amp.initialize, before anything changes ---------------------------------------------------


def check(model, index, optimizers, properties):
    """Refuse, changing nothing, an FSDP2 model that O2 (`properties`, with master weights)
    cannot train: its parameters gathered, an optimizer amp's fused step does not step, or 8-bit
    or bf16 moments of parameters split along another dim than 0."""
    where = f"amp.initialize: models[{index}] is sharded by {FSDP2}"
    for group in _groups(model):
        for fsdp_param in group.fsdp_params:
            if fsdp_param.sharded_state.name != "SHARDED":
                raise RuntimeError(
                    f"{where}, and its parameters are gathered now (FSDP2's root keeps them "
                    "gathered after a forward without a backward). Call model.reshard() "
                    "before amp.initialize."
                )
    dtensor = dtensor_class()
    sharded = {id(p) for p in model.parameters() if isinstance(p, dtensor)}
    for number, optimizer in enumerate(optimizers):
        groups = optimizer.param_groups
        params = [p for group in groups for p in group["params"] if id(p) in sharded]
        if not params:
            continue
        for group_number, group in enumerate(groups):
            place = f"optimizers[{number}].param_groups[{group_number}]"
            path, reason = paths.choose(optimizer, group, properties, place)
            if path != paths.FUSED:
                raise RuntimeError(
                    f"{where}; O2 steps its shards by amp's fused step (torch.optim.AdamW, Adam "
                    "or SGD without amsgrad, maximize, capturable or differentiable, with number "
                    f"hyperparameters), and {place} cannot be: {reason}. Use one of those. "
                    + _ROUTE
                )
        moments = properties.optimizer_state
        placed = moments in ("bf16", "int8")  # moments that may depend on an element's place
        across = next((p for p in params if _across(p, moments)), None) if placed else None
        if across is not None:
            name = next(n for n, p in model.named_parameters() if p is across)
            dims = sorted({p.dim for p in across.placements if p.is_shard()})
            raise RuntimeError(
                f"{where}, and optimizer_state={moments!r} keeps moments whose bits depend on "
                f"each element's place in the whole tensor: {name!r} is split along dim "
                f"{dims[-1]} (fully_shard's shard_placement_fn), so a shard holds no run of "
                "the whole's elements, and "
                + _MOMENTS[moments]
                + " Shard it along dim 0 (FSDP2's default), or use optimizer_state='fp32'. "
                + _ROUTE
            )


def _across(param, moments):
    """Whether `param`'s moments under `moments` depend on its elements' places in the whole
    tensor (bf16 ones; 8-bit codes, where it holds them) and it is split along another dim than
    0 (its shards hold no runs of the whole's elements)."""
    if moments == "int8" and not forms.coded(param):
        return False  # FP32 moments: elementwise
    return _split(param) and shard_start(param) is None


_MOMENTS = {
    "int8": "8-bit moments are block-scaled by runs of 32 elements of a row and rounded by a "
    "hash of the element's index in the whole: its shards would get other blocks and roundings "
    "than the replicated tensor.",
    "bf16": "bf16 second moments are rounded by a hash of the element's index in the whole: its "
    "shards would get other roundings than the replicated tensor.",
}


def check_groups(model, cast_ids, dtype):
    """Refuse, before the model is cast, an FSDP2 group whose parameters amp would leave in two
    dtypes (FSDP2 gathers and reduces a group in one): a batch norm kept FP32, or one of
    fp32_modules, sharded with parameters cast to `dtype`; and a group whose MixedPrecisionPolicy
    would cast amp's `dtype` shards to another dtype for compute."""
    names = {id(p): name for name, p in model.named_parameters()}
    for group in _groups(model):
        params = [p.sharded_param for p in group.fsdp_params if p.sharded_param.requires_grad]
        cast = [id(p) in cast_ids for p in params]
        compute = group.mp_policy.param_dtype
        if any(cast) and compute not in (None, dtype):
            raise RuntimeError(
                f"amp.initialize: a {FSDP2} group of {names.get(id(params[0]), '?')} computes "
                f"in {compute} (its MixedPrecisionPolicy's param_dtype), and O2 casts its "
                f"parameters to {dtype}: two casts. Leave param_dtype unset (amp casts), or "
                f"set it to {dtype}; reduce_dtype=torch.float32 is welcome."
            )
        if any(cast) and not all(cast):
            kept = [names.get(id(p), "?") for p, c in zip(params, cast) if not c]
            raise RuntimeError(
                f"amp.initialize: a {FSDP2} group holds parameters O2 casts to {dtype} and "
                f"parameters it keeps FP32 ({', '.join(kept)}: batch norm, or fp32_modules), "
                "and FSDP2 gathers and reduces a group in one dtype. Call fully_shard on "
                "those modules on their own, before fully_shard on their parents."
            )


# -- after amp changed the parameters' data ------------------------------------------------------


def resync(model):
    """FSDP2's record of each sharded parameter of `model` in step with the parameter's data
    (amp's cast, deinitialize, a failed initialize put back): the shard it gathers, and, where
    its first forward ran, the dtype it gathers and reduces in."""
    with torch.no_grad():
        for group in _groups(model):
            changed = False
            for fsdp_param in group.fsdp_params:
                fsdp_param.reset_sharded_param()  # gathers the new shard (padded as FSDP2 pads)
                dtype = fsdp_param.sharded_param.dtype
                if getattr(fsdp_param, "orig_dtype", dtype) is not dtype:
                    # made at the first all-gather in the old dtype: made again at the next one
                    fsdp_param.all_gather_outputs = []
                    vars(fsdp_param).pop("_unsharded_param", None)
                    changed = True
            if changed:
                group._init_mp_dtypes()

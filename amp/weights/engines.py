"""The distributed engines amp meets: combinations it refuses, parameters a late wrapper replaced,
and ZeroRedundancyOptimizer stepping the O2 masters.

- What amp cannot support is refused at `amp.initialize` (low-precision casts of models sharded
  by FSDP1 or DTensors, O3 under FSDP2; O2 under FSDP2 is shards.py's), and a parameter replaced
  after `amp.initialize` (a wrapper applied too late) raises at the next step instead of
  training nothing: each optimizer's record remembers where its parameters sit (`Places`), and
  its step checks that with C-level lookups.
- ZeroRedundancyOptimizer at O2 steps amp's FP32 masters on each rank's partition.
- DistributedDataParallel at O2 broadcasts rank 0's masters' rests with its parameters.
"""

import functools
import operator
import sys

import torch

from .._state import amp_state
from ..distributed import clean_name, dtensor_class, has_dtensors
from . import shards

__all__ = [
    "check_engines",
    "Places",
    "anchor",
    "check_places",
    "follow_masters",
    "follow_ddp_broadcast",
]

_SUPPORTED_ROUTES = (
    "Supported: the wrapper first, then the optimizer, then amp.initialize(opt_level='O1'), or "
    "with fully_shard (FSDP2) also opt_level='O2'; or, for low-precision parameters, the "
    "engine's own mixed precision (fully_shard(mp_policy=MixedPrecisionPolicy(param_dtype="
    "torch.float16)), or FullyShardedDataParallel(mixed_precision=MixedPrecision(...))) with "
    "amp.GradScaler and no amp.initialize."
)


# -- combinations amp refuses --------------------------------------------------------------------


def _engine(model):
    """What shards `model` (FSDP2, FSDP1 or DTensor parameters), in words; None if nothing."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is not None:
        for module in model.modules():
            if isinstance(module, fsdp.FSDPModule):
                return shards.FSDP2
            if isinstance(module, fsdp.FullyShardedDataParallel):
                return "FullyShardedDataParallel (FSDP1)"
    if has_dtensors(model.parameters()):
        return "DTensor parameters"
    return None


def check_engines(models, optimizers, properties):
    """Refuse, before anything changes, what amp cannot do on a sharded model or ZeRO."""
    casts = properties.cast_model_type not in (None, False, torch.float32)
    for index, model in enumerate(models):
        engine = _engine(model)
        if engine is None or not casts:
            continue
        if engine == shards.FSDP2 and properties.master_weights:
            shards.check(model, index, optimizers, properties)  # O2: each rank its shards
            continue
        why = (
            "without master weights: under fully_shard, O2 keeps each shard's"
            if engine == shards.FSDP2
            else "amp's casts and master weights follow FSDP2's shards, not this engine's"
        )
        raise RuntimeError(
            f"amp.initialize: models[{index}] is sharded by {engine}, and opt_level="
            f"{properties.opt_level!r} casts the model to {properties.cast_model_type} {why}. "
            + _SUPPORTED_ROUTES
        )
    zero = _zero_class()
    if zero is None or not properties.master_weights:
        return
    for index, optimizer in enumerate(optimizers):
        if isinstance(optimizer, zero) and properties.compact:
            raise RuntimeError(
                f"amp.initialize: optimizers[{index}] is a ZeroRedundancyOptimizer, whose local "
                "optimizer steps its share of the parameters with its own step; compact state "
                "(master_weights='compact', optimizer_state other than 'fp32') is kept by amp's "
                "fused step only. Use master_weights=True with optimizer_state='fp32' under "
                "ZeRO, or fully_shard (FSDP2), under which O2 keeps compact masters shard by "
                "shard."
            )
        if isinstance(optimizer, zero) and (
            optimizer.parameters_as_bucket_view or optimizer._overlap_with_ddp
        ):
            raise RuntimeError(
                f"amp.initialize: optimizers[{index}] is a ZeroRedundancyOptimizer with "
                "parameters_as_bucket_view=True or overlap_with_ddp=True, which amp's FP32 master "
                f"weights (opt_level={properties.opt_level!r}) cannot take part in. Build it with "
                "the defaults (both False), or use opt_level='O1'."
            )


# -- parameters replaced after amp.initialize ----------------------------------------------------


def anchor(records, models):
    """Anchor each record where its parameters sit in `models` now (initialize,
    add_param_group): a step checks that they are still there."""
    places = _places(models)
    for record in records:
        record.anchor(places)


class Places:
    """Where the parameters an optimizer steps sit in the models: each one's module
    `_parameters` dict, its name there and its qualified name (for messages)."""

    def __init__(self):
        self.params, self.dicts, self.names, self.qualified = [], [], [], []
        self.qualified_of = {}  # id(parameter as the model holds it) -> its qualified name

    def anchor(self, params, places):
        """Remember where each of `params` sits: `places` maps id(param) to (module._parameters,
        name, qualified name, ...). Parameters in no model are not watched."""
        found = [(param, places[id(param)]) for param in params if id(param) in places]
        self.params = [param for param, _ in found]
        self.dicts = [place[0] for _, place in found]
        self.names = [place[1] for _, place in found]
        self.qualified = [place[2] for _, place in found]
        self.qualified_of = dict(zip(map(id, self.params), self.qualified))

    def in_place(self):
        """True when every parameter still sits where it was anchored (C-level lookups)."""
        return all(map(operator.is_, map(dict.get, self.dicts, self.names), self.params))

    def name_of(self, param, groups):
        """The qualified name of `param`, or its place in `groups` for one in no model."""
        name = self.qualified_of.get(id(param))
        if name is not None:
            return name
        for group_index, group in enumerate(groups):
            for param_index, candidate in enumerate(group["params"]):
                if candidate is param:
                    return f"param_groups[{group_index}]['params'][{param_index}]"
        return None


def check_places(places, caller):
    """Raise if a parameter of `places` left the models (a wrapper applied after amp.initialize,
    or an assignment, replaced it); follow the ones that only moved. Runs when the C-level check
    found a parameter away from its place."""
    found = _places(amp_state.models)
    dtensor = dtensor_class()
    for param, qualified in zip(places.params, places.qualified):
        if id(param) in found or (dtensor is not None and isinstance(param, dtensor)):
            continue  # moved, or FSDP2's sharded parameter while its unsharded view is in
        raise RuntimeError(
            f"{caller}: the parameter {clean_name(qualified or '?')!r} that amp set up at "
            "amp.initialize is no longer in the model: a wrapper such as fully_shard or "
            "FullyShardedDataParallel, an assignment, or a conversion that makes new parameters "
            "(model.to('meta'), torch.__future__.set_swap_module_params_on_conversion(True)) "
            "replaced it afterwards, so this step would update a tensor the model no longer "
            "uses. A move between devices (model.cpu(), model.cuda()) keeps the parameters and "
            "is followed. " + _SUPPORTED_ROUTES
        )
    places.anchor(places.params, found)


def _places(models):
    """{id(param): (module._parameters, name, qualified name, param, module)}, first place only."""
    found = {}
    for index, model in enumerate(models):
        prefix = f"model{index}." if len(models) > 1 else ""
        for module_name, module in model.named_modules(remove_duplicate=False):
            for name, param in module._parameters.items():
                if param is not None and id(param) not in found:
                    qualified = prefix + (f"{module_name}.{name}" if module_name else name)
                    found[id(param)] = (module._parameters, name, qualified, param, module)
    return found


# -- ZeroRedundancyOptimizer at O2 ---------------------------------------------------------------


def _zero_class():
    module = sys.modules.get("torch.distributed.optim")
    return None if module is None else getattr(module, "ZeroRedundancyOptimizer", None)


def follow_masters(optimizer, pairs, ledger):
    """Make a ZeroRedundancyOptimizer partition, step and broadcast amp's FP32 masters.

    amp put the masters in `optimizer.param_groups`; ZeRO also keeps every parameter in
    `_all_params` and its rank's share in a local optimizer, built at construction.
    """
    zero = _zero_class()
    if zero is None or not isinstance(optimizer, zero) or not pairs:
        return
    to_master = {id(model_param): master for model_param, master in pairs}
    to_model = {id(master): model_param for model_param, master in pairs}

    def swap(mapping):
        optimizer._all_params = [mapping.get(id(p), p) for p in optimizer._all_params]
        local = optimizer.optim
        for group in local.param_groups:
            group["params"] = [mapping.get(id(p), p) for p in group["params"]]
        for old in [p for p in local.state if id(p) in mapping]:
            local.state[mapping[id(old)]] = local.state.pop(old)
        optimizer._clear_cache()
        optimizer._is_trainable_mask = optimizer._get_is_trainable_mask()

    swap(to_master)
    ledger.add_undo(
        "ZeroRedundancyOptimizer steps its model parameters again", lambda: swap(to_model)
    )


# -- DistributedDataParallel's initial broadcast at O2 -------------------------------------------


def follow_ddp_broadcast(ledger):
    """Make DistributedDataParallel (torch's, and apex.parallel's subclass) broadcast the FP32
    masters of the cast parameters with the parameters themselves, at construction.

    Its broadcast writes rank 0's low-precision values into every rank's model; taken in as an
    outside write, it would leave each rank's master where the rounding hides the difference, and
    ranks initialised differently would step different masters. apex made every rank's masters
    from the broadcast weights; amp sends rank 0's exact FP32 masters, over the same group.
    """
    if not torch.distributed.is_available():
        return
    ledger.patch(torch.nn.parallel.distributed, "_sync_module_states", _with_masters)


def _with_masters(original):
    @functools.wraps(original)
    def sync_module_states(
        module,
        process_group,
        broadcast_bucket_size,
        src,
        params_and_buffers_to_ignore,
        broadcast_buffers=True,
    ):
        for rows in amp_state.rows:  # each rank's own writes first: master and model agree
            rows.take_writes()
        original(
            module,
            process_group,
            broadcast_bucket_size,
            src,
            params_and_buffers_to_ignore,
            broadcast_buffers,
        )
        found = []
        for name, param in module.named_parameters():
            if name in params_and_buffers_to_ignore:
                continue
            rows = amp_state.owners.get(id(param))
            if rows is not None:
                found.append((rows, rows.index[id(param)]))
        if found:  # a row's value is its (broadcast) weight and its rest
            # int16 remainders as bytes: not every backend (gloo) broadcasts int16
            rests = [_bytes(rows.rest(row).detach()) for rows, row in found]
            torch.distributed._broadcast_coalesced(
                process_group, rests, broadcast_bucket_size, src
            )
            for rows, row in found:  # rank 0's parameter and rest: they agree
                rows.mark_row(row)
                rows.refresh([row])

    return sync_module_states


def _bytes(tensor):
    """An int16 tensor's bytes (a view); other tensors as they are."""
    return tensor.reshape(-1).view(torch.int8) if tensor.dtype is torch.int16 else tensor

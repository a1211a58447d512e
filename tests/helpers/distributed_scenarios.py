"""Distributed scenarios for tests/weights/test_engines.py: one rank of a 2-process gloo job.

Run as ``python tests/helpers/distributed_scenarios.py OUT`` (helpers.ranks.run_two_ranks) with
RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set: every scenario of SCENARIOS runs in turn and
this rank's results go to OUT/rank<RANK>.pt. Each trains a small model for STEPS steps, rank 1 alone injecting an inf into
its gradient (its own shard under FSDP) at OVERFLOW_STEP. `reference(engine, mode)` trains the
same global batches in one process, for comparison.
"""

import contextlib
import datetime
import functools
import os
import sys
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F

import amp
from helpers import models, ranks

ENGINES = ["ddp", "fsdp2", "fsdp1", "zero"]
# "scaler": amp.GradScaler, with amp.autocast (DDP, ZeRO) or the engine's FP16 parameters (FSDP).
MODES = ["O1", "O2", "scaler"]
# O2 and O3 with FSDP1, and O3 with FSDP2, are refused by design at amp.initialize after the
# wrapper; any of them with the wrapper after amp.initialize at the step. (O2 after fully_shard
# trains: tests/weights/test_fsdp2.py.)
SCENARIOS = [(e, m) for e in ENGINES for m in MODES if not (e.startswith("fsdp") and m == "O2")]
SCENARIOS.append(("fsdp1_orig", "O1"))  # FSDP1 with use_orig_params=True
SCENARIOS += [("ddp", "O3"), ("zero", "O3")]  # with dynamic loss scaling (O3's default is 1.0)
REFUSED = [
    (engine, level, order)
    for engine in ("fsdp2", "fsdp1")
    for level in ("O2", "O3")
    for order in ("after", "before")
    if (engine, level, order) != ("fsdp2", "O2", "after")
]
# At O1 too, a wrapper applied after amp.initialize is caught at the first step.
REFUSED += [(engine, "O1", "before") for engine in ("fsdp2", "fsdp1")]
STEPS, OVERFLOW_STEP, WORLD, BATCH, MICRO = 5, 2, 2, 8, 2  # MICRO: accumulated micro-batches


make_model = functools.partial(models.make_model, inputs=8, hidden=16, outputs=4)


def make_optimizer(params, zero=False):
    if zero:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(
            params, optimizer_class=torch.optim.SGD, lr=0.1, momentum=0.9
        )
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def batches(step):
    """[rank][micro-batch] -> (inputs, targets): the global batch of `step`."""
    generator = torch.Generator().manual_seed(100 + step)
    x = torch.randn(WORLD, MICRO, BATCH, 8, generator=generator)
    y = torch.randint(0, 4, (WORLD, MICRO, BATCH), generator=generator)
    return [[(x[r, m], y[r, m]) for m in range(MICRO)] for r in range(WORLD)]


def micro_batches(engine, rank, step):
    """What `rank` trains on at `step`: DDP and ZeRO accumulate MICRO micro-batches under
    no_sync(); FSDP takes them as one batch."""
    pieces = batches(step)[rank]
    if engine in ("ddp", "zero"):
        return pieces
    return [(torch.cat([x for x, _ in pieces]), torch.cat([y for _, y in pieces]))]


def cross_entropy_part(model, inputs, targets, parts):
    return F.cross_entropy(model(inputs).float(), targets) / parts


def _local(tensor):
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def inject(grad):
    _local(grad).view(-1)[0] = float("inf")


def initialize(model, optimizer, level):
    dynamic = {"loss_scale": "dynamic"} if level == "O3" else {}
    return amp.initialize(model, optimizer, opt_level=level, verbosity=0, **dynamic)


def model_and_optimizer():
    """make_model() and its SGD, for the one-process tests."""
    model = make_model()
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def one_step(model, optimizer, scaler=None):
    """One step on batch 0 with scale_loss, or with `scaler` and amp.autocast."""
    inputs, targets = batches(0)[0][0]
    if scaler is not None:
        with amp.autocast(dtype=torch.float16):
            loss = cross_entropy_part(model, inputs, targets, 1)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    else:
        with amp.scale_loss(cross_entropy_part(model, inputs, targets, 1), optimizer) as scaled:
            scaled.backward()
        optimizer.step()
    optimizer.zero_grad()


# -- one distributed scenario ---------------------------------------------------------------------


def build(engine, mode):
    """(model to call, optimizer, scaler or None) set up in the order docs/distributed.md gives."""
    from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = make_model()
    scaler = amp.GradScaler() if mode == "scaler" else None
    if engine in ("ddp", "zero"):
        optimizer = make_optimizer(model.parameters(), zero=engine == "zero")
        if scaler is None:
            model, optimizer = initialize(model, optimizer, mode)
        return torch.nn.parallel.DistributedDataParallel(model), optimizer, scaler
    if engine == "fsdp2":
        if scaler is not None:
            policy = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
            fully_shard(model, mp_policy=policy)
        else:
            fully_shard(model)
    else:
        mixed = None
        if scaler is not None:
            mixed = MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float32)
        model = FullyShardedDataParallel(
            model,
            device_id=torch.device("cpu"),
            mixed_precision=mixed,
            use_orig_params=engine == "fsdp1_orig",
        )
    optimizer = make_optimizer(model.parameters())
    if scaler is None:
        model, optimizer = amp.initialize(model, optimizer, opt_level=mode, verbosity=0)
    return model, optimizer, scaler


def train(engine, mode, rank):
    model, optimizer, scaler = build(engine, mode)
    first = next(model.parameters())
    scales, overflows = [], []
    for step in range(STEPS):
        pieces = micro_batches(engine, rank, step)
        overflow_here = rank == 1 and step == OVERFLOW_STEP
        before = amp.last_overflow()
        for index, (inputs, targets) in enumerate(pieces):
            last = index == len(pieces) - 1
            sync = (
                model.no_sync()
                if not last and engine in ("ddp", "zero")
                else contextlib.nullcontext()
            )
            with sync:
                if scaler is not None:
                    with amp.autocast(dtype=torch.float16, enabled=engine in ("ddp", "zero")):
                        loss = cross_entropy_part(model, inputs, targets, len(pieces))
                    scaler.scale(loss).backward()
                    if last and overflow_here:
                        inject(first.grad)
                    continue
                loss = cross_entropy_part(model, inputs, targets, len(pieces))
                with amp.scale_loss(loss, optimizer, delay_unscale=not last) as scaled:
                    scaled.backward()
                    if last and overflow_here:
                        inject(first.grad)
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
            scales.append(scaler.get_scale())
        else:
            optimizer.step()
            scales.append(amp.state_dict()["loss_scaler0"]["loss_scale"])
            report = amp.last_overflow()
            overflows.append(None if report is before else report.params)
        optimizer.zero_grad()
    return {
        "scales": scales,
        "overflows": overflows,
        "params": full_params(engine, mode, model),
        "momentum": full_momentum(engine, model, optimizer),
    }


def _clean(name):
    return name.replace("_fsdp_wrapped_module.", "").replace("module.", "", 1)


def full_params(engine, mode, model):
    """{name: FP32 value}: the FP32 masters at O2, gathered shards under FSDP."""
    if engine.startswith("fsdp1"):
        from torch.distributed.fsdp import FullyShardedDataParallel

        with FullyShardedDataParallel.summon_full_params(model):
            return {_clean(n): p.detach().float().clone() for n, p in model.named_parameters()}
    if engine == "fsdp2":
        return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    module = model.module
    return {name: value.clone() for name, value in module.state_dict().items()}  # O2: masters


def full_momentum(engine, model, optimizer):
    """{name: momentum buffer}: every buffer under DDP and FSDP, this rank's partition under ZeRO."""
    if engine.startswith("fsdp1"):
        from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import StateDictType

        with FSDP.state_dict_type(
            model,
            StateDictType.FULL_STATE_DICT,
            FullStateDictConfig(rank0_only=False),
            FullOptimStateDictConfig(rank0_only=False),
        ):
            state = FSDP.optim_state_dict(model, optimizer)["state"]
        return {_clean(n): s["momentum_buffer"].clone() for n, s in state.items()}
    names = [_clean(n) for n, _ in model.named_parameters()]
    # What the optimizer steps, in the model's order: at O2 the model's parameters (amp's fused
    # step) or FP32 master Parameters (the optimizer's own step): its state's keys.
    params = [p for group in optimizer.param_groups for p in group["params"]]
    local = optimizer.optim.state if engine == "zero" else optimizer.state
    found = {}
    for name, param in zip(names, params):
        if param in local:
            buffer = local[param]["momentum_buffer"]
            found[name] = (buffer.full_tensor() if engine == "fsdp2" else buffer).clone()
    return found


def refused(engine, level, order):
    """The error amp raises for `level` with a sharded model, wrapped `order` amp.initialize."""
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard

    def wrap(model):
        if engine == "fsdp2":
            fully_shard(model)
            return model
        return FullyShardedDataParallel(model, device_id=torch.device("cpu"))

    model = make_model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    try:
        if order == "after":
            model = wrap(model)
            optimizer = make_optimizer(model.parameters())
            amp.initialize(model, optimizer, opt_level=level, verbosity=0)
        else:
            optimizer = make_optimizer(model.parameters())
            model, optimizer = amp.initialize(model, optimizer, opt_level=level, verbosity=0)
            model = wrap(model)
            inputs, targets = micro_batches("fsdp", 0, 0)[0]
            with amp.scale_loss(cross_entropy_part(model, inputs, targets, 1), optimizer) as scaled:
                scaled.backward()
            optimizer.step()
    except RuntimeError as error:
        if order == "after":  # nothing was cast: the model's own parameters are as they were
            now = full_params(engine, level, model)
        else:  # the step raised before the optimizer moved what it steps (O3: the FP16 model)
            now = dict(zip(before, amp.master_params(optimizer)))
        unchanged = all(torch.equal(now[name], before[name].to(now[name].dtype)) for name in now)
        return {"error": str(error), "unchanged": unchanged, "compared": sorted(now)}
    return {"error": None}


# -- the single-process reference ------------------------------------------------------------------


def reference(engine, mode):
    """The same global batches trained in one process: O1 / O2 as the scenario, and for the
    GradScaler scenarios amp.autocast (DDP, ZeRO) or O2's FP16 model with FP32 masters (FSDP's
    FP16 parameters with FP32 shards)."""
    model = make_model()
    optimizer = make_optimizer(model.parameters())
    scaler = None
    if mode == "scaler" and engine in ("ddp", "zero"):
        scaler = amp.GradScaler()
    else:
        model, optimizer = initialize(model, optimizer, "O2" if mode == "scaler" else mode)
    scales = []
    try:
        for step in range(STEPS):
            pieces = [piece for rank in range(WORLD) for piece in batches(step)[rank]]
            inputs = torch.cat([x for x, _ in pieces])
            targets = torch.cat([y for _, y in pieces])
            if scaler is not None:
                with amp.autocast(dtype=torch.float16):
                    loss = cross_entropy_part(model, inputs, targets, 1)
                scaler.scale(loss).backward()
                if step == OVERFLOW_STEP:
                    inject(model[0].weight.grad)
                scaler.step(optimizer)
                scaler.update()
                scales.append(scaler.get_scale())
            else:
                with amp.scale_loss(
                    cross_entropy_part(model, inputs, targets, 1), optimizer
                ) as scaled:
                    scaled.backward()
                    if step == OVERFLOW_STEP:
                        inject(model[0].weight.grad)
                optimizer.step()
                scales.append(amp.state_dict()["loss_scaler0"]["loss_scale"])
            optimizer.zero_grad()
        params = {name: value.clone() for name, value in model.state_dict().items()}
        momentum = {
            name: optimizer.state[param]["momentum_buffer"].clone()
            for (name, _), param in zip(
                model.named_parameters(), [p for g in optimizer.param_groups for p in g["params"]]
            )
        }
    finally:
        amp.deinitialize()
    return {"scales": scales, "params": params, "momentum": momentum}


def main(out):
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    results = {}
    for engine, mode in SCENARIOS:
        try:
            results[(engine, mode)] = train(engine, mode, rank)
        except Exception:
            results[(engine, mode)] = {"crash": traceback.format_exc()}
        finally:
            amp.deinitialize()
    for engine, mode, order in REFUSED:
        try:
            results[(engine, mode, order)] = refused(engine, mode, order)
        except Exception:
            results[(engine, mode, order)] = {"crash": traceback.format_exc()}
        finally:
            amp.deinitialize()
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
    ranks.leave()  # results written: no static destructors (gloo aborts in them)

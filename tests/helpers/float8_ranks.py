"""One rank of a 2-process gloo job training with float8 (tests/weights/test_float8_engines.py).

Run as ``python tests/helpers/float8_ranks.py OUT`` with RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT set: each scenario trains a small model for STEPS steps (rank 1 alone injects an inf
into a gradient at OVERFLOW_STEP) and this rank's results go to OUT/rank<RANK>.pt.
"""

import datetime
import os
import sys
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F

import amp
from helpers import models, ranks

# (engine, how amp is used): DDP at O2, FSDP2 at O1, FSDP2 with amp.autocast + amp.GradScaler.
SCENARIOS = [("ddp", "O2"), ("fsdp2", "O1"), ("fsdp2", "scaler")]
STEPS, OVERFLOW_STEP = 4, 2
DTYPE, RECIPE = torch.bfloat16, "tensorwise"


def make_model():
    """helpers.models.make_model with FP8-sized layers: Linear(32, 64), ReLU, Linear(64, 16)."""
    return models.make_model(inputs=32, hidden=64, outputs=16)


def batch(rank, step):
    generator = torch.Generator().manual_seed(100 * step + rank)
    inputs = torch.randn(16, 32, generator=generator)
    return inputs, torch.randint(0, 16, (16,), generator=generator)


def _full(tensor):
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach().float()


def build(engine, mode):
    """(model to call, optimizer, scaler or None), in the order docs/distributed.md gives."""
    model = make_model()
    if engine == "ddp":
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model, optimizer = amp.initialize(
            model, optimizer, opt_level=mode, dtype=DTYPE, float8=RECIPE, verbosity=0
        )
        return torch.nn.parallel.DistributedDataParallel(model), optimizer, None
    from torch.distributed.fsdp import fully_shard

    fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if mode == "scaler":
        return model, optimizer, amp.GradScaler()
    model, optimizer = amp.initialize(
        model, optimizer, opt_level=mode, dtype=DTYPE, float8=RECIPE, verbosity=0
    )
    return model, optimizer, None


def train(engine, mode, rank):
    model, optimizer, scaler = build(engine, mode)
    grad_owner = next(model.parameters())  # before a forward: FSDP2's root keeps it unsharded
    scales, losses, ran_in = [], [], []
    for step in range(STEPS):
        inputs, targets = batch(rank, step)
        with amp.trace() as trace:
            if scaler is not None:
                with amp.autocast(dtype=DTYPE, float8=RECIPE):
                    loss = F.cross_entropy(model(inputs).float(), targets)
            else:
                loss = F.cross_entropy(model(inputs).float(), targets)
        ran_in.append([r.ran_in for r in trace.records if r.op.endswith("functional.linear")])
        losses.append(loss.item())
        if scaler is not None:
            scaler.scale(loss).backward()
            if rank == 1 and step == OVERFLOW_STEP:
                _local(grad_owner.grad).view(-1)[0] = float("inf")
            scaler.step(optimizer)
            scaler.update()
            scales.append(scaler.get_scale())
        else:
            with amp.scale_loss(loss, optimizer) as scaled:
                scaled.backward()
                if rank == 1 and step == OVERFLOW_STEP:
                    _local(grad_owner.grad).view(-1)[0] = float("inf")
            optimizer.step()
            scales.append(amp.state_dict()["loss_scaler0"]["loss_scale"])
        optimizer.zero_grad()
    return {
        "scales": scales,
        "losses": losses,
        "ran_in": ran_in,
        "params": [_full(p) for p in model.parameters()],
    }


def _local(tensor):
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


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
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
    ranks.leave()  # results written: no static destructors (gloo aborts in them)

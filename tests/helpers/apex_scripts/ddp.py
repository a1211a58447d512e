"""One rank of an apex-era data-parallel script, written here in the style of apex's simple
distributed example: SyncBatchNorm conversion, `amp.initialize`, then
`apex.parallel.DistributedDataParallel` with apex's arguments.

    RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=p python ddp.py OUT

Every scenario of SCENARIOS runs in turn; this rank's results go to OUT/rank<RANK>.pt.
`reference(scenario)` trains the same global batches in one process, without DDP.
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from apex import amp
from apex.parallel import DistributedDataParallel as DDP
from apex.parallel import Reducer, convert_syncbn_model
from apex.parallel.distributed import flat_dist_call  # BERT's run_pretraining.py imports it so
from helpers import models, ranks

WORLD, BATCH, STEPS = 2, 8, 4
# (opt level, apex DDP arguments, what the loss is multiplied by in the one-process reference)
SCENARIOS = {
    "O1 delay_allreduce": ("O1", dict(delay_allreduce=True, message_size=100), 1.0),
    "O2 predivide fp32": (
        "O2",
        dict(gradient_predivide_factor=2.0, allreduce_always_fp32=True),
        1.0,
    ),
    "O1 no average": ("O1", dict(gradient_average=False), float(WORLD)),
}


def make_model():
    return models.make_model(inputs=8, hidden=16, outputs=4, batch_norm=True)


def global_batch(step):
    generator = torch.Generator().manual_seed(10 + step)
    return (
        torch.randn(WORLD * BATCH, 8, generator=generator),
        torch.randint(0, 4, (WORLD * BATCH,), generator=generator),
    )


def results(model):
    state = model.module.state_dict() if hasattr(model, "module") else model.state_dict()
    return {name: value.detach().float().clone() for name, value in state.items()}


def train(scenario, rank=None):
    """rank=None: the one-process reference over the global batches."""
    opt_level, ddp_arguments, reference_factor = SCENARIOS[scenario]
    model = make_model()
    if rank is not None:
        model = convert_syncbn_model(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level, verbosity=0)
    try:
        if rank is not None:
            model = DDP(model, **ddp_arguments)
        for step in range(STEPS):
            x, y = global_batch(step)
            if rank is not None:
                x, y = x[rank * BATCH : (rank + 1) * BATCH], y[rank * BATCH : (rank + 1) * BATCH]
            loss = F.cross_entropy(model(x).float(), y)
            if rank is None:
                loss = loss * reference_factor
            optimizer.zero_grad()
            with amp.scale_loss(loss, optimizer) as scaled_loss:
                scaled_loss.backward()
            optimizer.step()
        return results(model)
    finally:
        amp.deinitialize()


def main(out):
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        found = {scenario: train(scenario, rank) for scenario in SCENARIOS}
        gradients = [torch.full((3,), float(rank + 1)), torch.full((2,), 10.0 * rank)]
        Reducer(gradients).reduce()  # apex's explicit all-reduce: the mean over ranks
        found["reducer"] = gradients
        # BERT's way: all-reduce (averaged) and broadcast tensors of mixed types, flattened.
        mixed = [torch.full((2,), float(rank)), torch.full((3,), 4.0 * rank).half()]
        flat_dist_call(mixed, dist.all_reduce)
        broadcast = [torch.full((2,), float(rank + 1)), torch.full((1,), rank + 7.0).double()]
        flat_dist_call(broadcast, dist.broadcast, (0,))
        found["flat_dist_call"] = mixed + broadcast
    finally:
        dist.destroy_process_group()
    torch.save(found, os.path.join(out, f"rank{rank}.pt"))


if __name__ == "__main__":
    main(sys.argv[1])
    ranks.leave()  # results written: no static destructors (gloo aborts in them)

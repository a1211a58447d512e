"""One rank of tests/weights/test_ddp_masters.py: ``python ddp_masters_rank.py OUT`` with RANK,
WORLD_SIZE, MASTER_ADDR and MASTER_PORT set. Each rank initialises its model from its own seed,
takes it through amp.initialize at O2, wraps it in torch's DistributedDataParallel and then in
apex.parallel's, and trains two steps on its own data. Writes OUT/rank<RANK>.pt: per wrapper, the
FP32 masters and the FP16 weights before the wrap, after it and after the steps."""

import sys

import torch
import torch.distributed as dist

import amp
from helpers import ranks


def flat(tensors):
    return torch.cat([t.detach().float().reshape(-1) for t in tensors])


def run(wrapper, rank):
    torch.manual_seed(rank)  # the ranks start from different weights
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = amp.initialize(
        model, optimizer, opt_level="O2", cast_model_type=torch.float16, verbosity=0
    )
    found = {}

    def record(when):
        found[when] = (flat(amp.master_params(optimizer)), flat(model.parameters()))

    try:
        record("before the wrap")
        model = wrapper(model)
        record("after the wrap")
        generator = torch.Generator().manual_seed(100 + rank)  # each rank its own data
        for _ in range(2):
            x = torch.randn(8, 16, generator=generator, dtype=torch.float16)
            loss = model(x).float().square().mean()
            with amp.scale_loss(loss, optimizer) as scaled:
                scaled.backward()
            optimizer.step()
            optimizer.zero_grad()
        record("after two steps")
    finally:
        amp.deinitialize()
    return found


def main(out):
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    import apex.parallel

    results = {
        "torch": run(torch.nn.parallel.DistributedDataParallel, rank),
        "apex": run(apex.parallel.DistributedDataParallel, rank),
    }
    torch.save(results, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
    ranks.leave()  # results written: no static destructors (gloo aborts in them)

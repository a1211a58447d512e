"""One rank of tests/diagnostics/test_origin.py's DDP test: ``python origin_ddp_rank.py OUT``
with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set. Rank 1's inputs overflow float16 in the
first layer from step 1 on; rank 0's are fine. Writes OUT/rank<RANK>.json."""

import json
import os
import sys
import warnings

import torch
import torch.distributed as dist

import amp
from helpers import ranks
from helpers.models import make_model


def main(out):
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = make_model(outputs=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O1", verbosity=0)
    model = torch.nn.parallel.DistributedDataParallel(model)
    result = {"origins": [], "scales": [], "warnings": []}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
            if rank == 1 and step >= 1:
                x = x * 1e6
            loss = model(x).float().pow(2).mean()
            with amp.scale_loss(loss, optimizer) as scaled:
                scaled.backward()
            optimizer.step()
            optimizer.zero_grad()
            report = amp.last_overflow()
            origin = None if report is None or report.origin is None else report.origin
            result["origins"].append(
                None if origin is None else [origin.module, origin.phase, origin.kind]
            )
            result["scales"].append(amp.state_dict()["loss_scaler0"]["loss_scale"])
    result["warnings"] = [str(w.message) for w in caught if w.category is amp.NonFiniteLossWarning]
    with open(os.path.join(out, f"rank{rank}.json"), "w") as file:
        json.dump(result, file)
    amp.deinitialize()
    dist.barrier()  # neither rank tears gloo down while the other still talks to it
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
    ranks.leave()  # results written: no static destructors (gloo aborts in them)

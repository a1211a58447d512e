"""Data-parallel training with amp and DistributedDataParallel, launched with torchrun.

amp.initialize comes first, DistributedDataParallel wraps the model it returns. Each rank trains
on its shard of scikit-learn's digits (gloo on CPU, NCCL on GPUs). The ranks start from different
random weights on purpose: DDP broadcasts rank 0's, and amp's FP32 masters follow.

An overflow seen by one rank only (--inject-overflow-rank) makes every rank skip that step and back
off its loss scale together: amp reduces the overflow flag across ranks.

    torchrun --nproc_per_node=2 examples/ddp.py
    torchrun --nproc_per_node=2 examples/ddp.py --opt-level O2 --inject-overflow-rank 1 --inject-overflow-step 3
    torchrun --nproc_per_node=2 examples/ddp.py --device cuda          # one GPU per process
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from common import (  # noqa: E402
    device_argument,
    distributed_arguments,
    init_distributed,
    leave_rank,
    opt_level_argument,
    progress,
    report_rank,
)
from common import parser as example_parser  # noqa: E402
from demo import load_digits, make_model  # noqa: E402

import amp  # noqa: E402


def main(argv=None):
    parser = example_parser(__doc__)
    device_argument(parser)
    opt_level_argument(parser, "O1")
    distributed_arguments(parser)
    args = parser.parse_args(argv)
    rank, world, device = init_distributed(args.device)

    train_x, train_y, test_x, test_y = load_digits(device)
    torch.manual_seed(1000 + rank)  # different weights per rank; DDP makes them rank 0's
    model = make_model().to(device)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.01)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, eps=1e-4)
    model, optimizer = amp.initialize(
        model, optimizer, opt_level=args.opt_level, dtype=getattr(torch, args.dtype), verbosity=0
    )
    model = torch.nn.parallel.DistributedDataParallel(
        model, device_ids=[device] if args.device == "cuda" else None
    )

    scales, skipped = [], []
    generator = torch.Generator().manual_seed(7)  # the same batch order on every rank
    steps = range(args.steps)
    for step in progress(steps, desc=f"rank {rank}") if rank == 0 else steps:
        index = torch.randint(0, len(train_x), (64 * world,), generator=generator)[rank::world].to(
            device
        )
        loss = F.cross_entropy(model(train_x[index]), train_y[index])
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
            if rank == args.inject_overflow_rank and step == args.inject_overflow_step:
                model.module[0].weight.grad.view(-1)[0] = float("inf")  # after DDP's all-reduce
        before = amp.last_overflow()
        optimizer.step()
        optimizer.zero_grad()
        if amp.last_overflow() is not before:
            skipped.append(step)
        scales.append(amp.state_dict()["loss_scaler0"]["loss_scale"])

    model.eval()
    with torch.no_grad():
        accuracy = (model(test_x).argmax(-1) == test_y).float().mean().item()
    state = {key: value.cpu() for key, value in model.module.state_dict().items()}
    report_rank(rank, args.out, state, scales, skipped, accuracy)
    amp.deinitialize()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    leave_rank()

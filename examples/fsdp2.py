"""Sharded data-parallel training with amp and FSDP2 (fully_shard), launched with torchrun.

Each rank holds a shard of every parameter and of the optimizer state, and trains on its share of
scikit-learn's digits (gloo on CPU, NCCL on GPUs). Two recipes:

  O1       fully_shard, then the optimizer, then amp.initialize(opt_level="O1"): amp casts around
           torch functions, the FP32 shards stay the parameters, amp.scale_loss scales.
  scaler   fully_shard(mp_policy=MixedPrecisionPolicy(param_dtype=...)): FSDP2 computes with
           low-precision parameters and keeps FP32 shards (what O2 does), amp.GradScaler scales.

amp.initialize at O2/O3 refuses a sharded model (the shards are the master weights already): use
the scaler recipe. An overflow seen by one rank only (--inject-overflow-rank, in that rank's own
shard) makes every rank skip the step and back off together.

    torchrun --nproc_per_node=2 examples/fsdp2.py
    torchrun --nproc_per_node=2 examples/fsdp2.py --recipe scaler --inject-overflow-rank 1 --inject-overflow-step 3
    torchrun --nproc_per_node=2 examples/fsdp2.py --device cuda          # one GPU per process
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
    progress,
    report_rank,
)
from common import parser as example_parser  # noqa: E402
from demo import load_digits, make_model  # noqa: E402

import amp  # noqa: E402


def shard(model, recipe, dtype):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = fp32 = MixedPrecisionPolicy()
    if recipe == "scaler":
        policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        # Batch norm stays in FP32, as at O2: its statistics are FP32 buffers.
        fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mp_policy=policy)
        elif isinstance(layer, torch.nn.BatchNorm1d):
            fully_shard(layer, mp_policy=fp32)
    fully_shard(model, mp_policy=policy)
    return model


def main(argv=None):
    parser = example_parser(__doc__)
    device_argument(parser)
    parser.add_argument(
        "--recipe",
        default="O1",
        choices=["O1", "scaler"],
        help="O1: amp.initialize at O1; scaler: FSDP2's MixedPrecisionPolicy with amp.GradScaler",
    )
    distributed_arguments(parser)
    args = parser.parse_args(argv)
    rank, world, device = init_distributed(args.device)
    dtype = getattr(torch, args.dtype)

    train_x, train_y, test_x, test_y = load_digits(device)
    model = shard(make_model().to(device), args.recipe, dtype)  # the same weights on every rank
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, eps=1e-4)  # after fully_shard
    scaler = None
    if args.recipe == "O1":
        model, optimizer = amp.initialize(
            model, optimizer, opt_level="O1", dtype=dtype, verbosity=0
        )
    else:
        scaler = amp.GradScaler()

    scales, skipped = [], []
    generator = torch.Generator().manual_seed(7)  # the same batch order on every rank
    steps = range(args.steps)
    for step in progress(steps, desc=f"rank {rank}") if rank == 0 else steps:
        index = torch.randint(0, len(train_x), (64 * world,), generator=generator)[rank::world].to(
            device
        )
        loss = F.cross_entropy(model(train_x[index]).float(), train_y[index])
        overflow = rank == args.inject_overflow_rank and step == args.inject_overflow_step
        if scaler is None:
            before = amp.last_overflow()
            with amp.scale_loss(loss, optimizer) as scaled_loss:
                scaled_loss.backward()
                if overflow:  # into this rank's shard of the gradient only
                    model[0].weight.grad.to_local().view(-1)[0] = float("inf")
            optimizer.step()
            if amp.last_overflow() is not before:
                skipped.append(step)
            scales.append(amp.state_dict()["loss_scaler0"]["loss_scale"])
        else:
            scale = scaler.get_scale()
            scaler.scale(loss).backward()
            if overflow:
                model[0].weight.grad.to_local().view(-1)[0] = float("inf")
            scaler.step(optimizer)
            scaler.update()
            if scaler.get_scale() < scale:
                skipped.append(step)
            scales.append(scaler.get_scale())
        optimizer.zero_grad()

    model.eval()
    with torch.no_grad():
        accuracy = (model(test_x).argmax(-1) == test_y).float().mean().item()
    # The FP32 parameters, gathered from the shards (batch-norm statistics stay per rank).
    state = {name: param.full_tensor().cpu() for name, param in model.named_parameters()}
    report_rank(rank, args.out, state, scales, skipped, accuracy)
    amp.deinitialize()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    leave_rank()

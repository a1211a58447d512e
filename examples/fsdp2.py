"""Sharded data-parallel training with amp and FSDP2 (fully_shard), launched with torchrun.

Each rank holds a shard of every parameter and of the optimizer state, and trains on its share of
scikit-learn's digits (gloo on CPU, NCCL on GPUs). Five recipes:

  O1       fully_shard, then the optimizer, then amp.initialize(opt_level="O1"): amp casts around
           torch functions, the FP32 shards stay the parameters, amp.scale_loss scales.
  O2       fully_shard, then the optimizer, then amp.initialize(opt_level="O2"): each rank holds
           its low-precision shards and their masters' rests (a bf16 shard's exact FP32 value in
           4 bytes), moments FP32, stepped on its shards; 12 bytes a parameter of its share, FSDP2
           gathers low precision. FSDP2 reduces gradients in FP32 (MixedPrecisionPolicy's
           reduce_dtype); batch norm, kept FP32, is sharded on its own.
  compact  O2 with master_weights="compact": an 8-bit correction beside each bf16 shard (11
           bytes; bfloat16 whatever --dtype says).
  compact-int8
           compact, and AdamW's moments in 8 bits where a weight's rows are whole blocks of 32
           (FP32 elsewhere): about 5.3 bytes; its checkpoints load at any number of ranks too.
  scaler   fully_shard(mp_policy=MixedPrecisionPolicy(param_dtype=...)): FSDP2 computes with
           low-precision parameters and keeps FP32 shards, amp.GradScaler scales (12 bytes).

An overflow seen by one rank only (--inject-overflow-rank, in that rank's own shard) makes every
rank skip the step and back off together. --save writes a distributed checkpoint at the end
(torch's get_state_dict and torch.distributed.checkpoint, amp.state_dict() beside), --resume
starts from one: at O2 it loads at any number of ranks, bit for bit.

    torchrun --nproc_per_node=2 examples/fsdp2.py
    torchrun --nproc_per_node=2 examples/fsdp2.py --recipe compact --save /tmp/fsdp2-checkpoint
    torchrun --nproc_per_node=1 examples/fsdp2.py --recipe compact --resume /tmp/fsdp2-checkpoint
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

O2_RECIPES = {
    "O2": dict(master_weights=True),
    "compact": dict(master_weights="compact"),
    "compact-int8": dict(master_weights="compact", optimizer_state="int8"),
}


def shard(model, recipe, dtype):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = fp32 = MixedPrecisionPolicy()
    if recipe == "scaler":
        policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        # Batch norm stays in FP32, as at O2: its statistics are FP32 buffers.
        fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    elif recipe in O2_RECIPES:  # amp casts; FSDP2 sums the ranks' gradients in FP32
        policy = MixedPrecisionPolicy(reduce_dtype=torch.float32)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mp_policy=policy)
        elif isinstance(layer, torch.nn.BatchNorm1d):  # its own group: it stays FP32 at O2
            fully_shard(layer, mp_policy=fp32)
    fully_shard(model, mp_policy=policy)
    return model


def checkpoint(model, optimizer, path, load):
    """Save (or, `load`, resume) the model, the optimizer (each parameter's shard, its master's
    rest and its moments, under the model's names) and amp's loss scales: torch's distributed
    checkpoint, which reshards at load."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)  # a load's template too
    state = {"model": model_state, "optimizer": optimizer_state}
    if not load:
        dcp.save(state, checkpoint_id=path)
        if dist.get_rank() == 0:
            torch.save(amp.state_dict(), os.path.join(path, "amp.pt"))
        return
    dcp.load(state, checkpoint_id=path)
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
    )
    amp.load_state_dict(torch.load(os.path.join(path, "amp.pt")))


def main(argv=None):
    parser = example_parser(__doc__)
    device_argument(parser)
    parser.add_argument(
        "--recipe",
        default="O1",
        choices=["O1", *O2_RECIPES, "scaler"],
        help="O1 or O2: amp.initialize at that level; compact: O2 with compact masters; "
        "compact-int8: and 8-bit moments; scaler: FSDP2's MixedPrecisionPolicy with "
        "amp.GradScaler",
    )
    parser.add_argument("--save", help="folder for a distributed checkpoint at the end")
    parser.add_argument("--resume", help="a distributed checkpoint to start from")
    distributed_arguments(parser)
    args = parser.parse_args(argv)
    rank, world, device = init_distributed(args.device)
    dtype = torch.bfloat16 if args.recipe.startswith("compact") else getattr(torch, args.dtype)

    train_x, train_y, test_x, test_y = load_digits(device)
    model = shard(make_model().to(device), args.recipe, dtype)  # the same weights on every rank
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, eps=1e-4)  # after fully_shard
    scaler = None
    if args.recipe == "scaler":
        scaler = amp.GradScaler()
    else:
        level = "O1" if args.recipe == "O1" else "O2"
        options = O2_RECIPES.get(args.recipe, {})
        model, optimizer = amp.initialize(
            model, optimizer, opt_level=level, dtype=dtype, verbosity=0, **options
        )
    if args.resume:
        checkpoint(model, optimizer, args.resume, load=True)

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

    if args.save:
        checkpoint(model, optimizer, args.save, load=False)
    model.eval()
    with torch.no_grad():
        accuracy = (model(test_x).argmax(-1) == test_y).float().mean().item()
    # The FP32 values (at O2 the masters), gathered from the shards (batch-norm statistics stay
    # per rank).
    values = model.state_dict()
    state = {name: values[name].full_tensor().cpu() for name, _ in model.named_parameters()}
    report_rank(rank, args.out, state, scales, skipped, accuracy)
    amp.deinitialize()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    leave_rank()

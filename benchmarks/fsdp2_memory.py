"""Per-rank memory of O2 under FSDP2: bytes a parameter of a rank's share (the model's parameters
over the world size) held between steps, on each rank, for FSDP2's own mixed precision and amp O2
with exact masters, compact masters, and compact masters with 8-bit moments (held by the weights
whose rows are whole blocks of 32; the biases and norms keep FP32 moments: amp/weights/forms.py);
a small transformer with a head of 100, AdamW, bf16, CPU with gloo.

    torchrun --nproc_per_node=2 benchmarks/fsdp2_memory.py

Counted on each rank when a step begins (after two warm-up steps, the gradients dropped by
zero_grad(set_to_none=True), garbage collected): every storage of a tensor Python can reach
(gc's objects, a DTensor through its local shard), each once, less those alive before the model
was built (the batch). By kind: the local shards of the parameters as FSDP2 keeps them (padded to
an even split), amp's rests of the masters, the optimizer's state (moments, step counts, 8-bit
scales), what FSDP2 holds gathered; "other" is the rest of the total (a process-wide table: the
8-bit codes' dither, 256 KiB). Allocations no Python tensor holds (gloo's buffers) are not
counted.
"""

import argparse
import gc
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "examples"))
from common import leave_rank  # noqa: E402
from harness import print_table  # noqa: E402

import amp  # noqa: E402

KINDS = ("weights", "rests", "optimizer state", "gathered", "gradients")
RECIPES = {
    "FSDP2 mixed precision": None,  # FP32 shards, MixedPrecisionPolicy(param_dtype=bf16)
    "amp O2 exact": dict(master_weights=True),
    "amp O2 compact": dict(master_weights="compact"),
    "amp O2 compact + int8": dict(master_weights="compact", optimizer_state="int8"),
}
VOCAB, LENGTH, BATCH = 100, 32, 8


class SmallLM(torch.nn.Module):
    """Embedding, `layers` transformer encoder layers, LayerNorm, a head of VOCAB (100)."""

    def __init__(self, width, layers, heads=4):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, width)
        self.layers = torch.nn.ModuleList(
            torch.nn.TransformerEncoderLayer(
                width, heads, 4 * width, dropout=0.0, batch_first=True
            )
            for _ in range(layers)
        )
        self.norm = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, VOCAB)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x).flatten(0, 1))  # 2-D: a new tensor, not a view (FSDP2 warns)


def build(recipe, width, layers):
    """(model, optimizer, step function), set up in the order the recipe asks for."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    options = RECIPES[recipe]
    param_dtype = torch.bfloat16 if options is None else None  # O2: amp casts
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    model = SmallLM(width, layers)
    for layer in model.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if options is not None:
        model, optimizer = amp.initialize(
            model, optimizer, opt_level="O2", dtype=torch.bfloat16, verbosity=0, **options
        )

    def step(tokens):
        loss = F.cross_entropy(model(tokens).float(), tokens.flatten())
        if options is None:
            loss.backward()
        else:
            with amp.scale_loss(loss, optimizer) as scaled:
                scaled.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return model, optimizer, step


def by_kind(model, optimizer):
    """{kind: bytes} of the tensors this rank holds for the run, each storage once."""
    seen, found = set(), {}

    def count(kind, tensor):
        tensor = getattr(tensor, "_local_tensor", tensor)
        storage = tensor.untyped_storage()
        if storage.data_ptr() and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            found[kind] = found.get(kind, 0) + storage.nbytes()

    for module in model.modules():
        state = getattr(module, "_get_fsdp_state", None)
        for group in state()._fsdp_param_groups if state else ():
            for fsdp_param in group.fsdp_params:
                count("weights", fsdp_param._sharded_param_data)
                for gathered in fsdp_param.all_gather_outputs:
                    count("gathered", gathered)
    record = vars(optimizer).get("_amp_record")
    for rest in record.owner.rests() if record is not None else ():
        count("rests", rest)
    for entry in optimizer.state.values():
        for value in entry.values():
            if isinstance(value, torch.Tensor):
                count("optimizer state", value)
    for param in model.parameters():
        if param.grad is not None:
            count("gradients", param.grad)
    return found


# Tensors without memory of their own that another program in the process may have left alive.
_NO_MEMORY = (FakeTensor, FunctionalTensor)


def live_storages():
    """{data pointer: bytes} of every storage of a tensor Python can reach."""
    gc.collect()
    found = {}
    for obj in gc.get_objects():
        kind = type(obj)  # not isinstance: torch's reduce_op object warns
        if issubclass(kind, torch.Tensor) and not issubclass(kind, _NO_MEMORY):
            storage = getattr(obj, "_local_tensor", obj).untyped_storage()
            if storage.data_ptr():
                found[storage.data_ptr()] = storage.nbytes()
    return found


def measure(recipe, width, layers):
    """{column: bytes a parameter of this rank's share} of one recipe, or {"refused": why}."""
    tokens = torch.randint(0, VOCAB, (BATCH, LENGTH), generator=torch.Generator().manual_seed(1))
    before = live_storages()
    try:
        model, optimizer, step = build(recipe, width, layers)
    except RuntimeError as error:
        return {"refused": str(error).split(", and ", 1)[-1][:70] + "..."}
    try:
        for _ in range(2):
            step(tokens)
        live = live_storages()
        kinds = by_kind(model, optimizer)
    finally:
        amp.deinitialize()
    total = sum(size for pointer, size in live.items() if pointer not in before)
    share = sum(p.numel() for p in model.parameters()) / dist.get_world_size()
    row = {kind: kinds.get(kind, 0) / share for kind in KINDS}
    row["other"] = (total - sum(kinds.values())) / share
    row["between steps"] = total / share
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args(argv)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    count = sum(p.numel() for p in SmallLM(args.width, args.layers).parameters())
    columns = ["recipe", *KINDS, "other", "between steps", "refused"]
    rows = [{"recipe": recipe, **measure(recipe, args.width, args.layers)} for recipe in RECIPES]
    for shown in range(world):  # each rank's table, in turn
        if shown == rank:
            print_table(
                f"rank {rank} of {world}: bytes a parameter of its share ({count:,} parameters"
                f" / {world}), width {args.width}, {args.layers} layers, head {VOCAB}",
                rows,
                columns,
            )
            sys.stdout.flush()
        dist.barrier()


if __name__ == "__main__":
    main()
    leave_rank()  # its table printed: no static destructors (gloo aborts in them)

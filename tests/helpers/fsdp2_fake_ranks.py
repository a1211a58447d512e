"""One rank of two under FSDP2 in one process, for tests/weights/test_fsdp2.py: torch's fake
process group (its collectives do nothing), so a rank steps its shards of gradients it is given,
as each rank of a real job steps the reduced ones; and the same model replicated, the same
gradients whole. Each rank in its own process (a device mesh keeps the rank it was made on).

Run as ``python tests/helpers/fsdp2_fake_ranks.py OUT`` with RANK set (helpers.ranks.run_ranks);
writes OUT/fake-rank<RANK>.pt: {form: (the rank's tensors, the replicated ones' rows of it)}.
"""

import os
import sys

import torch
import torch.distributed as dist

import amp
from helpers import ranks

WORLD, STEPS = 2, 3
FORMS = {
    "compact-bf16": dict(master_weights="compact", optimizer_state="bf16"),
    "compact-int8": dict(master_weights="compact", optimizer_state="int8"),
}


def make_model():
    """[100, 48] (split at row 50: element 2400; rows of 48, no blocks), a bias of 100 (split at
    50, inside a block), [64, 100], and [64, 64] (rows of whole blocks: split at element 2048)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(48, 100),
        torch.nn.ReLU(),
        torch.nn.Linear(100, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 64),
    )


def _rows(tensor, rank):
    """Rank `rank`'s rows of a whole tensor, as FSDP2's Shard(0) splits it (torch.chunk)."""
    chunk = -(-tensor.shape[0] // WORLD)
    return tensor[rank * chunk : (rank + 1) * chunk]


def run(form, rank=None):
    """{name: tensor} after STEPS steps of AdamW: weights, masters' rests, optimizer state; the
    local shards of `rank` (None: replicated, whole)."""
    model = make_model()
    if rank is not None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=init_device_mesh("cpu", (WORLD,)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    model, optimizer = amp.initialize(
        model, optimizer, opt_level="O2", dtype=torch.bfloat16, verbosity=0, **FORMS[form]
    )
    params = list(model.parameters())
    for step in range(STEPS):
        generator = torch.Generator().manual_seed(step)
        for param in params:
            grad = (torch.randn(param.shape, generator=generator) * 0.1).to(param.dtype)
            if rank is not None:
                grad = type(param).from_local(
                    _rows(grad, rank), param.device_mesh, param.placements, run_check=False,
                    shape=param.shape, stride=param.stride(),
                )
            param.grad = grad
        optimizer.step()
        optimizer.zero_grad()
    found = {}
    owner = vars(optimizer)["_amp_record"].owner
    for number, (param, rest) in enumerate(zip(params, owner.rests())):
        found[f"{number} weight"] = param.detach()
        found[f"{number} rest"] = rest
        for key, value in optimizer.state[param].items():
            found[f"{number} {key}"] = value
    found = {k: getattr(v, "_local_tensor", v).clone() for k, v in found.items()}
    amp.deinitialize()
    return found


def main(out):
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    results = {}
    for form in FORMS:
        whole = run(form)
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", rank=rank, world_size=WORLD, store=FakeStore())
        try:
            sharded = run(form, rank)
        finally:
            dist.destroy_process_group()
        rows = {k: v if v.dim() == 0 else _rows(v, rank) for k, v in whole.items()}
        results[form] = (sharded, rows)
    torch.save(results, os.path.join(out, f"fake-rank{rank}.pt"))


if __name__ == "__main__":
    main(sys.argv[1])
    ranks.leave()

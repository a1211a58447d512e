"""O2 under FSDP2 for tests/weights/test_fsdp2.py: one rank of a gloo job of one or two ranks.

Run as ``python tests/helpers/fsdp2_ranks.py OUT JOB`` (helpers.ranks.run_ranks) with RANK,
WORLD_SIZE, MASTER_ADDR and MASTER_PORT set; this rank's results go to OUT/<JOB>-rank<RANK>.pt,
one entry per form of FORMS.

- "one" (1 rank): each form trains the global batches at world size 1 (an inf at OVERFLOW_STEP
  too) and saves a distributed checkpoint (OUT/<form>-one). (test_fsdp2.py trains so in its own
  process too, sharded over a group of one rank and not.)
- "two" (2 ranks): each form trains STEPS steps on this rank's share (accumulation over two
  micro-batches with delay_unscale, reduced as they come or once: NO_SYNC; a second loss of its
  own scaler; clipping through amp.master_params or the model: CLIP_MODEL), rank 1 alone
  putting an inf into its shard of the head's bias gradient at OVERFLOW_STEP; saves a checkpoint
  after CHECKPOINT_STEP (OUT/<form>-mid) and at the end (OUT/<form>-two); resumes the mid one in
  a fresh model and optimizer to the end; loads the world-size-1 checkpoint. For MOMENT_FORMS,
  amp.initialize's refusal of a model sharded along dim 1 (shard_placement_fn) too.
- "load" (1 rank): loads the 2-rank end checkpoint at world size 1.

"Gathered" is what torch's get_state_dict(full_state_dict=True) gives: the model's FP32 values
and every optimizer state tensor (rests, moments, step counts), whole.
"""

import datetime
import os
import sys
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F

import amp
from helpers import ranks

FORMS = {
    "exact": dict(master_weights=True),
    "compact": dict(master_weights="compact"),
    "fp16": dict(master_weights=True, dtype=torch.float16),
    "compact-int8": dict(master_weights="compact", optimizer_state="int8"),
    "compact-bf16": dict(master_weights="compact", optimizer_state="bf16"),
}
MOMENT_FORMS = ("compact-int8", "compact-bf16")  # moments that depend on an element's place
# clipping through amp.master_params, or torch's clip_grad_norm_ on the model's gradients; and
# micro-batches reduced as they come, or once (FSDP2's set_requires_gradient_sync(False) before)
CLIP_MODEL = NO_SYNC = ("compact",)
STEPS, OVERFLOW_STEP, CHECKPOINT_STEP, MAX_NORM = 4, 1, 2, 0.5
WORLD, MICRO, BATCH, INPUTS, HIDDEN, CLASSES = 2, 2, 4, 8, 32, 100


def make_model():
    """Linear(8, 32), LayerNorm, ReLU, Linear(32, 100): a head of 100, whose bias splits at
    element 50 over two ranks (inside a block of 32); its weight's rows are a block each (8-bit
    codes under "int8", split at element 1600), the first weight's 8 (FP32 moments)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(INPUTS, HIDDEN),
        torch.nn.LayerNorm(HIDDEN),
        torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, CLASSES),
    )


def shard(model, reduce_fp32, placement=None):
    """fully_shard over the layers and the model; `placement`: a weight's shard_placement_fn."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(reduce_dtype=torch.float32 if reduce_fp32 else None)
    for layer in (model[0], model[3]):
        fully_shard(layer, mp_policy=policy, shard_placement_fn=placement)
    fully_shard(model, mp_policy=policy)
    return model


def build(form, sharded=True):
    """fully_shard (exact masters reduce in FP32), then the optimizer, then amp.initialize."""
    model = make_model()
    if sharded:
        shard(model, reduce_fp32=form == "exact")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    options = {"dtype": torch.bfloat16, **FORMS[form]}
    return amp.initialize(model, optimizer, opt_level="O2", num_losses=2, verbosity=0, **options)


def batch(step, shares, micro):
    """(inputs, targets) of micro-batch `micro` of the global batch of `step`, the ranks' shares
    `shares` of it (a rank's own; both, on one rank)."""
    generator = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(WORLD, MICRO, BATCH, INPUTS, generator=generator)
    y = torch.randint(0, CLASSES, (WORLD, MICRO, BATCH), generator=generator)
    return torch.cat([x[r, micro] for r in shares]), torch.cat([y[r, micro] for r in shares])


def _local(tensor):
    return getattr(tensor, "_local_tensor", tensor)


def train_step(model, optimizer, step, shares, form, overflow=False):
    """One step: MICRO micro-batches of the first loss (delay_unscale), then a second loss with
    its own scaler; clipping through amp.master_params (or the model's gradients). Returns (the
    clipping's total norm, this rank's gradients' norm, every rank's gradients' norm)."""
    sync = getattr(model, "set_requires_gradient_sync", None)  # fully_shard's
    for micro in range(MICRO):
        inputs, targets = batch(step, shares, micro)
        loss = F.cross_entropy(model(inputs).float(), targets) / MICRO
        last = micro == MICRO - 1
        if sync is not None and form in NO_SYNC:
            sync(last)
        with amp.scale_loss(loss, optimizer, loss_id=0, delay_unscale=not last) as scaled:
            scaled.backward()
    inputs, _ = batch(step, shares, 0)
    second = model(inputs).float().square().mean() * 1e-3
    with amp.scale_loss(second, optimizer, loss_id=1) as scaled:
        scaled.backward()
        if overflow:  # this rank's shard of the head's bias only
            _local(model[3].bias.grad).view(-1)[0] = float("inf")
    clip_model = form in CLIP_MODEL
    params = list(model.parameters() if clip_model else amp.master_params(optimizer))
    squares = sum(_local(p.grad).double().square().sum() for p in params)
    local = float(squares.sqrt())
    if dist.is_initialized():
        dist.all_reduce(squares)
    norm = torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
    optimizer.step()
    optimizer.zero_grad()
    return float(getattr(norm, "full_tensor", lambda: norm)()), local, float(squares.sqrt())


def local_bits(model, optimizer):
    """Every tensor this rank holds of the run, local shards: weights, rests, state."""
    owner = vars(optimizer)["_amp_record"].owner
    found = {f"weight {n}": p._local_tensor.clone() for n, p in model.named_parameters()}
    for name, param in model.named_parameters():
        for key, value in optimizer.state[param].items():
            found[f"{key} {name}"] = _local(value).clone()
    for row, rest in enumerate(owner.rests()):
        found[f"rest {row}"] = rest._local_tensor.clone()
    return found


def gathered(model, optimizer):
    """The full state: model FP32 values and optimizer state, whole, as torch gathers them."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(full_state_dict=True)
    model_state, optimizer_state = get_state_dict(model, optimizer, options=options)
    return {
        "model": {k: v.detach().clone() for k, v in model_state.items()},
        "optimizer": {
            name: {k: v.detach().clone() for k, v in entry.items()}
            for name, entry in optimizer_state["state"].items()
        },
        "amp": amp.state_dict(),
    }


def save(model, optimizer, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=path)
    torch.save(amp.state_dict(), f"{path}/amp-rank{dist.get_rank()}.pt")


def load(model, optimizer, path):
    """get_state_dict for the shapes to load into, dcp.load, set_state_dict; amp's beside."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)
    loaded = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(loaded, checkpoint_id=path)
    set_state_dict(
        model, optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optimizer"]
    )
    amp.load_state_dict(torch.load(f"{path}/amp-rank0.pt"))


# -- the jobs -----------------------------------------------------------------------------------


def two(out, form, rank):
    dim_1 = refused(form) if form in MOMENT_FORMS else None
    model, optimizer = build(form)
    steps, before_skip, after_skip = [], None, None
    for step in range(STEPS):
        overflow = step == OVERFLOW_STEP
        if overflow:
            before_skip = local_bits(model, optimizer)
        previous = amp.last_overflow()
        norms = train_step(model, optimizer, step, (rank,), form, overflow and rank == 1)
        report = amp.last_overflow()
        steps.append({
            "scales": [scaler["loss_scale"] for scaler in amp.state_dict().values()],
            "overflow": None if report is previous else report.params,
            "norms": norms,
        })
        if overflow:
            after_skip = local_bits(model, optimizer)
        if step == CHECKPOINT_STEP:
            save(model, optimizer, f"{out}/{form}-mid")
    end, end_local = gathered(model, optimizer), local_bits(model, optimizer)
    save(model, optimizer, f"{out}/{form}-two")
    amp.deinitialize()

    model, optimizer = build(form)  # a fresh run resumes the mid checkpoint
    load(model, optimizer, f"{out}/{form}-mid")
    for step in range(CHECKPOINT_STEP + 1, STEPS):
        train_step(model, optimizer, step, (rank,), form)
    resumed, resumed_local = gathered(model, optimizer), local_bits(model, optimizer)
    amp.deinitialize()

    model, optimizer = build(form)  # the world-size-1 checkpoint, at world size 2
    load(model, optimizer, f"{out}/{form}-one")
    from_one = gathered(model, optimizer)
    amp.deinitialize()
    return {
        "steps": steps, "before skip": before_skip, "after skip": after_skip,
        "end": end, "end local": end_local, "resumed": resumed, "resumed local": resumed_local,
        "from one": from_one, "dim 1": dim_1,
    }


def refused(form):
    """amp.initialize's error for `form` over two ranks of a model whose weights are sharded
    along dim 1, and whether the model and optimizer are as they were."""
    from torch.distributed.tensor import Shard

    placement = lambda param: Shard(1) if param.dim() == 2 else None  # noqa: E731
    model = shard(make_model(), reduce_fp32=False, placement=placement)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = {n: p._local_tensor.clone() for n, p in model.named_parameters()}
    try:
        options = {"dtype": torch.bfloat16, **FORMS[form]}
        amp.initialize(model, optimizer, opt_level="O2", verbosity=0, **options)
    except RuntimeError as error:
        now = {n: p._local_tensor for n, p in model.named_parameters()}
        unchanged = all(
            now[n].dtype is torch.float32 and torch.equal(now[n], before[n]) for n in before
        )
        return {"error": str(error), "unchanged": unchanged and not optimizer.state}
    return {"error": None}


def train_globally(form, sharded=True, path=None):
    """(model, optimizer) trained on every rank's share of the global batches (the skip two
    ranks make too); saved after CHECKPOINT_STEP to `path`, if given."""
    model, optimizer = build(form, sharded)
    for step in range(STEPS):
        train_step(model, optimizer, step, range(WORLD), form, step == OVERFLOW_STEP)
        if path is not None and step == CHECKPOINT_STEP:
            save(model, optimizer, path)
    return model, optimizer


def one(out, form, rank):
    model, optimizer = train_globally(form)
    end = gathered(model, optimizer)
    save(model, optimizer, f"{out}/{form}-one")
    amp.deinitialize()
    return {"end": end}


def load_two(out, form, rank):
    model, optimizer = build(form)
    load(model, optimizer, f"{out}/{form}-two")
    from_two = gathered(model, optimizer)
    amp.deinitialize()
    return {"from two": from_two}


JOBS = {"one": one, "two": two, "load": load_two}


def main(out, job):
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    results = {}
    for form in FORMS:
        try:
            results[form] = JOBS[job](out, form, rank)
        except Exception:
            results[form] = {"crash": traceback.format_exc()}
        finally:
            amp.deinitialize()
    torch.save(results, os.path.join(out, f"{job}-rank{rank}.pt"))


if __name__ == "__main__":
    main(*sys.argv[1:3])
    ranks.leave()  # results written: no static destructors (gloo aborts in them)

"""FP8 weights made once per optimizer step: both layouts of each weight an FP8 linear trains,
served to every forward (and its backward) of the micro-batches between two steps.

A weight's layouts are served while all of these hold, else it is cast again:
- no optimizer step has run since they were made: torch.optim's global step post-hook, which
  amp's fused O2 step runs too (it writes the weights through raw pointers on CuPy, so no version
  counter sees that write), drops every weight's layouts;
- the weight's version counter, data pointer, dtype and shape are those it was cast from (a
  write by a torch operation, `load_state_dict`, `param.data = ...`);
- the call trains the weight (grad mode on, a leaf that requires grad). Other calls (evaluation,
  no_grad, frozen or computed weights) cast it afresh and keep nothing, so code that swaps
  weights in for evaluation is never answered from the cache.
Not seen: a write that bypasses the version counter (in place through `param.data`, or raw
pointers) between two training forwards with no optimizer step between them; write under
torch.no_grad() on the parameter itself instead.

The first training forward after a step casts, in one launch pair, every weight FP8 linears
trained in this or the last window between steps (the same device, dtype and recipe). Between
steps nothing is held: the layouts are dropped with the step. `amp.deinitialize()` empties the
cache and removes its hook (an undo in its ledger).
"""

import weakref

import torch
from torch.optim import optimizer as torch_optimizer

from .._state import amp_state
from ..kernels import float8 as kernels8
from ..lists.float8_recipes import Float8Recipe

__all__ = ["scalings", "WeightCache", "CACHE", "layouts"]

_register_step_hook = torch_optimizer.register_optimizer_step_post_hook


def scalings(recipe: Float8Recipe):
    """How a tensor's row-major and transposed FP8 layouts are scaled under `recipe`."""
    if recipe.rowwise:
        return kernels8.ROW, kernels8.COLUMN
    return kernels8.TENSOR, kernels8.TENSOR


def _mark(weight):
    return weight._version, weight.data_ptr(), weight.dtype, weight.shape


class _Entry:
    __slots__ = ("ref", "recipe", "mark", "casts", "used")


class WeightCache:
    """kernels.float8.Float8Casts of weights by the weight's id, with the step they serve."""

    def __init__(self):
        self._entries = {}
        self.epoch = 0  # optimizer steps seen while the cache held entries
        self._hook = None  # the step post-hook's handle, while there are entries
        self._ledger = None  # amp's ledger whose restore clears the cache

    def __len__(self):
        return len(self._entries)

    def layouts(self, weight: torch.Tensor, recipe: Float8Recipe) -> kernels8.Float8Cast:
        """Both FP8 layouts of `weight` (2-D) under `recipe`, made since the last step."""
        entry = self._entries.get(id(weight))
        if (
            entry is not None
            and entry.casts is not None
            and entry.recipe is recipe
            and entry.mark == _mark(weight)
        ):
            entry.used = self.epoch
            return entry.casts
        return self._refresh(weight, recipe)

    def _refresh(self, weight, recipe):
        """Cast `weight` and, in the same launches, the recent weights of its kind to be cast."""
        weights = [weight]
        # A list: a weight freed meanwhile (its weakref's callback) leaves the dict.
        for entry in list(self._entries.values()):
            other = entry.ref()
            if (
                other is None
                or other is weight
                or entry.recipe is not recipe
                or entry.used < self.epoch - 1
                or other.device != weight.device
                or other.dtype is not weight.dtype
            ):
                continue
            if entry.casts is None or entry.mark != _mark(other):
                weights.append(other)
        by_row, by_col = scalings(recipe)
        casts = kernels8.cast(
            weights, recipe.input_dtype, by_row, by_col, recipe.power_of_2_scales
        )
        for made, cast in zip(weights, casts):
            self._store(made, recipe, cast)
        return casts[0]

    def _store(self, weight, recipe, casts):
        key = id(weight)
        entry = self._entries.get(key)
        if entry is None:
            entry = _Entry()
            entry.ref = weakref.ref(weight, lambda ref, key=key: self._gone(key, ref))
            if self._hook is None:
                self._hook = _register_step_hook(self._stepped)
            self._entries[key] = entry
        ledger = amp_state.ledger
        if ledger is not None and ledger is not self._ledger:
            ledger.add_undo("the FP8 weight cache", self.clear)
            self._ledger = ledger
        entry.recipe, entry.mark, entry.casts, entry.used = recipe, _mark(weight), casts, self.epoch

    def _gone(self, key, ref):
        entry = self._entries.get(key)
        if entry is not None and entry.ref is ref:
            del self._entries[key]
            if not self._entries:
                self._unhook()

    def _stepped(self, optimizer, args, kwargs):
        """A step may have written any weight: every layout is dropped."""
        self.epoch += 1
        for entry in list(self._entries.values()):
            entry.casts = None

    def _unhook(self):
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def clear(self):
        """Forget every weight and remove the step hook."""
        self._entries.clear()
        self._unhook()
        self._ledger = None


CACHE = WeightCache()


def layouts(
    weight: torch.Tensor, recipe: Float8Recipe, train: bool, transposed: bool
) -> kernels8.Float8Cast:
    """The FP8 layouts of `weight` for one call: from the cache where the call trains it (`train`:
    it gets a gradient; a leaf), else cast afresh, the transposed layout only where asked."""
    if train and weight.is_leaf:
        return CACHE.layouts(weight, recipe)
    by_row, by_col = scalings(recipe)
    return kernels8.cast(
        [weight], recipe.input_dtype, by_row, by_col if transposed else None,
        recipe.power_of_2_scales,
    )[0]

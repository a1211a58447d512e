"""What an optimizer amp steps keeps for each parameter, in the parameter's own optimizer state
entry: the rest of a cast parameter's master (`master`, `master_remainder` or
`master_correction`: rows.MasterForm), its moments in their stored form and torch's `step`.

The moments of the cast parameters, and of the FP32 ones kept FP32 (batch norm's), are held as
the `moments` option says: "fp32" under torch's own keys (`exp_avg`, `exp_avg_sq`,
`momentum_buffer`); "bf16" under `<moment>_bf16`; "int8" as `<moment>_codes` (int8 softsign
codes for a signed moment, uint8 square-root codes for Adam's second) and `<moment>_scales`
(kernels.moment_encode's block scales, laid out as the parameter's rows: [rows, row / 32]).
8-bit codes are held by parameters whose rows are whole blocks of 32 (two dims or more: a
weight's), so that a shard of whole rows (FSDP2's) holds whole blocks and the scales shard as
the parameter does; the others (biases, norms) keep FP32 moments under "int8" (FP32: the form
of `in_form`). A plain torch optimizer never takes those keys for its own. Parameters of other
dtypes (a float64 one) keep torch's format: moments of their dtype.

An entry converts from torch's format, or any of these forms (`from_torch`: a checkpoint of
another form, state loaded before amp.initialize, the dtypes torch's load cast), and back
(`to_torch`: deinitialize).
"""

import operator
from typing import NamedTuple, Optional

import torch

from .. import distributed, kernels
from .rows import MasterForm

__all__ = ["MOMENTS", "FP32", "Layout", "StateForm", "check_entry", "torch_entry", "coded"]

# The moments of each kind of step, and whether each is signed (kernels.moment_encode's `signed`)
MOMENTS = {"adam": (("exp_avg", True), ("exp_avg_sq", False)), "sgd": (("momentum_buffer", True),)}
_MASTER_KEYS = frozenset(MasterForm.KEYS.values())
_SUFFIXES = ("", "_bf16", "_codes", "_scales")
FP32 = "fp32"  # in_form's answer for a parameter whose moments are FP32 under "int8"


def coded(param):
    """Whether `param` (a DTensor: its whole shape) holds 8-bit codes under "int8": two dims or
    more, rows of whole blocks (a shard of whole rows then starts at a block)."""
    if param.dim() < 2 or param.shape[0] == 0:
        return False
    return (param.numel() // param.shape[0]) % kernels.MOMENT_BLOCK == 0


class Layout(NamedTuple):
    """Where a step finds its tensors in the state entries of one kind of parameter (one
    (momentum, in_form) of a StateForm): `read(entry)` gives the tensors of `keys` (a tuple,
    or the one tensor where there is one key; None: no key), at the positions `moments` (one per
    moment of the kind; None where SGD has no momentum), `scales` (the block scales of 8-bit
    codes) and `steps` (Adam's step count, else None). A stepped entry holds every key of
    `needed`. `sized`: the key of a tensor with an element per element of the parameter (its
    first moment; None: none), whose size a step checks."""

    keys: tuple
    read: Optional[operator.itemgetter]
    moments: tuple
    scales: tuple
    steps: Optional[int]
    needed: tuple
    sized: Optional[str]


class StateForm:
    """How one optimizer amp steps keeps its state: `kind` ("adam" or "sgd"), the `master` form
    of its cast parameters (rows.MasterForm) and `moments` ("fp32", "bf16" or "int8");
    `layouts[(momentum, in_form)]`, where a step finds what it reads (Layout)."""

    def __init__(self, kind, master, moments):
        self.kind, self.master, self.moments = kind, master, moments
        self.moment_names = MOMENTS[kind]
        self.layouts = {
            (momentum, in_form): self._layout(momentum, in_form)
            for momentum in (True, False)
            for in_form in (True, False, FP32)
        }
        # (shape, dtype, cast) -> in_form, what a step looks up (a C-level get) instead of
        # calling in_form for every parameter: it depends on nothing else.
        self.in_forms = {}

    def _layout(self, momentum, in_form):
        keys, moments, scales = [], [], []
        for moment, _ in self.moment_names:
            if moment == "momentum_buffer" and not momentum:
                moments.append(None)
                continue
            held = self.keys(moment, in_form)
            moments.append(len(keys))
            if len(held) == 2:
                scales.append(len(keys) + 1)
            keys.extend(held)
        steps = None
        if self.kind == "adam":
            steps = len(keys)
            keys.append("step")
        needed = tuple(key for key in keys if not key.endswith("_scales"))
        read = operator.itemgetter(*keys) if keys else None
        sized = keys[0] if keys and keys[0] != "step" else None
        return Layout(tuple(keys), read, tuple(moments), tuple(scales), steps, needed, sized)

    def in_form(self, param, cast):
        """Whether `param`'s moments take the form (a cast parameter or an FP32 one), else
        torch's format (False); FP32 where the form is "int8" and `param` holds no codes."""
        if not (cast or param.dtype is torch.float32):
            return False
        return FP32 if self.moments == "int8" and not coded(param) else True

    def keys(self, moment, in_form=True):
        """The state keys a moment is held under."""
        if self.moments == "fp32" or not in_form or in_form == FP32:
            return (moment,)
        if self.moments == "bf16":
            return (f"{moment}_bf16",)
        return (f"{moment}_codes", f"{moment}_scales")

    def _used(self, momentum):
        return [(m, s) for m, s in self.moment_names if momentum or m != "momentum_buffer"]

    def start(self, param, state, momentum, in_form):
        """Make what a first step finds in `state`: zero moments, step 0. Returns whether it made
        any (SGD's first step starts the momentum as the gradient)."""
        made = False
        if self.kind == "adam" and "step" not in state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=param.device)
            made = True
        for moment, signed in self._used(momentum):
            if self.keys(moment, in_form)[0] not in state:
                dtype = torch.float32 if in_form else param.dtype
                zeros = torch.zeros_like(param, dtype=dtype, memory_format=torch.preserve_format)
                state.update(self._encoded(moment, zeros, signed, in_form))
                made = True
        return made

    def _encoded(self, moment, values, signed, in_form=True):
        keys = self.keys(moment, in_form)
        if not in_form:
            return {keys[0]: values}
        if self.moments == "fp32" or in_form == FP32:
            return {keys[0]: values.float()}
        if self.moments == "bf16":
            return {keys[0]: values.to(torch.bfloat16).contiguous()}
        # shard by shard: whole rows, whole blocks (weights/shards.py)
        codes, scales = distributed.shardwise(kernels.moment_encode, values.float(), signed)
        return {keys[0]: codes.contiguous(), keys[1]: _by_rows(scales, values)}

    # -- conversions -----------------------------------------------------------------------------

    def from_torch(self, entry, param, in_form, low=None):
        """`entry` (torch's format or any form's keys, in any dtype torch's load cast them to)
        in this form; other keys kept. A master's rest is converted to this form where `low` (the
        weight it is the rest of) is given, else dropped (the parameter is its FP32 value)."""
        out = {key: value for key, value in entry.items() if _moment_of(key) is None}
        for key in _MASTER_KEYS & out.keys():
            rest = out.pop(key)
            if low is not None and isinstance(rest, torch.Tensor):
                fp32 = _decoded_master(key, low, rest)
                out[self.master.key] = self.master.encode(fp32)[1]
        moments = "torch" if not in_form else "fp32" if in_form == FP32 else self.moments
        for moment, signed in self.moment_names:
            keys = self.keys(moment, in_form)
            others = {
                key: value
                for key, value in entry.items()
                if key not in keys and _moment_of(key) == moment
            }
            if others:  # another form's beside this one's: a checkpoint merged over the state a
                # step made first (torch's full state dicts do): the checkpoint's is the value
                values = _values(others, moment, signed)
                if values is not None:
                    dtype = torch.float32 if in_form else param.dtype
                    out.update(self._encoded(moment, values.to(dtype), signed, in_form))
                    continue
            held = [entry.get(key) for key in keys]
            if all(isinstance(value, torch.Tensor) for value in held) and _stored(
                keys, held, moments, signed, param
            ):
                if len(held) == 2:  # an older checkpoint's flat scales: the same, by rows
                    held[1] = _by_rows(held[1], param)
                out.update(zip(keys, held))  # already so: kept as it is (no new rounding)
                continue
            values = _values(entry, moment, signed)
            if values is not None:
                dtype = torch.float32 if in_form else param.dtype
                out.update(self._encoded(moment, values.to(dtype), signed, in_form))
        return out

    def to_torch(self, entry, param):
        """`entry` in torch's format for `param` (now FP32): torch_entry's."""
        return torch_entry(entry, param.dtype)


def check_entry(entry, param, index):
    """A clear error where a moment (any form's) has another shape than its parameter, or
    8-bit codes another number of block scales (a checkpoint of another model): the fused
    step does not check them and would read past a moment's end or step a prefix of it.
    Changes nothing."""
    for key, value in entry.items():
        moment = _moment_of(key)
        if moment is None or not isinstance(value, torch.Tensor):
            continue
        if key.endswith("_scales"):
            wrong = value.numel() != kernels.moment_scales(param.numel())
            what = f"{value.numel()} block scales"
        else:
            wrong = value.shape != param.shape
            what = f"shape {tuple(value.shape)}"
        if wrong:
            raise ValueError(
                f"optimizer.load_state_dict: the {moment} of parameter {index} ({key}) has "
                f"{what}, and the parameter shape {tuple(param.shape)}: the checkpoint is of "
                "another model. Load one saved by an optimizer over this model's parameters."
            )


def _by_rows(scales, like):
    """8-bit codes' block scales laid out as the rows of `like` (their parameter or values:
    [rows, row / 32], a DTensor sharded as `like` where it is one); as they are where already
    so."""
    rows = like.shape[0]
    shape = (rows, like.numel() // rows // kernels.MOMENT_BLOCK)
    if scales.shape == shape:
        return scales
    local = distributed.local(like)
    return distributed.laid_out(scales.view(local.shape[0], shape[1]), like, shape)


def torch_entry(entry, dtype):
    """A state entry of any form in torch's format: every moment under torch's key, in `dtype`
    (its parameter's), no master rest."""
    out = {
        key: value
        for key, value in entry.items()
        if _moment_of(key) is None and key not in _MASTER_KEYS
    }
    for moments in MOMENTS.values():
        for moment, signed in moments:
            values = _values(entry, moment, signed)
            if values is not None:
                out[moment] = values.to(dtype)
    return out


def _moment_of(key):
    for moments in MOMENTS.values():
        for moment, _ in moments:
            if key.startswith(moment) and key[len(moment):] in _SUFFIXES:
                return moment
    return None


def _stored(keys, held, moments, signed, param):
    """Whether `held` are a moment's tensors in their form's dtypes already."""
    if moments == "torch":
        return held[0].dtype is param.dtype
    if moments == "fp32":
        return held[0].dtype is torch.float32
    if moments == "bf16":
        return held[0].dtype is torch.bfloat16
    codes = torch.int8 if signed else torch.uint8
    return held[0].dtype is codes and held[1].dtype is torch.float32


def _values(entry, moment, signed):
    """The values of `moment` in `entry`, whichever way it is held there (None if not): torch's
    key's as they are, else FP32; codes and bf16 moments whose dtype torch's load changed are read
    back exactly."""
    value = entry.get(moment)
    if isinstance(value, torch.Tensor):
        return value
    value = entry.get(f"{moment}_bf16")
    if isinstance(value, torch.Tensor):
        return value.to(torch.bfloat16).float()
    codes, scales = entry.get(f"{moment}_codes"), entry.get(f"{moment}_scales")
    if isinstance(codes, torch.Tensor) and isinstance(scales, torch.Tensor):
        codes = codes.to(torch.int8 if signed else torch.uint8)
        return distributed.shardwise(kernels.moment_decode, codes, scales.float())
    return None


def _decoded_master(key, low, rest):
    """The FP32 value of a master whose rest (under `key`, in any dtype torch's load cast it to)
    is `rest` beside the weight `low`."""
    if key == MasterForm.KEYS["remainder"]:
        return distributed.shardwise(kernels.remainder_decode, low, rest.to(torch.int16))
    if key == MasterForm.KEYS["correction"]:
        return distributed.shardwise(kernels.compact_decode, low, rest.to(torch.int8))
    return rest.float()

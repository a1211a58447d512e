"""Cast policies (what is cast, to what, on which device) and the weight-cast cache."""

import functools

import torch

from .._state import amp_state

__all__ = [
    "LOW_PRECISION",
    "CASTABLE",
    "DEVICE_TYPES",
    "DEVICE_FILTERS",
    "ExplicitDtype",
    "SEQUENCES",
    "PLAIN_ARGUMENTS",
    "CastPolicy",
    "policy_for",
    "KEEP",
    "with_device",
    "WeightCastCache",
]

LOW_PRECISION = frozenset((torch.float16, torch.bfloat16))
# float64 is never cast: it is asked for deliberately (torch.amp's rule).
CASTABLE = frozenset((torch.float16, torch.bfloat16, torch.float32))
DEVICE_TYPES = ("cpu", "cuda")


def _is_cuda(tensor):
    return tensor.is_cuda


def _is_cpu(tensor):
    return tensor.is_cpu


DEVICE_FILTERS = {None: None, "cuda": _is_cuda, "cpu": _is_cpu}  # device_type -> tensor predicate


class ExplicitDtype(Exception):
    """Raised by a converter when the call names its dtype positionally: it runs as asked."""


_TensorBase = torch._C.TensorBase  # amp patches torch.Tensor, never its C base
# The no-argument cast methods: the same op as `.to(dtype)`, with cheaper argument parsing.
_CAST_METHODS = {
    torch.float16: _TensorBase.half,
    torch.bfloat16: _TensorBase.bfloat16,
    torch.float32: _TensorBase.float,
}
_Tensor = torch.Tensor
_dtype = torch.dtype
_float32 = torch.float32
SEQUENCES = (list, tuple)  # the containers patched calls are searched for tensors
_Parameter = torch.nn.Parameter
PLAIN_ARGUMENTS = frozenset((int, float, bool, str, type(None), slice))  # never cast, never hold


def _converter(target, sources, device_filter, cache):
    """A function of a sequence of call arguments: a list with every tensor whose dtype is in
    `sources` (and that `device_filter` accepts) cast to `target`, looking inside nested lists
    and tuples, or None when there is nothing to cast. FP32 leaf tensors that require grad
    (weights) go through `cache` unless it is None. It runs on every patched call, hence the
    flat loop."""
    cast = _CAST_METHODS[target]
    cached_cast = None if cache is None else cache.get_cast(target)

    def convert(values):
        converted = None
        index = -1
        for value in values:
            index += 1
            kind = type(value)
            if kind in PLAIN_ARGUMENTS:
                continue  # ints, floats, None...: read without a call to isinstance
            if kind is _Parameter or kind is _Tensor or isinstance(value, _Tensor):
                dtype = value.dtype
                if dtype in sources and (device_filter is None or device_filter(value)):
                    if converted is None:
                        converted = list(values)
                    if (
                        cached_cast is not None
                        and dtype is _float32
                        and value.requires_grad
                        and value.is_leaf
                    ):
                        converted[index] = cached_cast(value)
                    else:
                        converted[index] = cast(value)
            elif kind in SEQUENCES:
                if value:
                    inner = convert(value)
                    if inner is not None:
                        if converted is None:
                            converted = list(values)
                        converted[index] = kind(inner)
            elif kind is _dtype:
                raise ExplicitDtype
        return converted

    return convert


class CastPolicy:
    """What is cast, and to what, while the policy is in force: a low-precision dtype per device
    type (None: amp casts nothing on that device), as torch keeps one autocast state per device.

    `cpu` and `cuda` are the dtypes for tensors on those devices; when both are the same dtype
    the policy casts tensors on every device (meta tensors included). `cache_enabled` allows reuse
    of weight casts through the cache. `to_low` and `to_fp32` are the argument converters (see
    `_converter`) of the policy; `device_filter` accepts the tensors the policy casts.
    """

    __slots__ = (
        "cpu",
        "cuda",
        "cache_enabled",
        "float8",
        "device_filter",
        "to_low",
        "to_fp32",
    )

    def __init__(self, cpu, cuda, cache_enabled=True, float8=None):
        self.cpu = cpu
        self.cuda = cuda
        self.cache_enabled = cache_enabled
        self.float8 = float8  # a recipe name (amp/lists/float8_recipes.py), or None
        cache = amp_state.cast_cache if cache_enabled else None
        if cpu is None and cuda is None:
            # float8 alone (O2/O3 with float8=...): the FLOAT8_FUNCS run in FP8, every other
            # patched call as given. No tensor is the policy's, so nothing is cast or refused.
            self.device_filter = _no_device
            self.to_low = self.to_fp32 = _cast_nothing
            return
        if cpu is cuda:
            self.device_filter = None
            self.to_low = _converter(cpu, CASTABLE - {cpu}, None, cache)
        elif cpu is None or cuda is None:
            self.device_filter = _is_cuda if cpu is None else _is_cpu
            target = cpu or cuda
            self.to_low = _converter(target, CASTABLE - {target}, self.device_filter, cache)
        else:  # a different dtype per device (a nested torch.autocast on one of them)
            self.device_filter = None
            self.to_low = _chain(
                _converter(cuda, CASTABLE - {cuda}, _is_cuda, cache),
                _converter(cpu, CASTABLE - {cpu}, _is_cpu, cache),
            )
        self.to_fp32 = _converter(_float32, LOW_PRECISION, self.device_filter, None)

    def dtype_for(self, device_type):
        """The dtype amp casts to on `device_type`, or None where it casts nothing."""
        if device_type == "cpu":
            return self.cpu
        if device_type == "cuda":
            return self.cuda
        return None

    def target_for(self, tensor):
        """The dtype amp casts `tensor` to, or None where it casts nothing on its device."""
        if self.device_filter is not None and not self.device_filter(tensor):
            return None
        return self.cuda if tensor.is_cuda else self.cpu

    def __repr__(self):
        float8 = f", float8={self.float8!r}" if self.float8 is not None else ""
        return (
            f"CastPolicy(cpu={self.cpu}, cuda={self.cuda}, cache_enabled={self.cache_enabled}"
            f"{float8})"
        )


def _no_device(tensor):
    return False


def _cast_nothing(values):
    return None


def _chain(first, second):
    """A converter applying `first`, then `second` to its result."""

    def convert(values):
        converted = first(values)
        again = second(values if converted is None else converted)
        return converted if again is None else again

    return convert


@functools.lru_cache(maxsize=None)
def policy_for(cpu, cuda, cache_enabled=True, float8=None):
    """The policy casting to `cpu` / `cuda` on those devices (None: off there) and running the
    FLOAT8_FUNCS in FP8 with recipe `float8` (None: off), or None when it does neither.
    Policies are immutable; one object is shared per configuration."""
    if cpu is None and cuda is None and float8 is None:
        return None
    return CastPolicy(cpu, cuda, cache_enabled, float8)


KEEP = object()  # with_device(float8=KEEP): the policy's float8 recipe as it is


def with_device(policy, device_type, dtype, cache_enabled, float8=KEEP):
    """`policy` with the dtype of `device_type` changed to `dtype` (None: casting off there);
    `device_type` None changes every device. Its float8 recipe stays unless `float8` is given:
    torch.autocast regions (checkpoint recomputation, FP32 islands) change dtypes only, as a
    module swap such as torchao's Float8Linear ignores them."""
    cpu = policy.cpu if policy is not None else None
    cuda = policy.cuda if policy is not None else None
    if float8 is KEEP:
        float8 = policy.float8 if policy is not None else None
    if device_type in (None, "cpu"):
        cpu = dtype
    if device_type in (None, "cuda"):
        cuda = dtype
    return policy_for(cpu, cuda, cache_enabled, float8)


class WeightCastCache:
    """Low-precision copies of FP32 leaf tensors (weights), reused within one iteration.

    Two caches hold them: amp's own, for the calls amp casts, and torch's autocast cache, for the
    calls torch's autocast casts where amp's tables agree with it (native_autocast.py).
    An entry of amp's is keyed by the weight and the target dtype, and is served only while the
    weight's version counter and storage are unchanged, so an in-place update (an optimizer step,
    an EMA swap, `param.copy_`) or a `param.data = ...` swap is never answered with a stale cast.
    A cast made in grad mode serves every later use. One made under no_grad has no autograd edge
    to the weight: it serves no_grad uses, and the first use in grad mode casts again and
    replaces it. Casts made in inference mode are not kept (inference tensors cannot join a
    graph later).
    torch's cache checks neither version nor storage: `clear` empties both caches, and amp calls
    it after every optimizer step (any torch.optim optimizer while amp casts), when `scale_loss`
    starts and ends, and when the outermost region exits (torch's own exit does the same). A
    weight written in place by other means between two uses in one region is served its earlier
    cast by torch's cache, as under torch.autocast: `torch.clear_autocast_cache()` after such a
    write, or a region with cache_enabled=False, casts it anew.
    """

    def __init__(self):
        # dtype -> {weight._cdata: (the weight, its version, its storage, the cast)}. `_cdata`
        # (the address of the weight's TensorImpl, an attribute: no call) is unique among live
        # tensors; holding the weight keeps nothing alive that a grad-mode cast does not already
        # hold (through its autograd node), and it rules out a recycled address while the entry
        # exists, so a key found is the weight's own. Holding the storage the cast was made from
        # does the same for a storage swapped out from under the weight. Storages are compared
        # by address (`_storage_id`), which FakeTensors answer (their data_ptr warns).
        self._entries = {dtype: {} for dtype in CASTABLE}
        self._all = tuple(self._entries.values())
        # True once an entry may be held, in either cache, since the last clear: the hot callers
        # test it (an attribute) before calling clear, which then costs nothing on steps with no
        # casts. torch's cache fills without amp seeing it wherever amp casts: regions and O1
        # set it, and it stays set while they hold the patches.
        self.filled = False
        self._own_filled = False  # amp's own cache may hold entries

    def __len__(self):
        """The entries of amp's own cache."""
        return sum(map(len, self._entries.values()))

    def get_cast(self, dtype):
        """The function tensor -> its cast to `dtype`, through the cache."""
        entries = self._entries[dtype]
        cast = _CAST_METHODS[dtype]
        storage_id = torch._C._storage_id
        is_grad_enabled = torch.is_grad_enabled
        is_inference_mode_enabled = torch.is_inference_mode_enabled

        def cached_cast(tensor):
            key = tensor._cdata
            if key in entries:
                _, version, storage, result = entries[key]
                if (
                    tensor._version == version
                    and storage_id(tensor) == storage._cdata
                    and (result.requires_grad or not is_grad_enabled())
                ):
                    return result
            result = cast(tensor)
            if result.requires_grad or not is_inference_mode_enabled():
                entries[key] = (tensor, tensor._version, tensor.untyped_storage(), result)
                self.filled = self._own_filled = True
            return result

        return cached_cast

    def clear(self):
        """Empty amp's cache and torch's."""
        if self._own_filled:
            for entries in self._all:
                if entries:
                    entries.clear()
            self._own_filled = False
        _clear_torch_cache()
        self.filled = bool(amp_state.patch_users)


_clear_torch_cache = torch.clear_autocast_cache

"""amp's casting regions as API: autocast, disable_casts, and custom_fwd / custom_bwd."""

import contextlib
import functools
import inspect
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .._state import amp_state
from ..lists.float8_recipes import check_recipe_name
from .cast_tree import cast_tree
from .casts import DEVICE_FILTERS, DEVICE_TYPES, with_device
from .regions import enter_region, exit_region, policy_scope

__all__ = [
    "disable_casts",
    "autocast",
    "custom_fwd",
    "custom_bwd",
]


@contextlib.contextmanager
def disable_casts() -> Iterator[None]:
    """Context manager inside which amp casts nothing (nestable, thread-local, exception-safe).

    Example::

        with amp.disable_casts():
            loss = F.binary_cross_entropy(torch.sigmoid(logits.float()), target)
    """
    with policy_scope(None):
        yield


_AMP_FORM = ("enabled", "dtype", "cache_enabled", "device_type")
_TORCH_FORM = ("device_type", "dtype", "enabled", "cache_enabled")
_FLOAT16, _BFLOAT16 = torch.float16, torch.bfloat16
_UNSET = object()  # a keyword not given: None is a value in torch's form (the device's dtype)


def _merge_positional(args, given, names):
    """`given` (a keyword: its value or _UNSET) with the positional `args` added under `names`
    (amp's or torch's form)."""
    if len(args) > len(names):
        raise TypeError(f"autocast takes at most {len(names)} positional arguments")
    for name, value in zip(names, args):
        if given[name] is not _UNSET:
            raise TypeError(f"autocast.__init__() got multiple values for argument {name!r}")
        given[name] = value
    return given


def _check_device_type(device_type):
    if not isinstance(device_type, str):
        raise ValueError(f"Expected `device_type` of type `str`, got: `{type(device_type)}`")
    if device_type not in DEVICE_TYPES:
        try:
            torch.device(device_type)
        except RuntimeError as error:  # a string that names no device: torch's error, as its own
            raise RuntimeError(
                f"{error} (amp.autocast: unsupported device_type {device_type!r}; amp casts on "
                "cpu and cuda, or on both with device_type=None)"
            ) from None
        raise RuntimeError(
            f"amp.autocast: unsupported device_type {device_type!r}; amp casts on "
            f"{' and '.join(DEVICE_TYPES)} (pass device_type=None for both). For other devices "
            "use torch.autocast."
        )


class autocast:
    """Context manager and decorator that applies amp's O1 casting policy in a region.

    Works without `amp.initialize`. Regions nest (an `autocast(enabled=False)` inside an enabled
    one turns casting off for its block), are thread-local, and restore their state on exceptions.
    Casts of FP32 weights are cached until the outermost region of the thread exits. A region is
    one torch autocast region: inside it `torch.is_autocast_enabled(device)` and
    `torch.get_autocast_dtype(device)` report it, and `torch.autocast` regions nested in it
    (checkpoint recomputation, `custom_fwd`, libraries' FP32 islands) are amp regions too.

    Accepts amp's form ``autocast(enabled=True, dtype=torch.float16, cache_enabled=True,
    device_type=None, *, float8=None)`` and torch's ``autocast("cuda", dtype=None, enabled=True,
    cache_enabled=None, *, float8=None)``, where dtype None means the device's current autocast
    dtype.

    Args:
        enabled (bool, optional, default=True): whether the region casts.
        dtype (torch.dtype, optional, default=torch.float16): the low-precision type,
            ``torch.float16`` or ``torch.bfloat16``.
        cache_enabled (bool, optional, default=True): reuse weight casts within the region.
        device_type (str, optional, default=None): ``"cpu"`` or ``"cuda"`` to cast only tensors
            on that device; None casts tensors on every device. ``"cuda"`` on a machine without
            CUDA warns and turns the region off, as torch.autocast does.
        float8 (str, optional, default=None): ``"tensorwise"`` or ``"rowwise"`` runs the
            matmuls of ``F.linear`` calls whose shapes FP8 tensor cores take in FP8 (torchao's
            recipe of that name), on every device; None does not. Keyword only.

    Example::

        with amp.autocast(dtype=torch.bfloat16):
            loss = loss_fn(model(inputs), targets)
        loss.backward()
    """

    __slots__ = ("enabled", "dtype", "cache_enabled", "device_type", "float8", "_tokens")

    def __init__(
        self,
        *args: Any,
        enabled: Any = _UNSET,
        dtype: Any = _UNSET,
        cache_enabled: Any = _UNSET,
        device_type: Any = _UNSET,
        float8: str | None = None,
    ) -> None:
        # Keywords bound by Python, positional forms merged only when given: a region should
        # cost what torch's does, and most are built with keywords alone.
        torch_form = False
        if args:
            torch_form = isinstance(args[0], str)
            given = _merge_positional(
                args,
                dict(
                    enabled=enabled,
                    dtype=dtype,
                    cache_enabled=cache_enabled,
                    device_type=device_type,
                ),
                _TORCH_FORM if torch_form else _AMP_FORM,
            )
            enabled = given["enabled"]
            dtype = given["dtype"]
            cache_enabled = given["cache_enabled"]
            device_type = given["device_type"]
        if enabled is _UNSET:
            enabled = True
        if device_type is _UNSET:
            device_type = None
        if dtype is _UNSET:
            dtype = None
        if cache_enabled is _UNSET:
            cache_enabled = None
        if enabled is not True and enabled is not False:
            raise TypeError(f"autocast(enabled=...) must be a bool; got {enabled!r}.")
        if device_type is not None:
            _check_device_type(device_type)
            if enabled and device_type == "cuda" and not torch.cuda.is_available():
                # As torch.autocast("cuda") warns and turns itself off: casting nothing silently
                # would hide a script that meant to run on a GPU.
                warnings.warn(
                    "CUDA is not available. Disabling autocast.", UserWarning, stacklevel=2
                )
                enabled = False
        if dtype is None:
            # torch's form: the device's current autocast dtype; amp's: float16 (API.md).
            dtype = torch.get_autocast_dtype(device_type) if torch_form else _FLOAT16
        if enabled and dtype is not _FLOAT16 and dtype is not _BFLOAT16:
            raise ValueError(
                f"autocast(dtype={dtype!r}) is not a low-precision type; "
                "pass torch.float16 or torch.bfloat16."
            )
        if cache_enabled is None:
            cache_enabled = torch.is_autocast_cache_enabled() if torch_form else True
        elif cache_enabled is not True and cache_enabled is not False:
            raise TypeError(f"autocast(cache_enabled=...) must be a bool; got {cache_enabled!r}.")
        if float8 is not None:
            float8 = check_recipe_name(float8, "autocast(float8=...)")
        self.enabled = enabled
        self.dtype = dtype
        self.cache_enabled = cache_enabled
        self.device_type = device_type
        self.float8 = float8
        self._tokens = []  # one per active entry of this object, for re-entrant use

    def __enter__(self) -> "autocast":
        enabled = self.enabled
        self._tokens.append(
            enter_region(
                self.device_type,
                self.dtype if enabled else None,
                self.cache_enabled,
                self.float8 if enabled else None,
            )
        )
        return self

    def __exit__(self, *exc_info: object) -> bool:
        exit_region(self._tokens.pop())
        return False

    def __call__(self, func: Callable[..., Any]) -> Callable[..., Any]:
        if not callable(func):
            raise TypeError(
                f"autocast()(func) needs a callable, got {type(func).__name__}. "
                "Did you mean `with amp.autocast(...):`?"
            )
        settings = dict(
            enabled=self.enabled,
            dtype=self.dtype,
            cache_enabled=self.cache_enabled,
            device_type=self.device_type,
            float8=self.float8,
        )

        @functools.wraps(func)
        def decorate_autocast(*args, **kwargs):
            with autocast(**settings):
                return func(*args, **kwargs)

        return decorate_autocast


# What inspect.signature and editors show: amp's form (API.md). __init__ also takes torch's
# positional form, autocast("cuda", torch.bfloat16), which one signature cannot state.
autocast.__init__.__signature__ = inspect.Signature(
    [
        inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
        *(
            inspect.Parameter(
                name,
                inspect.Parameter.POSITIONAL_OR_KEYWORD,
                default=default,
                annotation=annotation,
            )
            for name, default, annotation in (
                ("enabled", True, bool),
                ("dtype", torch.float16, torch.dtype),
                ("cache_enabled", True, bool),
                ("device_type", None, str | None),
            )
        ),
        inspect.Parameter(
            "float8", inspect.Parameter.KEYWORD_ONLY, default=None, annotation=str | None
        ),
    ],
    return_annotation=None,
)


def custom_fwd(
    fwd: Callable[..., Any] | None = None,
    *,
    cast_inputs: torch.dtype | None = None,
    device_type: str | None = None,
) -> Callable[..., Any]:
    """Decorator for the `forward` of a custom `torch.autograd.Function` (as torch.amp's).

    With `cast_inputs=None`, forward runs under whatever amp policy is in force and `custom_bwd`
    runs backward under the same one. With `cast_inputs=dtype`, inside a casting region the
    floating inputs (nested in containers too) are cast to `dtype` and forward (and backward) run
    with casting off; outside a region the decorator does nothing. `device_type`, accepted for
    torch.amp compatibility, limits the input casts to tensors on that device.
    """
    _check_decorator_device("custom_fwd", device_type)
    if fwd is None:
        return functools.partial(custom_fwd, cast_inputs=cast_inputs, device_type=device_type)
    if cast_inputs is not None and (
        not isinstance(cast_inputs, torch.dtype) or not cast_inputs.is_floating_point
    ):
        raise ValueError(
            f"custom_fwd(cast_inputs=...) must be a floating dtype; got {cast_inputs!r}."
        )
    device_filter = DEVICE_FILTERS[device_type]

    @functools.wraps(fwd)
    def decorate_fwd(ctx, *args, **kwargs):
        policy = amp_state.current_policy()
        # Asked through torch's readers: a torch.autocast region opened before amp was first
        # used casts too, and its body must run with casting off as well.
        devices = DEVICE_TYPES if device_type is None else (device_type,)
        casting = any(torch.is_autocast_enabled(device) for device in devices)
        if cast_inputs is None or not casting:
            ctx._amp_policy = policy
            return fwd(ctx, *args, **kwargs)
        # Casting off on that device for the body (and its backward), as torch.amp does.
        cache_enabled = policy.cache_enabled if policy is not None else True
        ctx._amp_policy = with_device(policy, device_type, None, cache_enabled)
        token = enter_region(device_type, None, cache_enabled)
        try:
            return fwd(
                ctx,
                *cast_tree(args, cast_inputs, device_filter),
                **cast_tree(kwargs, cast_inputs, device_filter),
            )
        finally:
            exit_region(token)

    return decorate_fwd


def custom_bwd(
    bwd: Callable[..., Any] | None = None, *, device_type: str | None = None
) -> Callable[..., Any]:
    """Decorator for the `backward` of a custom Function whose forward used `custom_fwd`.

    Backward runs under the casting policy its forward ran under (or none). With `device_type`
    (as torch.amp's), only that device's casting is the forward's; the other device keeps the
    casting in force where backward runs.
    """
    _check_decorator_device("custom_bwd", device_type)
    if bwd is None:
        return functools.partial(custom_bwd, device_type=device_type)

    @functools.wraps(bwd)
    def decorate_bwd(ctx, *grad_outputs):
        policy = getattr(ctx, "_amp_policy", None)
        if device_type is not None:
            current = amp_state.current_policy()
            source = policy if policy is not None else current
            cache_enabled = source.cache_enabled if source is not None else True
            dtype = getattr(policy, device_type) if policy is not None else None
            policy = with_device(current, device_type, dtype, cache_enabled)
        with policy_scope(policy):
            return bwd(ctx, *grad_outputs)

    return decorate_bwd


def _check_decorator_device(decorator: str, device_type: str | None) -> None:
    if device_type is not None and device_type not in DEVICE_TYPES:
        raise ValueError(
            f"{decorator}(device_type={device_type!r}) must be one of {DEVICE_TYPES} or None "
            "(every device)."
        )

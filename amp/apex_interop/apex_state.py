"""apex compatibility: `amp._amp_state` for scripts that reach into apex.amp's internals.

Nothing here is amp's own API: these are the apex internals that real training scripts use,
kept working so that switching from apex is a change of import. Each field is a view of amp's
state (`amp._state.amp_state` and its `LossScaler`s), never a copy: a write changes what amp
does next, with amp's validation.
"""

from .._state import amp_state
from ..properties import check_verbosity

__all__ = ["LossScalerView", "OptPropertiesView", "ApexAmpState", "apex_amp_state"]

# apex's Properties() before initialize, and after initialize(enabled=False).
_APEX_DEFAULT_OPTIONS = {
    "enabled": False,
    "opt_level": None,
    "cast_model_type": None,
    "patch_torch_functions": False,
    "keep_batchnorm_fp32": None,
    "master_weights": None,
    "loss_scale": 1.0,
}


class LossScalerView:
    """apex's LossScaler fields over one of amp's loss scalers.

    `loss_scale()` and `_loss_scale` read the current scale (a device read: a sync on CUDA).
    Writing `_loss_scale` sets the scale the next `scale_loss` uses, static or dynamic (a
    dynamic scale then keeps backing off and growing from there); a value that is not finite,
    positive and within float32's normal range raises ValueError and changes nothing.

    `_unskipped`: for a dynamic scaler, clean steps since the scale last changed (apex's
    meaning; amp's growth counter). For a static scaler, the backward passes `scale_loss` has
    unscaled (a static scaler never skips). apex counted those too, except at a static scale of
    1.0; amp counts them there as well, so the common gate
    ``if amp._amp_state.loss_scalers[0]._unskipped != 0: scheduler.step()`` steps at every
    level. (`amp.state_dict()` saves 0 for a static scaler: a loaded count is a growth count.) Writing
    `_unskipped` sets that count; for a dynamic scaler it is the growth counter (the scale
    doubles when it reaches the growth interval, 2000, so it takes 0 to 1999), for a static one
    any int32 count. A write out of range raises ValueError and changes nothing.
    """

    _WRITABLE = ("_loss_scale", "_unskipped")

    def __init__(self, scaler):
        object.__setattr__(self, "_amp_scaler", scaler)

    def loss_scale(self):
        return self._amp_scaler.loss_scale()

    @property
    def _loss_scale(self):
        return self._amp_scaler.loss_scale()

    @_loss_scale.setter
    def _loss_scale(self, value):
        what = "amp._amp_state.loss_scalers[i]._loss_scale"
        self._amp_scaler.check_can_change(what)
        self._amp_scaler.set_loss_scale(value, what)

    @property
    def _unskipped(self):
        scaler = self._amp_scaler
        if scaler.dynamic:
            return scaler.unskipped()
        return scaler.unskipped() + scaler.static_passes  # the first term: a loaded apex count

    @_unskipped.setter
    def _unskipped(self, value):
        self._amp_scaler.set_unskipped(value, "amp._amp_state.loss_scalers[i]._unskipped")

    @property
    def dynamic(self):
        return self._amp_scaler.dynamic

    @property
    def _min_loss_scale(self):
        return self._amp_scaler.min_loss_scale

    @property
    def _max_loss_scale(self):
        return self._amp_scaler.max_loss_scale

    @property
    def _scale_seq_len(self):
        return self._amp_scaler.growth_interval

    def __setattr__(self, name, value):
        if name not in self._WRITABLE:
            raise AttributeError(
                f"amp._amp_state.loss_scalers[i].{name} cannot be set: amp's apex compatibility "
                "layer lets scripts write _loss_scale and _unskipped only."
            )
        object.__setattr__(self, name, value)

    def __repr__(self):
        kind = "dynamic" if self.dynamic else "static"
        return f"LossScalerView({kind}, loss_scale={self._loss_scale}, unskipped={self._unskipped})"


class OptPropertiesView:
    """apex's `_amp_state.opt_properties`: the options amp.initialize resolved, by attribute.

    Before `amp.initialize`, and after `initialize(enabled=False)`, apex's defaults
    (`enabled=False`, `loss_scale=1.0`, ...). Read-only: options are set by passing them to
    `amp.initialize`.
    """

    def __getattr__(self, name):
        options = self.options
        if name in options:
            return options[name]
        raise AttributeError(
            f"amp._amp_state.opt_properties has no {name!r}; it has {', '.join(options)}."
        )

    @property
    def options(self):
        """{option: value} in apex's order, plus amp's `dtype` once initialized."""
        properties = amp_state.properties
        if properties is None:
            return dict(_APEX_DEFAULT_OPTIONS)
        return dict(properties.options())

    def __setattr__(self, name, value):
        raise AttributeError(
            f"amp._amp_state.opt_properties.{name} cannot be set: pass {name}=... to "
            "amp.initialize (after amp.deinitialize(), to change an active setup)."
        )

    def __repr__(self):
        return "OptPropertiesView(" + ", ".join(f"{k}={v!r}" for k, v in self.options.items()) + ")"


class ApexAmpState:
    """`amp._amp_state`: the fields of apex's `apex.amp._amp_state` that scripts use.

    - `loss_scalers`: a tuple of `LossScalerView`s, one per loss (`num_losses`), built on each
      read from amp's live scalers: `loss_scale()`, `_loss_scale` (writable), `_unskipped`.
    - `opt_properties`: the resolved options by attribute (`opt_level`, `loss_scale`, ...).
    - `verbosity` (writable: 0 silences the skip messages, 2 names the parameters).
    - `min_loss_scale`, `max_loss_scale`: the bounds of the dynamic scale.
    - `hard_override`, `allow_incoming_model_not_fp32`: False; amp supports neither, so setting
      them to True raises rather than being ignored.

    A compatibility layer, not amp's API: new code uses `amp.state_dict()`,
    `amp.last_overflow()` and `amp.GradScaler.get_scale()`.
    """

    _UNSUPPORTED_FLAGS = {
        "hard_override": "amp raises on invalid options; fix the option instead",
        "allow_incoming_model_not_fp32": (
            "amp.initialize takes FP32 models and casts them itself (O2/O3); pass the model in FP32"
        ),
    }

    @property
    def loss_scalers(self):
        return tuple(LossScalerView(scaler) for scaler in amp_state.loss_scalers)

    @property
    def opt_properties(self):
        return _OPT_PROPERTIES

    @property
    def verbosity(self):
        return amp_state.verbosity

    @verbosity.setter
    def verbosity(self, value):
        amp_state.verbosity = check_verbosity(value, "amp._amp_state.verbosity")

    @property
    def min_loss_scale(self):
        scalers = amp_state.loss_scalers
        return scalers[0].min_loss_scale if scalers else None

    @property
    def max_loss_scale(self):
        scalers = amp_state.loss_scalers
        return scalers[0].max_loss_scale if scalers else 2.0**24

    def __getattr__(self, name):
        if name in self._UNSUPPORTED_FLAGS:
            return False
        hint = " (use amp.deinitialize() to undo O1 patching)" if name == "handle" else ""
        raise AttributeError(
            f"amp._amp_state has no {name!r}{hint}. amp's apex compatibility layer provides "
            "loss_scalers, opt_properties, verbosity, min_loss_scale, max_loss_scale."
        )

    def __setattr__(self, name, value):
        if name == "verbosity":
            object.__setattr__(self, name, value)
        elif name in self._UNSUPPORTED_FLAGS:
            if value:
                raise RuntimeError(
                    f"amp._amp_state.{name} = True is not supported: "
                    f"{self._UNSUPPORTED_FLAGS[name]}."
                )
        else:
            raise AttributeError(
                f"amp._amp_state.{name} cannot be set: of apex's state, scripts may set "
                "verbosity, loss_scalers[i]._loss_scale and loss_scalers[i]._unskipped."
            )

    def __repr__(self):
        return (
            f"amp._amp_state(loss_scalers={list(self.loss_scalers)}, "
            f"opt_properties={self.opt_properties!r}, verbosity={self.verbosity})"
        )


_OPT_PROPERTIES = OptPropertiesView()
apex_amp_state = ApexAmpState()

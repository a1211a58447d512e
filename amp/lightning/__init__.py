"""amp inside Lightning 2: the `AmpPrecision` plugin for the Trainer and Fabric, and `setup`.

``from amp.lightning import AmpPrecision`` imports Lightning (both of its copies, ``lightning`` and
``pytorch_lightning``, where installed); ``import amp`` and ``import amp.lightning`` do not.

    trainer = lightning.pytorch.Trainer(plugins=[AmpPrecision(opt_level="O2")])

    fabric = lightning.fabric.Fabric(plugins=[AmpPrecision(opt_level="O2")])
    model, optimizer = amp.lightning.setup(fabric, model, optimizer)
"""

from typing import Any

from .fabric import setup

__all__ = ["AmpPrecision", "setup"]


def __getattr__(name: str) -> Any:
    # The class derives from Lightning's Precision classes, so it is made on first use.
    if name == "AmpPrecision":
        from . import flavours
        from .plugin import AmpPrecisionBehaviour

        cls = flavours.build_class(AmpPrecisionBehaviour)
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

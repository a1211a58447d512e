"""Which AmpTrainer holds amp's one set-up in this process, and handing it over to another.

amp runs one set-up per process, and an AmpTrainer keeps it after train() (evaluate, predict and
save_model run at the level). A notebook's second run, or a resume after a finished run, makes a
second AmpTrainer while the first still holds amp: the first is deinitialized for it (its model
gets its FP32 weights back, exactly: from the masters at O2) with a line in amp's log, unless it
is training. A set-up made by amp.initialize itself is the user's: never undone here.
"""

import weakref
from typing import Any, Optional, Tuple

import amp
from amp._state import amp_state, logger

__all__ = ["claim", "take_over"]

# (the AmpTrainer, the PatchLedger of the set-up it made), both weakly: amp's set-up is that
# trainer's only while amp still runs that ledger (amp.deinitialize() and a new amp.initialize
# by hand make another).
_held: Optional[Tuple[weakref.ref, weakref.ref]] = None


def claim(trainer: Any) -> None:
    """`trainer` has just set amp up (amp.initialize returned)."""
    global _held
    _held = (weakref.ref(trainer), weakref.ref(amp_state.ledger))


def take_over(trainer: Any) -> None:
    """Make amp free for `trainer` to set up: deinitialize the AmpTrainer holding it (through its
    own deinitialize(), so that it knows), or refuse if that one is training or amp was set up
    by hand. Nothing to do if amp is not set up, or `trainer` holds it."""
    if not amp_state.initialized:
        return
    holder, ledger = (_held[0](), _held[1]()) if _held is not None else (None, None)
    if ledger is None or ledger is not amp_state.ledger:
        raise RuntimeError(
            "AmpTrainer: amp is already initialized in this process by amp.initialize (not by an "
            "AmpTrainer), and it runs one set-up at a time. Call amp.deinitialize() first."
        )
    if holder is trainer:
        return
    if holder is not None and holder._amp_training:
        raise RuntimeError(
            "AmpTrainer: another AmpTrainer holds amp and is training (amp runs one set-up per "
            "process). Start this one after that train() returns: amp is then handed over."
        )
    logger.info(
        "AmpTrainer: amp was held by another AmpTrainer, not training; deinitialized it for this "
        "one (its model has its FP32 weights back; its train(), evaluate() or predict() sets "
        "amp up again)."
    )
    if holder is not None:
        holder.deinitialize()
    else:  # the trainer is gone; its set-up (the model, the optimizer) is not
        amp.deinitialize()

"""What a scale_loss block found, on the device, and on the host without waiting for it.

A dynamic loss scaler keeps its scale in a small device state (amp/scaling/scaler.py): the
inverse scale, the count of clean steps, and for the last unscaling block whether its gradients
held inf/NaN and whether its loss did. A `Check` holds the views of one block's results; after
the scale update it starts a copy of the whole state into host memory that does not wait
(`copy_(non_blocking=True)`, behind a CUDA event), and the host reads that copy once it has
arrived (on the CPU at once). Reading it never waits for the device; `is_set` (the general
path, which must decide on the host whether to call the optimizer) reads the device flag, a
sync on CUDA.

A `ScaleMirror` replays the scale's rule on the host from the checks, in order, so that the host
knows the exact scale and count of clean steps without reading the device, and knows when an
update cannot reach a bound (then the device clamp is left out).
"""

import collections
import math

import torch

__all__ = [
    "STATE_LENGTH",
    "INV",
    "TRACKER",
    "FOUND",
    "BAD",
    "FOUND_EFFECTIVE",
    "new_state",
    "views",
    "Check",
    "ScaleMirror",
]

STATE_LENGTH = 5
INV, TRACKER, FOUND, BAD, FOUND_EFFECTIVE = range(STATE_LENGTH)
_FLOAT32_MAX = torch.finfo(torch.float32).max


def new_state(inv_scale, unskipped, device):
    """The scaler's device state: int32 words, the float ones read through float32 views."""
    inv_bits = torch.tensor(inv_scale, dtype=torch.float32).view(torch.int32).item()
    words = [inv_bits, unskipped] + [0] * (STATE_LENGTH - 2)
    return torch.tensor(words, dtype=torch.int32).to(device)


def views(state):
    """(found, bad) of a state: the flags a block leaves."""
    return (
        state[FOUND].view(torch.float32),  # the gradients held inf/NaN (the unscale flag)
        state[BAD],  # the loss was inf/NaN
    )


class Check:
    """The results of one unscaling block of a dynamic scaler: device views, and host values
    once its copy has arrived (`learned`)."""

    __slots__ = (
        "loss_id",
        "mirror",
        "state",
        "found",
        "bad",
        "holders",
        "host",
        "event",
        "learned",
        "found_value",
        "bad_value",
        "scale_after",
        "unskipped_after",
        "reported",
    )

    def __init__(self, loss_id, mirror, state, state_views):
        self.loss_id = loss_id
        self.mirror = mirror
        self.state = state
        self.found, self.bad = state_views
        self.holders = 0  # optimizers that have not yet stepped (or zero_grad'ed) on it
        self.host = self.event = None
        self.learned = False
        self.found_value = self.bad_value = None
        self.scale_after = self.unskipped_after = None  # the mirror's, once replayed
        self.reported = False

    def freeze(self):
        """The scaler is about to reuse its state while an optimizer still waits on this check:
        keep this block's results apart (one copy on the device)."""
        self.state = self.state.clone()
        self.found, self.bad = views(self.state)

    def post(self, host):
        """Start the copy of the state (after the update) into `host` memory; no wait."""
        host.copy_(self.state, non_blocking=True)
        self.host = host
        if self.state.is_cuda:
            self.event = torch.cuda.Event()
            self.event.record()
        self.mirror.unlearned.append(self)

    def ready(self):
        """Whether the host copy has arrived (never waits)."""
        return self.learned or self.event is None or self.event.query()

    def arrived(self, wait=False):
        """Read the host copy if it has arrived (waiting for it if `wait`): True once read."""
        if self.learned:
            return True
        event = self.event
        if event is not None and not event.query():
            if not wait:
                return False
            event.synchronize()
        words = self.host.tolist()  # host memory: no device read
        self.found_value = words[FOUND] != 0  # the bits of 0.0 or 1.0
        self.bad_value = words[BAD] != 0
        self.learned = True
        return True

    def is_set(self):
        """Whether the gradients held inf/NaN: from the host copy if it has arrived, else read
        from the device (a sync on CUDA)."""
        if self.arrived():
            return self.found_value
        return bool(self.found.item())


class ScaleMirror:
    """The host's copy of a dynamic scaler's scale and count of clean steps, replayed from its
    checks in order (the device rule: scaling/scaler.py)."""

    def __init__(self, scale, unskipped, growth_interval, floor, ceiling):
        self.scale, self.unskipped = scale, unskipped  # after the last learned check
        self.growth_interval = growth_interval
        self.floor, self.ceiling = floor, ceiling
        self.unlearned = collections.deque()

    def learn(self, wait, through=None):
        """Replay the posted checks in order, up to `through` (all if None); stops at one whose
        copy has not arrived unless `wait`. True when `through` (or every check) is replayed."""
        unlearned = self.unlearned
        while unlearned:
            check = unlearned[0]
            if not check.arrived(wait):
                return False
            self._replay(check)
            unlearned.popleft()
            if check is through:
                return True
        return through is None or through.scale_after is not None

    def _replay(self, check):
        if check.bad_value:
            pass  # a non-finite loss: scale and count stay
        elif check.found_value:
            self.scale = max(self.scale * 0.5, self.floor)
            self.unskipped = 0
        else:
            self.unskipped += 1
            if self.unskipped == self.growth_interval:
                grown = min(self.scale * 2.0, self.ceiling or _FLOAT32_MAX)
                if math.isfinite(grown) and grown <= _FLOAT32_MAX:
                    self.scale = grown
                self.unskipped = 0
        check.scale_after, check.unskipped_after = self.scale, self.unskipped

    def may_reach_a_bound(self):
        """Whether the next update could take the scale past a bound, given what has not arrived
        yet: a growth (only when the count could reach the interval) or backoffs to the floor.
        Replays what has arrived first."""
        self.learn(wait=False)
        pending = len(self.unlearned)
        return (
            self.unskipped + pending + 1 >= self.growth_interval
            or self.scale * 0.5 ** (pending + 1) < self.floor
        )

    def reset(self, scale, unskipped):
        """A load or a write of the scale: every check is learned first."""
        self.learn(wait=True)
        self.scale, self.unskipped = scale, unskipped

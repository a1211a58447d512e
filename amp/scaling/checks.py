"""A dynamic scaler's device state and its checks: the five int32 words each checked scale_loss
block gets (`Check`, made by scaler.LossScaler.open_check), and what the host learns from their
copies once they have arrived (`HostScale`): the flags, and the scale and count the device left,
without replaying the rule (scaler.py's module doc says how the state is updated)."""

import collections
import math
import struct

import torch

from .values import float32

__all__ = [
    "STATE_LENGTH",
    "INV",
    "TRACKER",
    "FOUND",
    "BAD",
    "FOUND_EFFECTIVE",
    "new_state",
    "Check",
    "HostScale",
]

STATE_LENGTH = 5
INV, TRACKER, FOUND, BAD, FOUND_EFFECTIVE = range(STATE_LENGTH)


def new_state(inv_scale, unskipped, device):
    """A scaler's first device state, from the host's inverse scale and count; flags cleared."""
    (inv_bits,) = struct.unpack("<i", struct.pack("<f", float32(inv_scale)))
    words = [inv_bits, unskipped] + [0] * (STATE_LENGTH - 2)
    return torch.tensor(words, dtype=torch.int32).to(device)


class Check:
    """One unscaling block of a dynamic scaler: its device state (views of each word), and the
    host's values once the copy of that state has arrived (`learned`)."""

    __slots__ = (
        "loss_id",
        "host_scale",
        "state",
        "inv",
        "tracker",
        "found",
        "bad",
        "effective",
        "host",
        "event",
        "learned",
        "found_value",
        "bad_value",
        "inv_value",
        "unskipped_value",
        "reported",
    )

    def __init__(self, loss_id, host_scale, state):
        self.loss_id = loss_id
        self.host_scale = host_scale  # its scaler's HostScale, which learns the scale from it
        self.state = state
        floats = state.view(torch.float32)
        self.inv, self.found, self.effective = floats[INV], floats[FOUND], floats[FOUND_EFFECTIVE]
        self.tracker, self.bad = state[TRACKER], state[BAD]
        self.host = self.event = None
        self.learned = False
        self.found_value = self.bad_value = self.inv_value = self.unskipped_value = None
        self.reported = False

    def post(self, host):
        """Start the copy of the state (after the update) into `host` (int32 host memory, and
        its float32 view); no wait. On the CPU it has arrived at once: read."""
        host[0].copy_(self.state, non_blocking=True)
        self.host = host
        self.host_scale.unread.append(self)
        if self.state.is_cuda:
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.arrived()

    def arrived(self, wait=False):
        """Read the host copy if it has arrived (waiting for it if `wait`): True once read."""
        if self.learned:
            return True
        event = self.event
        if event is not None and not event.query():
            if not wait:
                return False
            event.synchronize()
        words, floats = self.host[0].tolist(), self.host[1].tolist()  # host memory: no wait
        self.found_value = words[FOUND] != 0  # the bits of 0.0 or 1.0
        self.bad_value = words[BAD] != 0
        self.inv_value, self.unskipped_value = floats[INV], words[TRACKER]
        self.learned = True
        return True

    def is_set(self):
        """Whether the gradients held inf/NaN: from the host copy if it has arrived, else read
        from the device (a sync on CUDA)."""
        if self.arrived():
            return self.found_value
        return bool(self.found.item())

    @property
    def scale_after(self):
        """The scale the device left after this block's update (its copy must have arrived)."""
        return self.host_scale.scale_of(self.inv_value)


class HostScale:
    """What the host knows of a dynamic scaler's scale and count of clean steps: the inverse
    scale and count of the last check whose copy it read (the state's first before any), and the
    checks posted since."""

    def __init__(self, scale, unskipped, growth_interval, floor, ceiling):
        self.growth_interval = growth_interval
        self.unread = collections.deque()
        self._inv_floor = float32(1.0 / floor)  # where a back-off clamps the inverse scale
        # The device only doubles, halves and clamps the inverse scale: every value it holds is
        # an anchor's times a power of two, the anchors being the one it started from and the
        # clamps' (scale_of).
        bounds = [(floor, self._inv_floor)]
        if ceiling is not None:
            bounds.append((ceiling, float32(1.0 / ceiling)))
        self._bounds = bounds
        self.reset(scale, unskipped)

    @property
    def scale(self):
        """The scale after the last check read."""
        return self.scale_of(self.inv)

    def scale_of(self, inv):
        """The scale whose inverse the device holds as `inv`, exactly as the host would write it:
        an anchor's scale times the power of two between the inverses."""
        for scale, anchor in self._anchors:
            ratio = anchor / inv
            if math.frexp(ratio)[0] == 0.5:
                return scale * ratio
        return 1.0 / inv

    def read(self, wait, through=None):
        """Read the posted checks in order, up to `through` (all if None); stops at one whose copy
        has not arrived unless `wait`. True when `through` (or every check) is read."""
        unread = self.unread
        while unread:
            check = unread[0]
            if not check.arrived(wait):
                return False
            self.inv, self.unskipped = check.inv_value, check.unskipped_value
            unread.popleft()
            if check is through:
                return True
        return through is None or through.learned

    def may_reach_a_bound(self):
        """Whether the next update could take the scale past a bound, given what has not arrived
        yet: a growth (only when the count could reach the interval) or backoffs to the floor.
        Reads what has arrived first."""
        self.read(wait=False)
        pending = len(self.unread)
        return (
            self.unskipped + pending + 1 >= self.growth_interval
            or self.inv * 2.0 ** (pending + 1) > self._inv_floor
        )

    def reset(self, scale, unskipped):
        """A load or a write of the scale (or the start): every check is read first."""
        self.read(wait=True)
        self.inv, self.unskipped = float32(1.0 / scale), unskipped
        self._anchors = [(scale, self.inv)] + self._bounds

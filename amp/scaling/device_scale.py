"""The scale on the device: what scale_loss asks of a scaler while it trains (`DeviceScale`,
LossScaler's base), each checked block's state (`Check`) and what the host learns (`HostScale`).

A dynamic scale lives in five int32 words on the device (the float ones read through float32
views): the inverse scale, the count of clean steps, and for one block whether its gradients held
inf/NaN, whether its loss did, and whether the overflow counts. Each checked scale_loss block gets
a state of its own (`Check`), made from the last one in the op that clears its flags, and the
update writes only that one: the inverse scale a loss was scaled with is never written again, so
whatever still holds it (a block still open, gradients kept for the step) keeps it without a copy.

A non-finite loss skips the step but keeps the scale: halving it when the loss itself is inf or
NaN cannot help, and step after step ruins the scale for when the loss is finite again (apex's
"scale spiral": 65536 down to 6e-05 in 30 steps). So a block also leaves whether its loss was
finite, and the update ignores the overflow of a block whose loss was not.

After the update the block's state is copied into host memory without waiting (behind a CUDA
event); the host reads the copy once it has arrived (on the CPU at once) and learns the flags and
the scale and count the device left (`HostScale`), without replaying the rule. `Check.is_set`
(the general path, which must decide on the host whether to call the optimizer) reads the device
flag, a sync on CUDA.
"""

import collections
import math
import struct

import torch

from .. import distributed
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
    "DeviceScale",
]

_HOST_COPIES = 4  # copies of a scaler's state on their way to the host at most

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


class DeviceScale:
    """A loss scale as scale_loss uses it: losses scaled, each block's check opened and the scale
    updated on the device, the host's knowledge posted; LossScaler adds its bounds, reads,
    writes and state dicts."""

    def __init__(self, dynamic, start, growth_interval, floor, ceiling):
        self.dynamic = dynamic
        self._init_scale = start
        # Where an update clamps the inverse scale: 1/ceiling (without one, 2**-127, whose
        # inverse float32 still holds) and 1/floor.
        self._inv_bounds = (
            float32(1.0 / ceiling) if ceiling is not None else 2.0**-127,
            float32(1.0 / floor),
        )
        self._host = HostScale(start, 0, growth_interval, floor, ceiling)
        # The device state the next block starts from, made on first use, and a view of its
        # inverse scale (what losses are scaled by)
        self._state = self._inv = None
        self._keep = None  # on the state's device: the int32 mask that copies scale and count
        self._hosts = []  # host memory for the copies of the state, reused in turn
        self._host_checks = []  # the check whose copy each holds
        self._next_host = -1
        self._static_inv = {}  # device -> 1 / scale for static scalers
        self._scratch = {}  # device -> a flag nobody reads (static scalers never skip)

    def _device_state(self, device):
        host = self._host
        state = self._state = new_state(host.inv, host.unskipped, device)
        self._inv = state.view(torch.float32)[INV]
        keep = torch.tensor([1, 1] + [0] * (STATE_LENGTH - 2), dtype=torch.int32)
        self._keep = keep.to(device)
        return state

    def scale(self, loss):
        """loss.float() * scale (dynamic: divided by the inverse, the same for a power of two)."""
        if not self.dynamic:
            return loss.float() * self._init_scale
        inv = self._inv if self._state is not None else self.inv_scale(loss.device)
        if inv.device != loss.device:
            inv = inv.to(loss.device, non_blocking=True)
        return loss.float() / inv

    def inv_scale(self, device):
        """1 / scale as a float32 0-dim tensor on `device`. A dynamic scaler's is a view of the
        state the next block starts from, never written once a block has used it."""
        if not self.dynamic:
            inv = self._static_inv.get(device)
            if inv is None:
                inv = torch.full((), 1.0 / self._init_scale, dtype=torch.float32, device=device)
                self._static_inv[device] = inv
            return inv
        if self._state is None:
            self._device_state(device)
        inv = self._inv
        return inv if inv.device == device else inv.to(device, non_blocking=True)

    def scratch_flag(self, device):
        """A float32 flag for unscaling whose overflow nobody reads (static scalers)."""
        flag = self._scratch.get(device)
        if flag is None:
            flag = self._scratch[device] = torch.zeros((), dtype=torch.float32, device=device)
        return flag

    def open_check(self, loss_id, device):
        """A Check for the block about to unscale, on a state of its own: the last state's scale
        and count, its flags cleared (one op). Its update then changes nothing an earlier block
        or a step still to come holds."""
        state = self._state if self._state is not None else self._device_state(device)
        if state.device != device:  # the model moved (model.cpu(), .cuda()): the scale follows
            state, self._keep = state.to(device), self._keep.to(device)
        state = self._state = torch.mul(state, self._keep)
        check = Check(loss_id, self._host, state)
        self._inv = check.inv
        return check

    def update(self, check, loss):
        """Back off or grow by what `check`'s block found, on the device; no sync. A non-finite
        `loss` skips the step and keeps scale and count: the overflow it caused is not counted
        (effective), the count the update adds is taken back first, and the flag the step reads
        is set. Every rank agrees on the flags first (one
        collective, none in one process). Then the copy of the state to the host."""
        zero = loss.detach() * 0  # NaN exactly where the loss is not finite
        if zero.dim() or zero.device != check.bad.device:  # a loss of shape (1,), another device
            zero = zero.sum().to(check.bad.device)
        torch.ne(zero, 0, out=check.bad)
        if distributed.default_group() is not None and distributed.is_distributed():
            # Both words are 0 or positive (the bits of 0.0 / 1.0, and 0 / 1): MAX over the
            # int32 words is MAX over their values.
            distributed.reduce_flag(check.state[FOUND : BAD + 1])
        inv, known = check.inv, self._host
        torch.gt(check.found, check.bad, out=check.effective)
        check.tracker.sub_(check.bad)
        # The scale's rule on its inverse: a back-off doubles it, a growth halves it.
        torch._amp_update_scale_(
            inv, check.tracker, check.effective, 0.5, 2.0, known.growth_interval
        )
        # A non-finite loss skips the step even where its gradients are finite (`loss + inf`).
        torch.maximum(check.found, check.bad, out=check.found)
        if known.may_reach_a_bound():  # else the clamp could change nothing: left out
            inv.clamp_(*self._inv_bounds)
        # Host memory for the copy: a few buffers reused in turn, the oldest once read.
        hosts = self._hosts
        if len(hosts) < _HOST_COPIES:
            host = torch.empty(STATE_LENGTH, dtype=torch.int32, pin_memory=inv.is_cuda)
            host = (host, host.view(torch.float32))
            hosts.append(host)
            self._host_checks.append(check)
        else:
            slot = self._next_host = (self._next_host + 1) % _HOST_COPIES
            host = hosts[slot]
            if not self._host_checks[slot].learned:
                known.read(wait=True)  # a copy that old: read before it is overwritten
            self._host_checks[slot] = check
        check.post(host)

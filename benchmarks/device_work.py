"""The device work of one training step, counted below autograd: what a GPU would be asked to do.

GPUs are lent rarely; these counts are the CPU proxies a GPU change is held to. A
TorchDispatchMode sees every aten op a step runs (forward, backward, loss scaling, optimizer),
with its tensors, and counts:

  launches     ops that run a kernel: every aten op but views, allocations (empty*),
               detach/alias and host reads; other namespaces (prim.device, the profiler's markers)
               launch nothing. A foreach op counts once (CUDA splits a long list into a few
               launches of up to ~110 tensors each; the same for every variant).
  bytes        bytes each op reads and writes: every tensor argument is read, except the
               destinations of copy_/fill_/zero_ and out= arguments; every argument the op's
               schema marks as written, and every new output, is written (a fused optimizer's
               gradients are written only when it unscales them: its kernel stores them back). This is the traffic of an ideal kernel: a matmul
               that re-reads its inputs from cache counts them once.
  saved        bytes of the tensors autograd saves for backward (their storages, once each),
               leaving out parameters and master weights, which exist anyway.
  host reads   ops whose result the host waits for (.item(), bool(tensor)): on a GPU each one
               is a synchronisation. `.tolist()` of a real CPU tensor reads its memory without
               an op, so it is seen on FakeTensors only (one read per element). torch.optim's
               reads of its own step counters are left out: torch keeps them on the host in its
               non-capturable CUDA paths. So are reads of a tensor that `copy_(...,
               non_blocking=True)` filled (a copy into host memory, read once it has arrived:
               the copy is the launch, the read waits for nothing). amp's copies of its flags
               (amp/scaling/scaler.py) are taken as not arrived by the step after them, as on a
               GPU, which runs that far behind the host: where amp would then read the device,
               the read is counted.

amp's CuPy kernels launch outside aten, unseen here: benchmarks/kernel_work.py counts them
from their launch arguments (`kernel_work.kernel_traffic()`).

Phases: "forward" until the first op of a backward, "backward" while autograd's engine runs,
"after backward" from then on (unscaling, the skip decision, the optimizer step, copies back).
Bytes per parameter are the "after backward" bytes over the model's parameter count.

With `fake=True` the model and data are FakeTensors (torch._subclasses.FakeTensorMode): shapes,
dtypes and ops are real, no memory is allocated, so GPT-2 small and ResNet-50 count at their
real sizes on any machine; a host read returns 0 there (no overflow), and torch.optim's step
counter reads 1.
"""

import collections
import contextlib
import dataclasses
import sys
from unittest import mock

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from kernel_work import KernelWork

PHASES = ("forward", "backward", "after backward")

_aten = torch.ops.aten
_NO_KERNEL = {
    _aten.empty.memory_format,
    _aten.empty_strided.default,
    _aten.empty_like.default,
    _aten.new_empty.default,
    _aten.new_empty_strided.default,
    _aten.detach.default,
    _aten.alias.default,
    _aten.lift_fresh.default,
    _aten.resize_.default,
    _aten.set_.source_Storage_storage_offset,
    _aten.set_.source_Tensor,
    _aten.set_.source_Storage,
    _aten._unsafe_view.default,  # a view by another name
}
_HOST_READS = {_aten._local_scalar_dense.default, _aten.is_nonzero.default}
# Ops that overwrite their first argument without reading it.
_OVERWRITE = {
    _aten.copy_.default,
    _aten.fill_.Scalar,
    _aten.fill_.Tensor,
    _aten.zero_.default,
    _aten._foreach_copy_.default,
    _aten._foreach_zero_.default,
}
# torch.optim's fused steps: the schema marks the gradients written (they may be unscaled in
# place); the kernels read them.
_FUSED_STEPS = {
    op
    for name in ("_fused_adam_", "_fused_adamw_", "_fused_sgd_", "_fused_adagrad_")
    if hasattr(_aten, name)
    for op in (
        getattr(getattr(_aten, name), overload) for overload in getattr(_aten, name).overloads()
    )
}


def _tensors(value):
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [item for item in value if isinstance(item, torch.Tensor)]
    return []


def _nbytes(tensor):
    if tensor.layout is not torch.strided:
        return 0
    return tensor.numel() * tensor.element_size()


def _from_torch_optim(frame):
    """Whether the host read comes from torch.optim reading its own step counters."""
    while frame is not None:
        code = frame.f_code
        if code.co_name == "_get_value" and "torch/optim/" in code.co_filename.replace("\\", "/"):
            return True
        frame = frame.f_back
    return False


@dataclasses.dataclass
class PhaseWork(KernelWork):
    host_reads: int = 0


@dataclasses.dataclass
class StepWork:
    """What one step asked of the device, per phase, with the ops that launched."""

    phases: dict
    saved: int  # bytes saved for backward (non-parameter storages)
    parameters: int  # elements in the model's parameters
    ops: collections.Counter  # (phase, op name) -> launches
    op_bytes: collections.Counter  # (phase, op name) -> bytes read and written

    @property
    def launches(self):
        return sum(phase.launches for phase in self.phases.values())

    @property
    def bytes(self):
        return sum(phase.bytes for phase in self.phases.values())

    @property
    def host_reads(self):
        return sum(phase.host_reads for phase in self.phases.values())

    @property
    def bytes_per_parameter_after_backward(self):
        return self.phases["after backward"].bytes / self.parameters


class DeviceWork(TorchDispatchMode):
    """Counts the device work of the ops run inside it (see the module doc)."""

    def __init__(self, fake=False):
        super().__init__()
        self.fake = fake
        self.phases = {name: PhaseWork() for name in PHASES}
        self.ops = collections.Counter()
        self.op_bytes = collections.Counter()
        self._backward_seen = False
        self._host_copies = set()  # storages that a non-blocking copy filled

    def _phase(self):
        if torch._C._current_graph_task_id() != -1:
            self._backward_seen = True
            return "backward"
        return "after backward" if self._backward_seen else "forward"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        phase_name = self._phase()
        phase = self.phases[phase_name]
        if func in _HOST_READS:
            from_optim = _from_torch_optim(sys._getframe(1))
            if not (from_optim or _storage_key(args[0]) in self._host_copies):
                phase.host_reads += 1
            if self.fake:
                value = 1 if from_optim else 0
                return bool(value) if func is _aten.is_nonzero.default else value
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        if func is _aten.copy_.default and (
            kwargs.get("non_blocking") or (len(args) > 2 and args[2])
        ):
            self._host_copies.add(_storage_key(args[0]))
        if func.is_view or func in _NO_KERNEL or func.namespace != "aten":
            return out
        phase.launches += 1
        before = phase.bytes
        schema = func._schema
        written = set()
        for index, argument in enumerate(schema.arguments):
            if index < len(args):
                value = args[index]
            elif argument.name in kwargs:
                value = kwargs[argument.name]
            else:
                continue
            tensors = _tensors(value)
            if not tensors:
                continue
            writes = argument.alias_info is not None and argument.alias_info.is_write
            if func in _FUSED_STEPS and argument.name == "grads":
                writes = kwargs.get("grad_scale") is not None  # unscaled in place, stored back
            overwrite = (index == 0 and func in _OVERWRITE) or (writes and argument.kwarg_only)
            for tensor in tensors:
                size = _nbytes(tensor)
                if not overwrite:
                    phase.read += size
                if writes:
                    phase.written += size
                    written.add(id(tensor))
        for returned, value in zip(schema.returns, out if isinstance(out, tuple) else (out,)):
            if returned.alias_info is None:
                phase.written += sum(_nbytes(t) for t in _tensors(value) if id(t) not in written)
        self.ops[phase_name, func.__name__] += 1
        self.op_bytes[phase_name, func.__name__] += phase.bytes - before
        return out


def _storage_key(tensor):
    return tensor.untyped_storage()._cdata


@contextlib.contextmanager
def copies_in_flight():
    """amp's host copies of its flags have not arrived by the step after them (module doc)."""
    from amp.scaling.device_scale import Check

    arrived = Check.arrived

    def not_yet(check, wait=False):
        return arrived(check, wait) if wait or check.learned else False

    with mock.patch.object(Check, "arrived", not_yet):
        yield


def measure(trainer, batch, parameters, parameter_count, fake=False, warmup=2):
    """StepWork of one step of `trainer` on `batch`, after `warmup` steps. `parameters`: the
    tensors that exist anyway (the model's parameters), left out of `saved`; `parameter_count`:
    the model's parameter elements (the denominator of bytes per parameter)."""
    with copies_in_flight():
        return _measure(trainer, batch, parameters, parameter_count, fake, warmup)



def _measure(trainer, batch, parameters, parameter_count, fake, warmup):
    counter = DeviceWork(fake)
    with counter:  # the warm-up too: under FakeTensorMode its host reads need an answer
        for _ in range(warmup):
            trainer.step(*batch)
    counter = DeviceWork(fake)
    persistent = {_storage_key(p) for p in parameters}
    saved = {}

    def pack(tensor):
        key = _storage_key(tensor)
        if key not in persistent:
            saved[key] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), counter:
        trainer.step(*batch)
    return StepWork(
        phases=counter.phases,
        saved=sum(saved.values()),
        parameters=parameter_count,
        ops=counter.ops,
        op_bytes=counter.op_bytes,
    )


def step_work(workload, variant, dtype, optimizer="foreach", fake=True):
    """StepWork of `variant` (benchmarks/variants.py) training `workload` (workloads.py)."""
    import variants
    import workloads

    mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else None
    if mode is not None:
        mode.__enter__()
    try:
        torch.manual_seed(0)
        model = workload.model()
        count = sum(p.numel() for p in model.parameters())
        trainer = variants.setup(variant, model, workloads.loss_fn, dtype, optimizer)
        try:
            batch = workload.batch("cpu")
            return measure(trainer, batch, list(model.parameters()), count, fake=fake)
        finally:
            trainer.close()
    finally:
        if mode is not None:
            mode.__exit__(None, None, None)

"""Load-independent figures of one training step: Python calls and the allocator's peak bytes.

python_calls   cProfile's total_calls of one step after `warmup` steps and after the loss
               scale has settled (Python functions and the builtins they call; a noisy machine
               cannot blur it)
settle         steps until the loss scale stays put for two steps: a step that skips for an
               overflow, or the step after it (amp watches that one to name the overflow's
               origin), is not the training step that a figure should describe
scaling_calls  the Python calls loss scaling adds to a step: amp's zero_grad + scale_loss +
               step at an opt level against the same step at that level with the loss
               backpropagated unscaled (what the level itself costs in forward, backward and
               step left out: O1's casting in them is not scaling), and torch.amp.GradScaler's
               scale / unscale_ / step / update against a plain step, at 10 parameter tensors
peak_memory    live bytes at the start of one step (after a warm-up step: model, optimizer
               state, masters, data) and their peak during it, everything included.
               CPU: torch.profiler with profile_memory, whose events carry each allocation and
               free of the CPU allocator; the trainer is built inside the profiled window, so
               the running sum of those events is the live total. CUDA: torch.cuda's
               memory_allocated and max_memory_allocated (the caching allocator's live bytes,
               not its reserve).
"""

import cProfile
import gc
import pstats

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

import amp

_MARK = "benchmarks::measured_step"


def settle(trainer, batch, limit=50):
    """Step until two steps in a row leave the loss scale unchanged (float16's first steps skip
    while the scale comes down); returns the steps taken."""
    steady, scale = 0, trainer.loss_scale()
    for taken in range(1, limit + 1):
        if scale is None or steady == 2:
            return taken - 1
        trainer.step(*batch)
        scale, before = trainer.loss_scale(), scale
        steady = steady + 1 if scale == before else 0
    raise RuntimeError(f"the loss scale still changed after {limit} steps")


def python_calls(trainer, batch, warmup=2):
    for _ in range(warmup):
        trainer.step(*batch)
    settle(trainer, batch)
    profiler = cProfile.Profile()
    profiler.enable()
    trainer.step(*batch)
    profiler.disable()
    return pstats.Stats(profiler).total_calls


def _step_calls(fn):
    for _ in range(3):
        fn()
    profiler = cProfile.Profile()
    profiler.enable()
    fn()
    profiler.disable()
    return pstats.Stats(profiler).total_calls


def scaling_calls(opt_level, dtype=torch.bfloat16, layers=5):
    """(calls amp's scaling adds to a step at `opt_level`, calls torch.amp.GradScaler adds to a
    plain step) at 2 * `layers` tensors."""

    def make():
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(layers)])
        return model, torch.optim.SGD(model.parameters(), lr=0.01)

    x = torch.randn(4, 8)
    model, optimizer = make()
    scaler = torch.amp.GradScaler("cpu")

    def plain():
        optimizer.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        optimizer.step()

    def torch_path():
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(model(x).square().mean()).backward()
        scaler.unscale_(optimizer)  # as for gradient clipping; without it the count is the same
        scaler.step(optimizer)
        scaler.update()

    base = _step_calls(plain)
    torch_adds = _step_calls(torch_path) - base
    model, optimizer = make()
    model, optimizer = amp.initialize(
        model, optimizer, opt_level=opt_level, dtype=dtype, verbosity=0
    )

    def amp_path():
        optimizer.zero_grad(set_to_none=True)
        loss = model(x).float().square().mean()
        with amp.scale_loss(loss, optimizer) as scaled:
            scaled.backward()
        optimizer.step()

    def amp_plain():  # the same step at this level, its loss not scaled
        optimizer.zero_grad(set_to_none=True)
        model(x).float().square().mean().backward()
        optimizer.step()

    try:
        amp_adds = _step_calls(amp_path) - _step_calls(amp_plain)
    finally:
        amp.deinitialize()
    return amp_adds, torch_adds


def peak_memory(build, warm_batch, batch, device):
    """(bytes live when a step starts, peak bytes live during it). `build()` makes the trainer;
    `warm_batch()` and `batch()` make (inputs, targets) for the warm-up and the measured step."""
    gc.collect()
    if device == "cuda":
        return _peak_cuda(build, warm_batch, batch)
    return _peak_cpu(build, warm_batch, batch)


def _peak_cuda(build, warm_batch, batch):
    trainer = build()
    try:
        trainer.step(*warm_batch())
        inputs = batch()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        trainer.step(*inputs)
        torch.cuda.synchronize()
        return before, torch.cuda.max_memory_allocated()
    finally:
        trainer.close()
        del trainer
        gc.collect()
        torch.cuda.empty_cache()


def _peak_cpu(build, warm_batch, batch):
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        trainer = build()
        try:
            trainer.step(*warm_batch())
            inputs = batch()
            with record_function(_MARK):
                trainer.step(*inputs)
        finally:
            trainer.close()
    return marked_peak(profiler, _MARK)


def marked_peak(profiler, mark_name):
    """(live bytes when the range `mark_name` began, their peak in it) from a CPU profile with
    profile_memory whose window began before anything measured was allocated."""
    events = list(profiler.profiler.kineto_results.events())
    (mark,) = [e for e in events if e.name() == mark_name]
    begin, end = mark.start_ns(), mark.start_ns() + mark.duration_ns()
    memory = sorted(
        (e.start_ns(), e.nbytes())
        for e in events
        if e.name() == "[memory]" and e.device_type() == DeviceType.CPU
    )
    live, before, peak = 0, None, 0
    for time, change in memory:
        if time >= begin and before is None:
            before = peak = live
        if time > end:
            break
        live += change
        if before is not None:
            peak = max(peak, live)
    if before is None:  # no allocation in the range
        before = peak = live
    return before, peak

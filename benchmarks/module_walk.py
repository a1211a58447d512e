"""Which amp modules one settled O2 training step walks through, in order.

    python benchmarks/module_walk.py [--optimizer adamw|sgd] [--dtype bfloat16|float16]
                                     [--form exact|compact-int8] [--state-dict]

A Linear-BatchNorm-Linear model (plus 20 FP32 buffers) at O2 with AdamW (torch's default
implementation), trained until the loss scale has settled; then one step is traced with
sys.setprofile: forward, `scale_loss` with backward, `optimizer.step()`,
`optimizer.zero_grad()`. Each amp function called is a visit to its module, amp/kernels counted
as one room (its public functions and its backends are one interface); consecutive calls into
one module are one visit. It prints the modules entered, the transitions between them (visits -
1), the sequence, and the amp calls of one forward. `--form compact-int8` trains compact masters
with 8-bit state. With --state-dict a `model.state_dict()` is taken before the traced step: later
forwards should cost what they cost before it.

Counts, not times: they do not move with the load of the machine.
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import amp  # noqa: E402

AMP_ROOT = os.path.dirname(os.path.abspath(amp.__file__))


def _module(filename):
    """'weights/optimizer' for an amp source file ('kernels' for any of amp/kernels), else
    None."""
    path = os.path.abspath(filename)
    if not path.startswith(AMP_ROOT + os.sep):
        return None
    module = os.path.relpath(path, AMP_ROOT)[: -len(".py")]
    return "kernels" if module.startswith("kernels" + os.sep) else module


class Walk:
    """The amp module of each amp function called, in order (consecutive calls into one module
    are one visit), and the number of amp calls."""

    def __init__(self):
        self.visits = []
        self.calls = 0

    def __call__(self, frame, event, arg):
        if event != "call":
            return
        module = _module(frame.f_code.co_filename)
        if module is None:
            return
        self.calls += 1
        if not self.visits or self.visits[-1] != module:
            self.visits.append(module)

    def __enter__(self):
        sys.setprofile(self)
        return self

    def __exit__(self, *exc):
        sys.setprofile(None)

    @property
    def modules(self):
        return sorted(set(self.visits))

    @property
    def transitions(self):
        return max(len(self.visits) - 1, 0)


BUFFERS = 20


class Offsets(torch.nn.Module):
    """Adds `count` FP32 buffers (cast with the model at O2, each kept by amp with its FP32 value)."""

    def __init__(self, width, count):
        super().__init__()
        for index in range(count):
            self.register_buffer(f"offset{index}", torch.full((width,), 0.01 * index))

    def forward(self, x):
        return x + self.offset0


FORMS = {"exact": {}, "compact-int8": dict(master_weights="compact", optimizer_state="int8")}


def make_trainer(optimizer_kind, dtype, form="exact"):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16),
        torch.nn.BatchNorm1d(16),
        torch.nn.ReLU(),
        Offsets(16, BUFFERS),
        torch.nn.Linear(16, 4),
    )
    if optimizer_kind == "adamw":
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    model, optimizer = amp.initialize(
        model, optimizer, opt_level="O2", dtype=dtype, verbosity=0, **FORMS[form]
    )
    return model, optimizer, torch.randn(32, 8), torch.randn(32, 4)


def one_step(model, optimizer, x, y):
    loss = torch.nn.functional.mse_loss(model(x), y)
    with amp.scale_loss(loss, optimizer) as scaled:
        scaled.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def walk(optimizer_kind="adamw", dtype=torch.bfloat16, state_dict=False, form="exact"):
    """(Walk of one settled step, amp calls of one forward before and after a state dict)."""
    model, optimizer, x, y = make_trainer(optimizer_kind, dtype, form)
    for _ in range(3):
        one_step(model, optimizer, x, y)
    forward_before = _forward_calls(model, x)
    if state_dict:
        model.state_dict()
        one_step(model, optimizer, x, y)
    forward_after = _forward_calls(model, x)
    with Walk() as step:
        one_step(model, optimizer, x, y)
    amp.deinitialize()
    return step, forward_before, forward_after


def _forward_calls(model, x):
    with Walk() as forward:
        with torch.no_grad():
            model(x)
    return forward.calls


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    parser.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    parser.add_argument("--form", choices=tuple(FORMS), default="exact")
    parser.add_argument("--state-dict", action="store_true")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    step, before, after = walk(args.optimizer, dtype, args.state_dict, args.form)
    print(f"one settled O2 {args.optimizer} step ({args.dtype}, {args.form}, dynamic loss scale)")
    print(f"  amp modules entered: {len(step.modules)}")
    print(f"  module-to-module transitions: {step.transitions}")
    print(f"  amp calls: {step.calls}")
    print("  modules: " + ", ".join(step.modules))
    print("  sequence: " + " > ".join(v.rsplit("/", 1)[-1] for v in step.visits))
    after_text = f"; after model.state_dict(): {after}" if args.state_dict else ""
    print(f"amp calls of one forward: {before}{after_text}")


if __name__ == "__main__":
    main()

"""When training goes wrong, amp says why: a model broken on purpose, and what amp prints.

One layer of a small classifier gets weights large enough that its output overflows float16
(FP32 holds it). At O1 every step is then skipped. apex would halve the loss scale each time,
down to nothing, and say only "Gradient overflow"; amp instead

  1. keeps the loss scale (the loss itself is inf: no scale can fix that) and warns once,
  2. watches the step after the first skip and names the module where the inf started,
  3. measures every module in FP32 and in float16 (amp.audit) and says what to keep in FP32,
  4. trains with that advice applied (fp32_modules=...), skipping nothing.

    python examples/what_went_wrong.py
    python examples/what_went_wrong.py --device cuda --steps 5
"""

import logging
import os
import sys
import warnings

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from common import device_argument  # noqa: E402
from common import parser as example_parser  # noqa: E402

import amp  # noqa: E402


class Classifier(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(16, 32)
        self.body = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.GELU())
        self.norm = torch.nn.LayerNorm(32)
        self.head = torch.nn.Linear(32, 4)

    def forward(self, x):
        return self.head(self.norm(self.body(self.embed(x))))


def broken_model(device):
    torch.manual_seed(0)
    model = Classifier().to(device)
    with torch.no_grad():
        model.body[0].weight.mul_(1e5)  # fine in FP32, beyond float16's 65504 once multiplied
    return model


def batches(device, steps):
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(64, 16, generator=generator)
        yield x.to(device), (x[:, :4].argmax(-1)).to(device)


def train(model, device, steps, fp32_modules=None):
    """Train at O1; return what amp reported: skips, scales and the last overflow report."""
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    model, optimizer = amp.initialize(
        model, optimizer, opt_level="O1", verbosity=1, fp32_modules=fp32_modules
    )
    skipped, scales, report = 0, [], None
    try:
        for x, y in batches(device, steps):
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            with amp.scale_loss(loss, optimizer) as scaled:
                scaled.backward()
            before = amp.last_overflow()
            optimizer.step()
            if amp.last_overflow() is not before:
                skipped += 1
                report = amp.last_overflow()
            scales.append(amp.state_dict()["loss_scaler0"]["loss_scale"])
    finally:
        amp.deinitialize()
    return {"skipped": skipped, "scales": scales, "report": report}


def main(argv=None):
    parser = example_parser(__doc__)
    device_argument(parser)
    parser.add_argument("--steps", type=int, default=6, help="steps of each training run")
    args = parser.parse_args(argv)

    # amp's skip messages go to the "amp" logger; show them (not its set-up report) on stdout.
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("  [amp] %(message)s"))
    handler.addFilter(lambda record: "Skipping step" in record.getMessage())
    logger = logging.getLogger("amp")
    logger.addHandler(handler)
    try:
        print(f"1. Training the broken model at O1 for {args.steps} steps:")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", amp.NonFiniteLossWarning)
            broken = train(broken_model(args.device), args.device, args.steps)
        for warning in caught:
            print(f"  [warning] {warning.category.__name__}: {warning.message}")
        print(f"  skipped {broken['skipped']} of {args.steps} steps; loss scale {broken['scales']}")
        print(f"  amp.last_overflow().origin = {broken['report'].origin!r}")

        print("\n2. amp.audit(...) on the same model and batch:")
        model = broken_model(args.device)
        x, y = next(batches(args.device, 1))
        report = amp.audit(lambda: F.cross_entropy(model(x), y), model, dtype=torch.float16)
        print("  " + str(report).replace("\n", "\n  "))
        print("\n3. report.suggest():")
        print("  " + report.suggest().replace("\n", "\n  "))

        keep = report.keep_fp32()
        print(f"\n4. Training again with fp32_modules={keep}:")
        fixed = train(model, args.device, args.steps, fp32_modules=keep)
        print(f"  skipped {fixed['skipped']} of {args.steps} steps; loss scale {fixed['scales']}")
    finally:
        logger.removeHandler(handler)
    return {"broken": broken, "audit": report, "fixed": fixed}


if __name__ == "__main__":
    main()

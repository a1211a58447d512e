"""A first run of amp: train a digit classifier at O0, O1, O2 and O3, in float16 and bfloat16.

The data is scikit-learn's digits set (1,797 8x8 images of 0-9 written by 43 people, shipped
inside scikit-learn: nothing is downloaded). Every configuration trains the same network from
the same initial weights. The script prints what this machine's hardware does with float16 and
bfloat16 (which explains the step times), a table (test accuracy and its difference to O0, final
loss, time per step, skipped steps, loss scale) and which op ran in which precision, and saves a
plot: the loss curves, the loss scaler at work (a float16 run through the torch.amp-style
amp.GradScaler API that starts at a scale too high and grows after 25 clean steps), the accuracy
of each level against O0, and the precision of each op.

    python examples/demo.py                      # on CUDA when available, else CPU (< 1 min)
    python examples/demo.py --device cpu
    python examples/demo.py --epochs 5 --levels O0 O2 --dtypes bfloat16 --out /tmp/demo
"""

import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from common import device_argument, progress  # noqa: E402
from common import parser as example_parser  # noqa: E402
from demo_plot import plot  # noqa: E402

import amp  # noqa: E402

BATCH_SIZE = 64
GROWTH_INTERVAL = 25  # the GradScaler run's; amp.initialize uses apex's 2000
SCALER_START = 2.0**24  # too high for float16 gradients here: the scaler has to back off
# An emulated low-precision matmul takes at least this many times float32's (it was 45-95x on the
# build machine's CPU); less means the timing was blurred.
EMULATION_AT_LEAST = 1.5


def load_digits(device):
    """(train_x, train_y, test_x, test_y): a fixed 80/20 split, pixels scaled to [0, 1]."""
    from sklearn.datasets import load_digits as sklearn_digits

    data = sklearn_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target, dtype=torch.int64)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    x, y = x[order].to(device), y[order].to(device)
    split = int(0.8 * len(x))
    return x[:split], y[:split], x[split:], y[split:]


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 256),
        torch.nn.BatchNorm1d(256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, 256),
        torch.nn.BatchNorm1d(256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, 10),
    )


def make_optimizer(model, lr=3e-3):
    # eps=1e-4: O3 steps the FP16 weights themselves, where Adam's default 1e-8 is zero.
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4, eps=1e-4)


def batches(train_x, epochs, device, show_progress, desc):
    generator = torch.Generator().manual_seed(1)
    epochs_iter = range(epochs)
    if show_progress:
        epochs_iter = progress(epochs_iter, desc=desc)
    for _ in epochs_iter:
        order = torch.randperm(len(train_x), generator=generator).to(device)
        for start in range(0, len(order) - BATCH_SIZE + 1, BATCH_SIZE):
            yield order[start : start + BATCH_SIZE]


def _synchronize(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _dtype_name(dtype):
    return str(dtype).split(".")[-1]


def _finish(result, model, test_x, test_y, step_times):
    model.eval()
    with torch.no_grad():
        result["accuracy"] = (model(test_x).argmax(-1) == test_y).float().mean().item()
    # The fastest step: other load on the machine only ever adds time, so it shows the cost.
    result["ms per step"] = 1e3 * min(step_times)
    result["final loss"] = sum(result["losses"][-20:]) / len(result["losses"][-20:])
    result["skipped"] = len(result["backoffs"])
    result["loss scale"] = result["scales"][-1]
    return result


def train(opt_level, dtype, device="cpu", epochs=10, lr=3e-3, show_progress=False):
    """Train one configuration through amp.initialize; return its results and histories."""
    train_x, train_y, test_x, test_y = load_digits(device)
    model = make_model().to(device)
    optimizer = make_optimizer(model, lr)
    model, optimizer = amp.initialize(
        model, optimizer, opt_level=opt_level, dtype=dtype, verbosity=0
    )
    dtype_name = "float32" if opt_level == "O0" else _dtype_name(dtype)
    result = {"level": opt_level, "dtype": dtype_name, "losses": [], "scales": [], "backoffs": []}
    step_times = []
    try:
        model.train()
        desc = f"{opt_level} {dtype_name}"
        for step, index in enumerate(batches(train_x, epochs, device, show_progress, desc)):
            began = time.perf_counter()
            loss = F.cross_entropy(model(train_x[index]), train_y[index])
            with amp.scale_loss(loss, optimizer) as scaled_loss:
                scaled_loss.backward()
            before = amp.last_overflow()
            optimizer.step()
            optimizer.zero_grad()
            _synchronize(device)
            step_times.append(time.perf_counter() - began)
            if amp.last_overflow() is not before:
                result["backoffs"].append(step)
            result["losses"].append(loss.item())
            result["scales"].append(amp._amp_state.loss_scalers[0].loss_scale())
        return _finish(result, model, test_x, test_y, step_times)
    finally:
        amp.deinitialize()


def train_with_grad_scaler(device="cpu", epochs=10, show_progress=False):
    """The same training, torch.amp style: amp.autocast(float16) and amp.GradScaler.

    The scaler starts at 2**24, too high: float16 gradients overflow, it halves the scale and
    skips the step until they fit; after 25 clean steps it doubles the scale, probing upwards.
    """
    train_x, train_y, test_x, test_y = load_digits(device)
    model = make_model().to(device)
    optimizer = make_optimizer(model)
    scaler = amp.GradScaler(init_scale=SCALER_START, growth_interval=GROWTH_INTERVAL)
    result = {"level": "GradScaler", "dtype": "float16", "losses": [], "scales": []}
    result.update(backoffs=[], growths=[])
    step_times = []
    model.train()
    desc = "autocast + GradScaler"
    for step, index in enumerate(batches(train_x, epochs, device, show_progress, desc)):
        began = time.perf_counter()
        with amp.autocast(dtype=torch.float16):
            loss = F.cross_entropy(model(train_x[index]), train_y[index])
        scale = scaler.get_scale()
        scaler.scale(loss).backward()
        scaler.step(optimizer)  # skipped when the gradients hold inf/NaN
        scaler.update()
        optimizer.zero_grad()
        _synchronize(device)
        step_times.append(time.perf_counter() - began)
        new_scale = scaler.get_scale()
        if new_scale < scale:
            result["backoffs"].append(step)
        elif new_scale > scale:
            result["growths"].append(step)
        result["losses"].append(loss.item())
        result["scales"].append(new_scale)
    return _finish(result, model, test_x, test_y, step_times)


# Rows of the precision table: (label, the op amp.trace() records for it, the module type).
OPS = [
    ("Linear (matmul)", "torch.nn.functional.linear", torch.nn.Linear),
    ("BatchNorm1d", "torch.nn.functional.batch_norm", torch.nn.BatchNorm1d),
    ("ReLU", "torch.nn.functional.relu", torch.nn.ReLU),
    ("cross_entropy", "torch.nn.functional.cross_entropy", None),
]


def precision_table(levels, dtype, device="cpu"):
    """{level: {row label: dtype name}}: the dtype each op computed in, and O1's amp.trace().

    At O1 amp decides per op, and amp.trace() records the dtype each patched call ran in. Ops
    O1 does not patch, and every op at O0/O2/O3, compute in their weights' dtype (batch norm's
    statistics) or in their input's.
    """
    train_x, train_y, _, _ = load_digits(device)
    x, y = train_x[:BATCH_SIZE], train_y[:BATCH_SIZE]
    table, o1_trace = {}, None
    for level in levels:
        model = make_model().to(device)
        optimizer = make_optimizer(model)
        model, optimizer = amp.initialize(
            model, optimizer, opt_level=level, dtype=dtype, verbosity=0
        )
        seen = {}

        def record(module, inputs, output, seen=seen):
            params = list(module.parameters(recurse=False))
            seen.setdefault(type(module), (params[0] if params else output).dtype)

        hooks = [module.register_forward_hook(record) for module in model]
        try:
            with amp.trace() as trace:
                loss = F.cross_entropy(model(x), y)
        finally:
            for hook in hooks:
                hook.remove()
            amp.deinitialize()
        traced = {record.op: record.ran_in for record in trace}
        row = {}
        for label, op, module_type in OPS:
            ran_in = traced.get(op) or seen.get(module_type) or loss.dtype
            row[label] = _dtype_name(ran_in)
        table[level] = row
        if level == "O1":
            o1_trace = trace
    return table, o1_trace


def measure_matmul(device, dtypes, rounds=7):
    """(size, {dtype: milliseconds}) of a square matmul in float32 and each dtype, measured here.

    Each round times every dtype once, in turn, so load elsewhere on the machine slows them alike;
    the best round of each counts, as load only ever adds time.
    """
    on_gpu = torch.device(device).type == "cuda"
    size = 4096 if on_gpu else 256
    operands = {
        dtype: (torch.randn(size, size, device=device).to(dtype),) * 2
        for dtype in (torch.float32, *dtypes)
    }
    best = dict.fromkeys(operands, float("inf"))
    for a, b in operands.values():
        a @ b  # warm-up
    for _ in range(rounds):
        for dtype, (a, b) in operands.items():
            _synchronize(device)
            began = time.perf_counter()
            a @ b
            _synchronize(device)
            best[dtype] = min(best[dtype], time.perf_counter() - began)
    return size, {dtype: 1e3 * seconds for dtype, seconds in best.items()}


def timing_line(size, times, support):
    """The measured figures, reported as figures. What the demo says about speed comes from the
    hardware facts (amp.hardware): a busy machine can blur a timing, not the facts."""
    base = times[torch.float32]
    low = [d for d in times if d is not torch.float32]
    measured = ", ".join(
        f"{_dtype_name(d)} {times[d]:.2f} ms ({times[d] / base:.1f}x float32)" for d in low
    )
    line = f"Timed here, a {size}x{size} matmul: float32 {base:.2f} ms, {measured}."
    # Native units are faster than float32; emulation converts to float32 and back, which
    # costs well over float32's time. A timing that says otherwise was blurred (load on the
    # machine, or a matmul too small for the units to show).
    odd = [
        _dtype_name(d)
        for d in low
        if (times[d] > base if support.fast(d) else times[d] < EMULATION_AT_LEAST * base)
    ]
    if odd:
        line += (
            f" The {' and '.join(odd)} figure{'s' if len(odd) > 1 else ''} disagree"
            f"{'' if len(odd) > 1 else 's'} with the hardware above: this machine is busy (or the "
            "matmul too small to show it); the hardware decides what is said here."
        )
    return line


def explain_hardware(device, dtypes):
    """Lines on what the hardware does with low precision, what that means here, and a timing."""
    from amp import hardware

    support = hardware.support(device)
    size, times = measure_matmul(device, dtypes)
    lines = [support.summary(), timing_line(size, times, support)]
    slow = [d for d in dtypes if not support.fast(d)]
    if slow:
        lines.append(
            "So O1-O3 in " + " and ".join(map(_dtype_name, slow)) + " step slower than O0 on "
            "this machine: amp works as intended; the gain needs hardware with fast low-precision "
            "units (a GPU with Tensor Cores, or a CPU with AMX)."
        )
    if support.is_gpu:
        lines.append(
            "This network is small (64x256 matmuls): a step is mostly kernel launches and Python, "
            "so the levels' step times are close; Tensor Cores pay off on large matmuls."
        )
    lines.append(
        "O1 also casts at each patched call (a Python wrapper, and the weights' casts each "
        "step); O2/O3 cast the model once and run it in low precision."
    )
    return lines


def configurations(levels, dtypes):
    """O0 ignores the low-precision type, so it runs once."""
    for level in levels:
        for dtype in dtypes if level != "O0" else dtypes[:1]:
            yield level, dtype


COLUMNS = ["level", "dtype", "accuracy", "vs O0", "final loss", "ms per step", "skipped"]


def print_table(results, device, epochs):
    reference = next((r["accuracy"] for r in results if r["level"] == "O0"), None)
    print(f"\ndigits, {epochs} epochs on {device} (ms per step: the fastest step)")
    print("  ".join(f"{c:>11}" for c in COLUMNS + ["loss scale"]))
    for result in results:
        delta = "" if reference is None else f"{100 * (result['accuracy'] - reference):+.1f} pts"
        cells = [
            result["level"],
            result["dtype"],
            f"{result['accuracy']:.4f}",
            "-" if result["level"] == "O0" else delta,
            f"{result['final loss']:.4f}",
            f"{result['ms per step']:.2f}",
            str(result["skipped"]),
            f"{result['loss scale']:g}",
        ]
        print("  ".join(f"{cell:>11}" for cell in cells))


def main(argv=None):
    parser = example_parser(__doc__)
    device_argument(parser)
    parser.add_argument("--epochs", type=int, default=10, help="epochs each configuration trains")
    parser.add_argument(
        "--levels",
        nargs="+",
        default=["O0", "O1", "O2", "O3"],
        choices=["O0", "O1", "O2", "O3"],
        help="amp opt levels to train",
    )
    parser.add_argument(
        "--dtypes",
        nargs="+",
        default=["float16", "bfloat16"],
        choices=["float16", "bfloat16"],
        help="low-precision types to train O1-O3 in",
    )
    parser.add_argument(
        "--out",
        default=os.path.join(os.path.dirname(__file__), "out"),
        help="folder for the plot (demo.png)",
    )
    args = parser.parse_args(argv)
    dtypes = [getattr(torch, name) for name in args.dtypes]
    hardware_lines = explain_hardware(args.device, dtypes)
    print("\n".join(hardware_lines))
    results = [
        train(level, dtype, args.device, args.epochs, show_progress=True)
        for level, dtype in configurations(args.levels, dtypes)
    ]
    # At least 4 epochs (88 steps): room for the scaler to back off and then grow.
    scaler_run = train_with_grad_scaler(args.device, max(args.epochs, 4), show_progress=True)
    print_table(results + [scaler_run], args.device, args.epochs)
    print(
        f"GradScaler row: amp.autocast(float16) + amp.GradScaler(init_scale=2**24, "
        f"growth_interval={GROWTH_INTERVAL}), {max(args.epochs, 4)} epochs: "
        f"{len(scaler_run['backoffs'])} overflows (step skipped, scale halved), "
        f"{len(scaler_run['growths'])} growths (scale doubled)."
    )
    table, o1_trace = precision_table(args.levels, dtypes[0], args.device)
    if o1_trace is not None:
        print(f"\nO1 {args.dtypes[0]}, one forward pass and loss under amp.trace():\n{o1_trace}")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "demo.png")
    plot(
        results,
        scaler_run,
        table,
        hardware_lines,
        path,
        args.epochs,
        SCALER_START,
        GROWTH_INTERVAL,
    )
    print(f"plot: {path}")
    return results + [scaler_run]


if __name__ == "__main__":
    main()

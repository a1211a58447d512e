"""The demo's figure: six panels a newcomer reads without the code (see demo.py).

demo.py draws it (examples/out/demo.png by default); this module does nothing on its own. Run
`python examples/demo.py` (`--help` for its options).
"""

import textwrap


def _label(run):
    if run["level"] == "GradScaler":
        return "autocast + GradScaler float16"
    return f"{run['level']} {run['dtype']}"


def plot(results, scaler_run, table, hardware_lines, path, epochs, scaler_start, growth_interval):
    """Six panels: loss, loss scale, accuracy; op precisions, step times, why those times."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(2, 3, figsize=(19, 11), layout="constrained")
    (loss_axes, scale_axes, accuracy_axes), (table_axes, time_axes, text_axes) = axes
    runs = results + [scaler_run]
    colors = plt.get_cmap("tab10")
    color = {id(run): colors(i) for i, run in enumerate(runs)}
    reference = next((r for r in results if r["level"] == "O0"), None)

    # 1. Loss curves: every level learns as O0 does.
    window = 10
    for run in runs:
        losses = run["losses"]
        smooth = [
            sum(losses[max(0, i - window) : i + 1]) / len(losses[max(0, i - window) : i + 1])
            for i in range(len(losses))
        ]
        style = "--" if run is scaler_run else "-"
        loss_axes.plot(smooth, style, label=_label(run), linewidth=1.2, color=color[id(run)])
    loss_axes.set(
        title="1. Training loss: every level learns as O0 (float32) does",
        xlabel="training step",
        ylabel="cross entropy (moving average of 10 steps)",
        yscale="log",
    )
    loss_axes.legend(fontsize=8, ncol=2)
    loss_axes.grid(alpha=0.3)

    # 2. The loss scaler at work: the scale in force at each step, starting from init_scale.
    scales = [scaler_start] + scaler_run["scales"]
    scale_axes.step(
        range(len(scales)),
        scales,
        where="post",
        color="black",
        linewidth=1.3,
        label="autocast + GradScaler, float16: the scale in force",
    )
    for steps, marker, shade, text in (
        (
            scaler_run["backoffs"],
            "v",
            "tab:red",
            "overflow: inf/NaN in the gradients; step skipped, scale halved",
        ),
        (
            scaler_run["growths"],
            "^",
            "tab:green",
            f"{growth_interval} clean steps in a row: scale doubled",
        ),
    ):
        scale_axes.scatter(
            [s + 1 for s in steps],
            [scales[s + 1] for s in steps],
            marker=marker,
            color=shade,
            zorder=3,
            label=f"{text} ({len(steps)}x)",
        )
    dynamic = [r for r in results if r["level"] in ("O1", "O2")]
    if dynamic:
        scale_axes.axhline(
            dynamic[0]["scales"][-1],
            color="tab:blue",
            linestyle=":",
            linewidth=1.2,
            label="O1/O2 via amp.initialize: 2^16, never overflowed here",
        )
    scale_axes.set_yscale("log", base=2)
    scale_axes.set_ylim(2.0**14, 2.0**33)
    scale_axes.set(
        title=f"2. The loss scaler at work (starts too high, at 2^{int(scaler_start).bit_length() - 1})",
        xlabel="training step",
        ylabel="loss scale",
    )
    scale_axes.legend(fontsize=8, loc="upper right")
    scale_axes.grid(alpha=0.3)
    scale_axes.text(
        0.03,
        0.75,
        "backward runs on loss x scale, so small float16 gradients do not flush to zero;\n"
        "they are divided by the scale before the step. The scaler keeps the scale as high\n"
        "as float16 allows. bfloat16 has float32's range: it needs no scaling.",
        transform=scale_axes.transAxes,
        fontsize=8.5,
        va="top",
    )

    # 3. Accuracy against O0.
    values = [100 * run["accuracy"] for run in runs]
    bars = accuracy_axes.bar(range(len(runs)), values, color=[color[id(run)] for run in runs])
    for bar, run in zip(bars, runs):
        text = f"{100 * run['accuracy']:.1f}%"
        if reference is not None and run is not reference:
            text += f"\n{100 * (run['accuracy'] - reference['accuracy']):+.1f}"
        accuracy_axes.text(
            bar.get_x() + bar.get_width() / 2,
            bar.get_height() + 0.2,
            text,
            ha="center",
            va="bottom",
            fontsize=8,
        )
    if reference is not None:
        accuracy_axes.axhline(
            100 * reference["accuracy"], color="gray", linestyle="--", linewidth=1
        )
    accuracy_axes.set_ylim(max(0, min(values) - 8), 101.5)
    names = [_label(run).replace(" + ", " +\n").replace(" ", "\n", 1) for run in runs]
    accuracy_axes.set_xticks(range(len(runs)), names, fontsize=8)
    accuracy_axes.set(
        title=f"3. Test accuracy after {epochs} epochs (dashed: O0)",
        ylabel="held-out digits classified correctly (%)",
    )

    # 4. Which op computed in which precision.
    table_axes.axis("off")
    levels = list(table)
    rows = list(next(iter(table.values())))
    cells = [[table[level][row] for level in levels] for row in rows]
    shades = {"float32": "#cfe2f3", "float16": "#fce5cd", "bfloat16": "#d9ead3"}
    drawn = table_axes.table(
        cellText=cells,
        rowLabels=rows,
        colLabels=levels,
        cellColours=[[shades.get(cell, "white") for cell in row] for row in cells],
        cellLoc="center",
        bbox=[0.25, 0.42, 0.75, 0.5],
    )
    drawn.auto_set_font_size(False)
    drawn.set_fontsize(10)
    low = next((c for row in cells for c in row if c != "float32"), "low precision")
    table_axes.set_title(f"4. The precision of each op ({low} runs; O1: amp.trace())")
    table_axes.text(
        0.0,
        0.36,
        "O0: float32 throughout.\n"
        "O1: amp patches torch functions; amp.trace() shows the matmuls (linear)\n"
        "     cast to low precision and the loss computed in float32.\n"
        "O2: the model in low precision except batch norm; the optimizer\n"
        "     steps float32 master weights.\n"
        "O3: everything in low precision (batch norm too).\n"
        "Batch norm keeps float32 statistics wherever its weights are float32.",
        transform=table_axes.transAxes,
        fontsize=9,
        va="top",
        family="monospace",
    )

    # 5. Step times.
    times = [run["ms per step"] for run in runs]
    time_axes.barh(range(len(runs)), times, color=[color[id(run)] for run in runs])
    time_axes.set_yticks(range(len(runs)), [_label(run) for run in runs], fontsize=8)
    time_axes.invert_yaxis()
    for index, value in enumerate(times):
        ratio = f"  ({value / reference['ms per step']:.1f}x O0)" if reference else ""
        time_axes.text(value, index, f" {value:.1f} ms{ratio}", va="center", fontsize=8)
    time_axes.set_xlim(0, max(times) * 1.35)
    verdict = ""
    if reference is not None:
        slower = sum(
            run["ms per step"] > reference["ms per step"] for run in runs if run is not reference
        )
        verdict = ": mixed precision is " + ("slower" if 2 * slower > len(runs) - 1 else "faster")
        verdict += " than O0 here (why: 6)"
    time_axes.set(
        title=f"5. Time per training step{verdict}",
        xlabel="ms per step (the fastest of the run: load elsewhere only adds time)",
    )

    # 6. Why those times: the hardware, read from the machine.
    text_axes.axis("off")
    text_axes.set_title("6. Why: float16 and bfloat16 on this hardware")
    wrapped = "\n\n".join(textwrap.fill(line, 58) for line in hardware_lines)
    text_axes.text(0.0, 1.0, wrapped, transform=text_axes.transAxes, fontsize=10, va="top")

    figure.suptitle(
        "amp: mixed precision on handwritten digits (scikit-learn), O0-O3 in float16 and bfloat16",
        fontsize=13,
    )
    figure.savefig(path, dpi=90)
    plt.close(figure)


if __name__ == "__main__":
    import os
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    from common import parser

    parser(__doc__).parse_args()
    print(__doc__.strip(), file=sys.stderr)

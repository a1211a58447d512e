"""What the benchmarks share: interleaved timing rounds and a plain-text table."""


def format_seconds(value):
    if value >= 1:
        return f"{value:.2f} s"
    if value >= 1e-3:
        return f"{value * 1e3:.3f} ms"
    return f"{value * 1e6:.1f} us"


def _format(value, is_time):
    if isinstance(value, float):
        if is_time:
            return format_seconds(value)
        return f"{value:.3f}" if abs(value) < 100 else f"{value:.0f}"
    return str(value)


def print_table(title, rows, columns, time_columns=()):
    """Print `rows` (dicts) under `title` in `columns` order, leaving out empty columns."""
    columns = [c for c in columns if any(c in row for row in rows)]
    cells = [
        [_format(row.get(c, ""), c in time_columns) if c in row else "" for c in columns]
        for row in rows
    ]
    widths = [
        max(len(column), *(len(cell[i]) for cell in cells)) for i, column in enumerate(columns)
    ]
    print(title)
    print("  ".join(column.ljust(width) for column, width in zip(columns, widths)))
    print("  ".join("-" * width for width in widths))
    for cell in cells:
        print("  ".join(value.ljust(width) for value, width in zip(cell, widths)))
    print(flush=True)


def interleaved_rounds(variants, rounds):
    """Run each variant (a callable returning a list of timings) once per round, in an order that
    rotates from round to round (the first variant of a round runs a few percent slower on this
    machine); round 0 warms up and is dropped. Returns {name: [timings of each round]}."""
    names = list(variants)
    times = {name: [] for name in names}
    for round_index in range(rounds + 1):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            timings = variants[name]()
            if round_index:
                times[name].append(timings)
    return times


def interleaved(variants, rounds):
    """As interleaved_rounds, with the timings of all rounds in one list per variant."""
    return {
        name: [t for round_times in per_round for t in round_times]
        for name, per_round in interleaved_rounds(variants, rounds).items()
    }

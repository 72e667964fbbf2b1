"""The chart of `mrv2 bench sweep` (`--output-png`): grouped bars, one group per batch size, one
bar per (engine, precision), its median decode tokens/s written on it and the spread of the
repeats as a whisker, and where the result has a roofline a dashed line across each group at
the decode tokens/s no engine passes on this machine; titled with the model and the CPU.
matplotlib is optional (the `bench` extra); it is drawn without pyplot, so no display or global
backend is touched.
"""

from __future__ import annotations

from typing import Any

DPI = 100
SIZE_INCHES = (10.0, 5.6)


def check_matplotlib() -> None:
    """ValueError with the install line when matplotlib is missing (before anything runs)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError("--output-png needs matplotlib: pip install 'mrv2[bench]' "
                         "(or pip install matplotlib)") from None


def _bars(result: dict[str, Any], column: str) -> tuple[list[float], list[list[float]],
                                                         list[str]]:
    """Per batch: the median (0 where none), the whisker below/above it, the label."""
    by_batch = {m["batch"]: m for m in result["measurements"] if m["column"] == column}
    heights: list[float] = []
    spread: list[list[float]] = [[], []]
    labels: list[str] = []
    for batch in result["batch_sizes"]:
        cell = by_batch.get(batch)
        median = cell["decode_tok_s_median"] if cell and cell["status"] == "ok" else None
        rates = [r for r in cell["decode_tok_s"] if r is not None] if median else [0.0]
        median = median or 0.0
        heights.append(median)
        spread[0].append(median - min(rates))
        spread[1].append(max(rates) - median)
        status = cell["status"] if cell else "-"
        labels.append(f"{median:.1f}" if median else "-" if status == "ok" else status)
    return heights, spread, labels


def _roofline_marks(result: dict[str, Any]) -> list[tuple[int, float]]:
    """(group index, roofline tok/s) for every batch size the result has a limit for."""
    limits = result.get("roofline", {}).get("decode_tok_s") or {}
    return [(i, float(limits[str(batch)])) for i, batch in enumerate(result["batch_sizes"])
            if limits.get(str(batch)) is not None]


def write_chart(result: dict[str, Any], path: str) -> None:
    from matplotlib.figure import Figure

    columns = [e["column"] for e in result["engines"]]
    batches = result["batch_sizes"]
    fig = Figure(figsize=SIZE_INCHES, dpi=DPI)
    ax = fig.add_subplot()
    width = 0.8 / max(len(columns), 1)
    for i, column in enumerate(columns):
        heights, spread, labels = _bars(result, column)
        xs = [b + (i - (len(columns) - 1) / 2) * width for b in range(len(batches))]
        bars = ax.bar(xs, heights, width * 0.95, yerr=spread, capsize=3, label=column,
                      error_kw={"elinewidth": 0.8, "alpha": 0.6})
        for text in ax.bar_label(bars, labels=labels, padding=3, fontsize=8):
            text.set_bbox({"facecolor": "white", "edgecolor": "none", "alpha": 0.8, "pad": 1})
    for n, (group, limit) in enumerate(_roofline_marks(result)):
        ax.hlines(limit, group - 0.45, group + 0.45, colors="black", linestyles="--",
                  linewidth=1, label="roofline (float32)" if n == 0 else None)
        ax.text(group, limit, f"{limit:.0f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(batches)), [f"batch {b}" for b in batches])
    ax.set_ylabel(f"decode output tokens/s (median of {result['repeats']})")
    ax.set_ylim(0, ax.get_ylim()[1] * 1.1)  # room for the labels above the tallest bar
    machine = result["machine"]
    load = " - measured under load" if machine["under_load"] else ""
    ax.set_title(f"{result['model_name']}: decode throughput, {result['input_len']} tokens in, "
                 f"{result['output_len']} out (higher is better)\n{machine['cpu']['kind']}{load}",
                 fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)
    fig.tight_layout()
    fig.savefig(path, format="png")

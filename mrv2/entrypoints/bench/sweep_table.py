"""The table of `mrv2 bench sweep`: one row per (model, batch), one column per (engine,
precision), each cell the median decode throughput and, in parentheses, the median wall time of
a whole run; the best of each row in bold (markdown) or marked `*` (text); last, the row's
roofline limit where the result has one. A second table gives the median first-token time (the
prefill of the batch's prompts), the smallest in bold. Above them, the CPU and its load; below
them, the engines left out and why. Built from the sweep's JSON result, so a
saved result prints the same table again.
"""

from __future__ import annotations

import statistics
from typing import Any


def _median(values: list[float | None]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _decode_text(cell: dict[str, Any], value: float) -> str:
    return f"{value:.1f} ({cell['wall_s_median']:.2f} s)"


def _first_token_text(cell: dict[str, Any], value: float) -> str:
    return f"{value * 1e3:.0f} ms"


# Each table: the cell's list of measurements, how a median reads, and whether more is better.
TABLES = {"decode": ("decode_tok_s", _decode_text, True),
          "first_token": ("first_token_s", _first_token_text, False)}


def table_rows(result: dict[str, Any], table: str = "decode"
               ) -> tuple[list[str], list[tuple[list[str], int | None]]]:
    """The header and, per batch, the cells' texts of `table` (TABLES) with the index of the
    best cell (None when no cell of the row has a value)."""
    key, text, larger_is_better = TABLES[table]
    columns = [e["column"] for e in result["engines"]]
    by_key = {(m["column"], m["batch"]): m for m in result["measurements"]}
    limits = result.get("roofline", {}).get("decode_tok_s") if table == "decode" else None
    rows = []
    for batch in result["batch_sizes"]:
        cells = [by_key.get((c, batch)) for c in columns]
        values = [_median(c[key]) if c is not None and c["status"] == "ok" else None
                  for c in cells]
        scored = [(v if larger_is_better else -v, i) for i, v in enumerate(values)
                  if v is not None]
        best = max(scored)[1] if scored else None
        texts = [result["model_name"], str(batch)] + [
            "-" if c is None else c["status"] if c["status"] != "ok"  # "n/a" or "error"
            else "-" if v is None else text(c, v)  # every repeat lost in the noise
            for c, v in zip(cells, values)]
        if limits is not None:
            texts.append(f"{limits[str(batch)]:.0f}")
        rows.append((texts, None if best is None else best + 2))
    return ["model", "batch"] + columns + (["roofline (float32)"] if limits else []), rows


def header_lines(result: dict[str, Any], fmt: str) -> list[str]:
    machine = result["machine"]
    cpu = machine["cpu"]
    flags = ", ".join(f"{flag} {'yes' if on else 'no'}" for flag, on in cpu["features"].items())
    loads = [x for x in (machine["loadavg_start"], machine["loadavg_end"]) if x is not None]
    load = (f"load average {' -> '.join(f'{x:.2f}' for x in loads)}" if loads
            else "load average unknown")
    if machine["under_load"]:
        load += " (measured under load: other processes shared the cores)"
    title = f"mrv2 bench sweep: {result['model_name']}"
    best = "bold" if fmt == "markdown" else "marked *"
    return [f"## {title}" if fmt == "markdown" else title, "",
            f"CPU: {cpu['name']}, {cpu['threads']} threads; {flags} (from {cpu['source']}); "
            f"{load}.",
            f"Decode output tokens/s, median of {result['repeats']} (in parentheses: the median "
            f"wall time of a whole run, prefill included). Prompts of {result['input_len']} "
            f"random token ids, {result['output_len']} tokens out, greedy, EOS ignored; the "
            f"best of each row {best}.", *_roofline_line(result), ""]


def _roofline_line(result: dict[str, Any]) -> list[str]:
    roofline = result.get("roofline")
    if roofline is None:
        return []
    rates = roofline["rates"]
    return [f"Roofline: the decode tokens/s no engine passes reading the checkpoint's "
            f"{roofline['weight_bytes'] / 1e6:.0f} MB of weights once a step, and the float32 "
            f"KV cache, at {rates['read_GB_per_s']:.1f} GB/s, computing at "
            f"{rates['gemm_GFLOP_per_s']:.0f} GFLOP/s (float32; both measured here)."]


def format_table(result: dict[str, Any], fmt: str = "markdown") -> str:
    lines = header_lines(result, fmt)
    _append_table(lines, *table_rows(result), fmt)
    if any(m.get("first_token_s") for m in result["measurements"]):
        lines += ["", f"First token: seconds from the batch's prompts given to every prompt's "
                      f"first token (the prefill), median; the best of each row "
                      f"{'bold' if fmt == 'markdown' else 'marked *'}.", ""]
        _append_table(lines, *table_rows(result, "first_token"), fmt)
    skipped = [f"skipped {s['engine']}: {s['reason']}" for s in result["skipped"]]
    return "\n".join(lines + ([""] + skipped if skipped else []))


def _append_table(lines: list[str], header: list[str], rows: list[tuple[list[str], int | None]],
                  fmt: str) -> None:
    if fmt == "markdown":
        lines.append("| " + " | ".join(header) + " |")
        lines.append("|---|" + "---:|" * (len(header) - 1))
        for cells, best in rows:
            if best is not None:
                value, _, rest = cells[best].partition(" ")
                cells = cells[:best] + [f"**{value}** {rest}"] + cells[best + 1:]
            lines.append("| " + " | ".join(cells) + " |")
    else:
        marked = [[c + ("*" if i == best else "") for i, c in enumerate(cells)]
                  for cells, best in rows]
        widths = [max(len(r[i]) for r in [header] + marked) for i in range(len(header))]
        for cells in [header] + marked:
            lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                                   for i, (c, w) in enumerate(zip(cells, widths))).rstrip())

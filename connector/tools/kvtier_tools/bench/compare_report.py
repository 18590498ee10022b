"""Tables and PNGs of a `kvtier bench compare` report, drawn from the JSON report alone (a saved
report can be re-read and re-drawn). "n/a": a scenario that did not measure that value (it
failed, or was not run)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from kvtier_tools.bench.plot import pyplot, save

TITLES = {
    "A": "A: one long prompt ({a_tokens} tokens), then {a_repeats} repeats; TTFT (s)",
    "B": "B: conversation of {b_turns} turns ({b_first_tokens} tokens, then answer + "
    "{b_user_tokens} user tokens per turn); TTFT (s)",
    "C": "C: mixed load, {c_inflight} in flight, {c_new_share:.0%} new prompts of "
    "{c_new_tokens} tokens, the rest continuations (+{c_turn_tokens}); cold round "
    "{c_cold_s:g} s, warm round {c_warm_s:g} s",
    "D": "D: short prompt ({d_tokens} tokens), long answer ({d_output} tokens); seconds",
}


def _num(value: Any, spec: str = ".3f") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return format(value, spec)


def _pct(value: Any) -> str:
    return "n/a" if value is None or value != value else f"{value:.0%}"


def _round(report: Mapping[str, Any], scenario: str, key: str, round_name: str) -> dict[str, Any]:
    rounds: dict[str, dict[str, Any]] = report["scenarios"][scenario]["presets"].get(key, {})
    return rounds.get(round_name, {})


def _ratio(a: Any, b: Any) -> float | None:
    return a / b if a is not None and b and a == a and b == b else None


def _mean(values: Sequence[float | None]) -> float | None:
    ok = [v for v in values if v is not None and v == v]
    return sum(ok) / len(ok) if ok else None


def _rows(report: Mapping[str, Any], key: str) -> list[str]:
    """Table rows (after the header) of preset ``key``: one (or two, C) per scenario."""
    lines = []
    for name, scenario in report["scenarios"].items():
        cold, warm = _round(report, name, key, "cold"), _round(report, name, key, "warm")
        label = scenario["label"]
        if key == "A":
            first = (warm.get("ttft_per_request_s") or [None])[0]
            cells = [cold.get("ttft_p50_s"), first, warm.get("ttft_p50_s")]
            cells.append(_ratio(first, cells[0]))
            lines.append(
                f"| {label} | {' | '.join(map(_num, cells))} | {_pct(warm.get('hit_rate'))} |"
            )
        elif key == "B":
            turns = cold.get("ttft_per_request_s") or []
            replay = warm.get("ttft_per_request_s") or []
            cells = [turns[0] if turns else None, _mean(turns[1:]), turns[-1] if turns else None]
            lines.append(
                f"| {label} | {' | '.join(map(_num, cells))} | {_pct(cold.get('hit_rate'))} "
                f"| {_num(_mean(replay))} | {_pct(warm.get('hit_rate'))} |"
            )
        elif key == "C":
            for round_name, r in (("cold", cold), ("warm", warm)):
                count = f"{r.get('requests', 'n/a')} ({r.get('failed', 0)})"
                lines.append(
                    f"| {label} | {round_name} | {count} | {_num(r.get('requests_per_s'), '.1f')} "
                    f"| {_num(r.get('tokens_per_s'), '.0f')} | {_num(r.get('ttft_p50_s'))} "
                    f"| {_num(r.get('ttft_p99_s'))} | {_pct(r.get('hit_rate'))} |"
                )
        else:
            ttft = [cold.get("ttft_p50_s"), warm.get("ttft_p50_s")]
            latency = [cold.get("latency_mean_s"), warm.get("latency_mean_s")]
            cells = [*ttft, _ratio(ttft[1], ttft[0]), *latency, _ratio(latency[1], latency[0])]
            lines.append(f"| {label} | {' | '.join(map(_num, cells))} |")
        if "error" in scenario:
            first = scenario["error"].strip().splitlines()[:1] or ["?"]
            lines.append(f"| ({name} failed: {first[0][:120]}) |")
    return lines


_HEADERS = {
    "A": "| scenario | cold | first warm | warm p50 | first warm / cold | hit rate, warm |"
    "\n|---|---|---|---|---|---|",
    "B": "| scenario | turn 1 | later turns, mean | last turn | hit rate | replay (warm), mean "
    "| hit rate, warm |\n|---|---|---|---|---|---|---|",
    "C": "| scenario | round | requests (failed) | req/s | tokens/s | TTFT p50 (s) | TTFT p99 (s) "
    "| hit rate |\n|---|---|---|---|---|---|---|---|",
    "D": "| scenario | TTFT cold | TTFT warm | TTFT warm / cold | latency cold | latency warm "
    "| latency warm / cold |\n|---|---|---|---|---|---|---|",
}


def sweep_table(sweep: Mapping[str, Any]) -> str:
    if "skipped" in sweep:
        return f"C capacity sweep skipped: {sweep['skipped']}"
    # The 1-minute load after each size: the machine's load can change during a sweep.
    load = any("loadavg_after" in row for row in sweep["rows"])
    lines = [
        f"C capacity sweep: the first {sweep['requests']} requests of C, working set "
        f"{sweep['working_set_chunks']} chunks ({sweep['working_set_mib']:.0f} MiB), "
        "vLLM prefix caching off",
        "| CPU tier | disk tier | hit rate | hits from CPU / disk (chunks) | TTFT p50 (s) "
        "| TTFT p99 (s) | req/s | tokens/s | failed |" + (" load after |" if load else ""),
        "|---|---|---|---|---|---|---|---|---|" + ("---|" if load else ""),
    ]
    for row in sorted(sweep["rows"], key=lambda r: (r["disk"], -r["cpu_share"])):
        disk = "2x working set" if row["disk"] else "off"
        hits = " / ".join(
            _num(row.get(f"kvtier_{tier}_hit_chunks"), ".0f") for tier in ("cpu", "disk")
        )
        after = (row.get("loadavg_after") or [None])[0]
        lines.append(
            f"| {row['cpu_share']:.0%} ({row['cpu_mib']:.0f} MiB) | {disk} "
            f"| {_pct(row.get('hit_rate'))} | {hits} | {_num(row.get('ttft_p50_s'))} "
            f"| {_num(row.get('ttft_p99_s'))} | {_num(row.get('requests_per_s'), '.1f')} "
            f"| {_num(row.get('tokens_per_s'), '.0f')} | {row.get('failed', 'n/a')} |"
            + (f" {_num(after, '.1f')} |" if load else "")
        )
        if "error" in row:
            lines.append(f"| (failed: {row['error'].strip().splitlines()[0][:120]}) |")
    return "\n".join(lines)


def format_tables(report: Mapping[str, Any]) -> str:
    """One Markdown table per preset (and the sweep), each under its title."""
    parts = []
    for key in report["presets"]:
        title = TITLES[key].format(**report["sizes"])
        parts.append("\n".join([title, _HEADERS[key], *_rows(report, key)]))
    if report.get("sweep"):
        parts.append(sweep_table(report["sweep"]))
    return "\n\n".join(parts)


# ---------------------------------------------------------------------------------- plots
def _short(value: Any) -> str:
    if value is None or value != value:
        return "n/a"
    return (
        f"{value:.0f}"
        if abs(value) >= 100
        else f"{value:.3f}"
        if abs(value) < 1
        else f"{value:.2f}"
    )


def _bars(
    ax: Any,
    names: Sequence[str],
    series: Mapping[str, Sequence[Any]],
    ylabel: str,
    notes: Sequence[str] = (),
) -> None:
    """Grouped bars, one group per name, one bar per series, labelled with the values (and,
    under the last series' values, ``notes``)."""
    width = 0.8 / max(1, len(series))
    for i, (label, values) in enumerate(series.items()):
        ys = [math.nan if v is None else v for v in values]
        xs = [x + (i - (len(series) - 1) / 2) * width for x in range(len(names))]
        bars = ax.bar(xs, ys, width, label=label)
        texts = [_short(v) for v in values]
        if notes and i == len(series) - 1:
            texts = [f"{t}\n{n}" for t, n in zip(texts, notes, strict=True)]
        ax.bar_label(bars, labels=texts, fontsize=7)
    ax.set_xticks(range(len(names)), names, rotation=20, fontsize=8)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=7)


def _plot_sweep(axes: Sequence[Any], sweep: Mapping[str, Any]) -> None:
    """C's capacity sweep: hit rate and TTFT p50 over the CPU tier's share of the working set."""
    for disk, style in ((False, "-"), (True, "--")):
        pts = [r for r in sweep["rows"] if r["disk"] == disk]
        shares = [100 * r["cpu_share"] for r in pts]
        label = "CPU tier + disk tier" if disk else "CPU tier only"
        hit = [r.get("hit_rate", math.nan) for r in pts]
        axes[0].plot(shares, hit, style, marker="o", label=label)
        p50 = [r.get("ttft_p50_s", math.nan) for r in pts]
        axes[1].plot(shares, p50, style, marker="o", label=label)
    for ax, ylabel in ((axes[0], "hit rate"), (axes[1], "TTFT p50 (s)")):
        ax.set_xlabel("CPU tier, % of the working set")
        ax.set_ylabel(ylabel)
        ax.set_xscale("log")
        ax.set_xticks([10, 25, 50, 100], ["10", "25", "50", "100"])
        ax.legend(fontsize=7)


def plot_preset(report: Mapping[str, Any], key: str, path: str) -> str | None:
    """The PNG of preset ``key``; None when matplotlib is not installed."""
    plt = pyplot()
    if plt is None:
        return None
    names = list(report["scenarios"])

    def values(round_name: str, field: str) -> list[Any]:
        return [_round(report, n, key, round_name).get(field) for n in names]

    sweep = report.get("sweep") if key == "C" else None
    rows = 2 if sweep and sweep.get("rows") else 1
    fig, axes = plt.subplots(rows, 2 if key in "CD" else 1, figsize=(11, 4.2 * rows), squeeze=False)
    if key == "A":
        firsts = [(ttfts or [None])[0] for ttfts in values("warm", "ttft_per_request_s")]
        series = {
            "cold": values("cold", "ttft_p50_s"),
            "first warm request": firsts,
            "warm p50": values("warm", "ttft_p50_s"),
        }
        _bars(axes[0][0], names, series, "TTFT (s)")
    elif key == "B":
        ax = axes[0][0]
        for i, name in enumerate(names):
            for round_name, style in (("cold", "-"), ("warm", "--")):
                ys = _round(report, name, key, round_name).get("ttft_per_request_s") or []
                label = f"{name}, {'conversation' if round_name == 'cold' else 'replay'}"
                ax.plot(range(1, len(ys) + 1), ys, style, marker="o", color=f"C{i}", label=label)
        ax.set_xticks(range(1, report["sizes"]["b_turns"] + 1))
        ax.set_xlabel("turn")
        ax.set_ylabel("TTFT (s)")
        ax.legend(fontsize=7, ncol=2)
    elif key == "C":
        series = {"p50": values("warm", "ttft_p50_s"), "p99": values("warm", "ttft_p99_s")}
        _bars(axes[0][0], names, series, "TTFT, warm round (s)")
        hits = [f"hit {_pct(v)}" for v in values("warm", "hit_rate")]
        _bars(axes[0][1], names, {"warm round": values("warm", "tokens_per_s")}, "tokens/s", hits)
        if rows == 2 and sweep is not None:
            _plot_sweep(axes[1], sweep)
    else:
        ttft = {"cold": values("cold", "ttft_p50_s"), "warm": values("warm", "ttft_p50_s")}
        _bars(axes[0][0], names, ttft, "TTFT (s)")
        latency = {
            "cold": values("cold", "latency_mean_s"),
            "warm": values("warm", "latency_mean_s"),
        }
        _bars(axes[0][1], names, latency, "end-to-end latency (s)")
    fig.suptitle(TITLES[key].format(**report["sizes"]), fontsize=9)
    return save(plt, fig, path)

"""Render benchmark results: a text table and a PNG plot.

Rules of this module:
- Input is the plain data `melix_mlx.tools.bench.run` returns (or its JSON file); nothing here
  measures. matplotlib is imported only when a plot is asked for (optional `bench` extra).
- Each cell says in place when its speedup cannot be trusted (its `check` column): the
  speedup lies inside the cell's own A/A range (mlx-lm against itself: the run's noise),
  an A/A ratio is off 1 by more than NOISY_AA (the machine moved by itself), or the calibration
  at the cell's k was poisoned (competing load during the run). A warning line under the
  table counts them. The results data (JSON) is unchanged: this is rendering only.
- The text table's headers are single words, explained by the legend under it.
- The plot shows, per temperature, the speedup of MTP over mlx-lm's BatchGenerator against
  batch size, one solid line per k, and the ideal from the same run's timings dashed in
  the same colour; y = 1 is drawn so "pays / does not pay" reads at a glance.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

NOISY_AA = 0.2  # an A/A ratio further than this from 1: the machine moved mlx-lm's rate by itself

LEGEND = (
    "speedup: MTP tok/s over mlx-lm's (median of repeats); range: min-max over repeats; "
    "A/A: mlx-lm over itself (the run's noise); check: ok, or why the speedup is not trustworthy "
    "(noise: inside A/A; noisy: an A/A ratio off 1 by more than {noisy:g}; "
    "poisoned: calibration at this k poisoned); "
    "ideal: the cost model's speedup from this run's timings; of-ideal: speedup / ideal; "
    "fill: busy rows per verify / B; accept: draft acceptance; auto/plain, auto/best: the auto "
    "policy over plain decoding and over the better of plain and always-on; auto-k/plain: auto "
    "depth over plain; prompt: prompt-phase tok/s over mlx-lm's; cycle-ms: verify + head + not overlapped"
)


def _fmt(value: Any, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def _spread(c: dict[str, Any]) -> str:
    return f"{c['ratio_min']:.2f}-{c['ratio_max']:.2f}"


def _aa(c: dict[str, Any]) -> str:
    """The A/A range: the baseline against itself in the same repeats (the run's noise)."""
    ratios = c.get("aa_ratios") or []
    return f"{min(ratios):.2f}-{max(ratios):.2f}" if ratios else "-"


def _breakdown(c: dict[str, Any]) -> str:
    b = c.get("breakdown_ms") or {}
    if not b:
        return "-"
    return (
        f"{b['cycle']:.1f} = verify {b['verify']:.1f} + head {b['head']:.1f} + not overlapped "
        f"{b['not_overlapped']:.1f} (build {b['build']:.1f}, sync {b['sync']:.1f}, rollback "
        f"{b['rollback']:.2f}, outside {b['outside']:.2f})"
    )


def _poisoned_ks(results: dict[str, Any]) -> set[int]:
    """The k values whose calibration was poisoned (competing load: every ratio is suspect)."""
    return {
        int(k)
        for k, entry in results.get("calibration", {}).items()
        if isinstance(entry, dict) and entry.get("error") == "measurement_poisoned"
    }


def doubts(c: dict[str, Any], poisoned_ks: set[int]) -> list[str]:
    """Why this cell's speedup cannot be trusted (empty: nothing known against it)."""
    out = []
    aa = c.get("aa_ratios") or []
    if aa and min(aa) <= c["ratio"] <= max(aa):
        out.append("noise")
    if aa and max(abs(r - 1) for r in aa) > NOISY_AA:
        out.append("noisy")
    if c["k"] in poisoned_ks:
        out.append("poisoned")
    return out


def _check(c: dict[str, Any], poisoned_ks: set[int]) -> str:
    found = doubts(c, poisoned_ks)
    return ",".join(found) if found else ("ok" if c.get("aa_ratios") or poisoned_ks else "-")


def _warning(results: dict[str, Any]) -> str | None:
    poisoned = _poisoned_ks(results)
    cells = results["cells"]
    flagged = [c for c in cells if doubts(c, poisoned)]
    if not flagged:
        return None
    return (
        f"warning: {len(flagged)} of {len(cells)} speedups are not trustworthy (check column): "
        "run again on an idle machine, or with more --repeats"
    )


def _columns(rows: list[list[str]]) -> list[str]:
    """Rows padded into columns (the first left-aligned, numbers right-aligned)."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        " ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
        for row in rows
    ]


def _batching(results: dict[str, Any]) -> str:
    n = results.get("requests_per_slot", 1)
    if n == 1:
        return "batch cells a fixed batch of B requests"
    return f"batch cells continuous batching ({n} x B requests queued, B rows at a time)"


def table(results: dict[str, Any]) -> str:
    r = results["regime"]
    lines = [
        f"regime: device={r['device']} blas={r['blas']} threads={r.get('blas_threads')} "
        f"dtype={r.get('dtype')} mlx={r['mlx']} "
        f"mlx_lm={r['mlx_lm']} {_batching(results)}",
    ]
    for k, entry in results.get("calibration", {}).items():
        if isinstance(entry, dict) and "error" in entry:
            lines.append(f"calibration k={k}: {entry['error']} ({entry['detail']}): no prediction")
    for w in results.get("workloads", []):
        lines.append(
            f"workload {w['workload']:10} k={w['k']} acceptance {_fmt(w['acceptance_rate'])} per position "
            + " ".join(f"{p:.2f}" for p in w["per_position_acceptance"])
        )
    header = [
        "path", "B", "k", "temp", "MTP-tok/s", "mlx-lm-tok/s", "speedup", "range", "A/A", "check",
        "ideal", "of-ideal", "fill", "accept", "auto/plain", "auto/best", "auto-k/plain", "prompt",
    ]  # fmt: skip
    poisoned = _poisoned_ks(results)
    rows, tails = [header], ["cycle-ms"]
    for c in results["cells"]:
        rows.append(
            [
                c["path"], str(c["batch_size"]), str(c["k"]), f"{c['temp']:.1f}", f"{c['tps']:.1f}",
                f"{c['baseline_tps']:.1f}", f"{c['ratio']:.2f}", _spread(c), _aa(c), _check(c, poisoned),
                _fmt(c["ideal_ratio"]), _fmt(c["efficiency"]), _fmt(c.get("batch_fill")),
                _fmt(c["acceptance_rate"]), _fmt(c.get("auto_over_plain")), _fmt(c.get("auto_over_best")),
                _fmt(c.get("auto_depth_over_plain")), _fmt(c.get("prompt_ratio")),
            ]
        )  # fmt: skip
        tails.append(_breakdown(c))
    for d in results.get("draft_cells", []):
        first = ["draft", "1", str(d["k"]), f"{d['temp']:.1f}"]
        if d.get("refused"):
            rows.append(first + ["-"] * (len(header) - len(first)))
            tails.append(f"refused by mlx-lm: {d['refused']}")
            continue
        measured = [f"{d['tps']:.1f}", f"{d['baseline_tps']:.1f}", f"{d['ratio']:.2f}"]
        rows.append(first + measured + ["-"] * (len(header) - len(first) - len(measured)))
        tails.append(
            f"mlx-lm speculative_generate_step, draft-token share {_fmt(d.get('draft_token_share'))}"
        )
    lines += [f"{row}  {tail}".rstrip() for row, tail in zip(_columns(rows), tails)]
    warning = _warning(results)
    if warning:
        lines.append(warning)
    lines += textwrap.wrap(
        "legend: " + LEGEND.format(noisy=NOISY_AA), width=110, subsequent_indent="  ", break_on_hyphens=False
    )
    return "\n".join(lines)


def markdown(results: dict[str, Any]) -> str:
    """The results as markdown tables (what BENCHMARKS.md quotes)."""
    r = results["regime"]
    out = [
        f"Regime: device `{r['device']}`, BLAS `{r['blas']}` (threads: {r.get('blas_threads')}), "
        f"dtype `{r.get('dtype')}`, "
        f"mlx {r['mlx']}, mlx-lm {r['mlx_lm']}, {r['machine']}; model `{results['model']}`; "
        f"{results['max_tokens']} tokens per request, {_batching(results)}, median of {results['repeats']} "
        "interleaved runs (spread: min-max of the per-run ratios"
        + (
            "; A/A: mlx-lm's run repeated at the end of each repeat over its first run, min-max: "
            "a ratio inside that range is within this run's noise)."
            if results.get("aa_control")
            else ")."
        ),
        "",
    ]
    for k, entry in results.get("calibration", {}).items():
        if isinstance(entry, dict) and "error" in entry:
            out.append(f"- calibration k={k}: `{entry['error']}`: no prediction")
        else:
            figures = ", ".join(
                f"B={t['batch_size']}: t_1 {t['t_1'] * 1e3:.2f} ms, verify {t['t_verify'] * 1e3:.2f} ms, "
                f"head {t['t_head'] * 1e3:.2f} ms (t_head/t_1 {t['t_head'] / t['t_1']:.2f})"
                for t in entry
            )
            out.append(f"- calibration k={k}: {figures}")
    if results.get("workloads"):
        out += [
            "",
            "| workload | prompts | prompt tokens | k | acceptance | per position |",
            "|---|---|---|---|---|---|",
        ]
        for w in results["workloads"]:
            positions = " ".join(f"{p:.2f}" for p in w["per_position_acceptance"])
            out.append(
                f"| {w['workload']} | {w['prompts']} | {w['prompt_tokens']:.0f} | {w['k']} "
                f"| {_fmt(w['acceptance_rate'])} | {positions} |"
            )
    out += [
        "",
        "| path | B | k | T | tok/s | baseline | ratio | spread | A/A | check | ideal | efficiency | fill "
        "| accept | auto/plain | auto/best | auto depth/plain (k) | prompt phase | "
        "cycle ms: verify + head + not overlapped |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    poisoned = _poisoned_ks(results)
    for c in results["cells"]:
        depth = _fmt(c.get("auto_depth_over_plain"))
        if c.get("auto_depth_k"):
            depth += f" (k={c['auto_depth_k']})"
        out.append(
            f"| {c['path']} | {c['batch_size']} | {c['k']} | {c['temp']:.1f} | {c['tps']:.0f} "
            f"| {c['baseline_tps']:.0f} | **{c['ratio']:.2f}** | {_spread(c)} | {_aa(c)} "
            f"| {_check(c, poisoned)} | {_fmt(c['ideal_ratio'])} "
            f"| {_fmt(c['efficiency'])} | {_fmt(c.get('batch_fill'))} | {_fmt(c['acceptance_rate'])} "
            f"| {_fmt(c.get('auto_over_plain'))} "
            f"| {_fmt(c.get('auto_over_best'))} | {depth} | {_fmt(c.get('prompt_ratio'))} | {_breakdown(c)} |"
        )
    for d in results.get("draft_cells", []):
        if d.get("refused"):
            refused = f"refused by mlx-lm: {d['refused']}"
            out.append(f"| draft model (mlx-lm) | 1 | {d['k']} | {d['temp']:.1f} | {refused} |")
            continue
        out.append(
            f"| draft model (mlx-lm) | 1 | {d['k']} | {d['temp']:.1f} | {d['tps']:.0f} "
            f"| {d['baseline_tps']:.0f} | **{d['ratio']:.2f}** |" + " - |" * 12
        )
    warning = _warning(results)
    if warning:
        out += ["", f"**{warning}**"]
    return "\n".join(out)


def plot(results_by_regime: dict[str, dict[str, Any]], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temps = sorted({c["temp"] for res in results_by_regime.values() for c in res["cells"]})
    fig, axes = plt.subplots(
        len(results_by_regime),
        len(temps),
        figsize=(5 * len(temps), 3.6 * len(results_by_regime)),
        squeeze=False,
    )
    for row, (name, res) in enumerate(results_by_regime.items()):
        for col, temp in enumerate(temps):
            ax = axes[row][col]
            cells = [c for c in res["cells"] if c["path"] == "batch" and c["temp"] == temp]
            for i, k in enumerate(sorted({c["k"] for c in cells})):
                series = sorted((c for c in cells if c["k"] == k), key=lambda c: c["batch_size"])
                xs = [c["batch_size"] for c in series]
                color = f"C{i}"
                ax.plot(xs, [c["ratio"] for c in series], "o-", color=color, label=f"k={k} measured")
                ideal = [c["ideal_ratio"] for c in series]
                if all(p is not None for p in ideal):
                    ax.plot(xs, ideal, "--", color=color, alpha=0.7, label=f"k={k} ideal")
            ax.axhline(1.0, color="grey", linewidth=0.8)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("batch size")
            ax.set_ylabel("speedup vs mlx-lm BatchGenerator")
            ax.set_title(f"{name}: blas={res['regime']['blas']}, T={temp}")
            ax.legend(fontsize=7)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out

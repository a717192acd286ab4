"""Render benchmark results: a text table and a PNG plot.

Rules of this module:
- Input is the plain data `melix_mlx.bench.run` returns (or its JSON file); nothing here
  measures. matplotlib is imported only when a plot is asked for (optional `bench` extra).
- The plot shows, per temperature, the speedup of MTP over mlx-lm's BatchGenerator against
  batch size, one solid line per k, and the cost model's prediction dashed in the same
  colour; y = 1 is drawn so "pays / does not pay" reads at a glance.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _fmt(value: Any, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def table(results: dict[str, Any]) -> str:
    r = results["regime"]
    lines = [
        f"regime: device={r['device']} blas={r['blas']} dtype={r.get('dtype')} mlx={r['mlx']} "
        f"mlx_lm={r['mlx_lm']}",
        f"{'path':6} {'B':>2} {'k':>2} {'T':>4} {'tok/s':>8} {'base':>8} {'ratio':>6} {'pred':>6} "
        f"{'m/p':>5} {'acc':>5} {'tau':>5} {'fwd/tok':>7} {'memGB':>6} {'baseGB':>6} {'auto':>5} {'a/on':>5} "
        "gate      per-position",
    ]
    for k, entry in results.get("calibration", {}).items():
        if isinstance(entry, dict) and "error" in entry:
            lines.insert(1, f"calibration k={k}: {entry['error']} ({entry['detail']}): no prediction")
    for c in results["cells"]:
        lines.append(
            f"{c['path']:6} {c['batch_size']:>2} {c['k']:>2} {c['temp']:>4.1f} {c['tps']:>8.1f} "
            f"{c['baseline_tps']:>8.1f} {c['ratio']:>6.2f} {_fmt(c['predicted_ratio']):>6} "
            f"{_fmt(c['measured_over_predicted']):>5} {_fmt(c['acceptance_rate']):>5} "
            f"{_fmt(c['mean_acceptance_length']):>5} {_fmt(c['target_forwards_per_token']):>7} "
            f"{c['peak_memory_gb']:>6.3f} {c['baseline_peak_memory_gb']:>6.3f} "
            f"{_fmt(c.get('auto_over_plain')):>5} {_fmt(c.get('auto_over_force_on')):>5} "
            f"{(c.get('auto_gate') or '-'):9} " + " ".join(f"{p:.2f}" for p in c["per_position_acceptance"])
        )
    for d in results.get("draft_cells", []):
        lines.append(
            f"draft   1 {d['k']:>2} {d['temp']:>4.1f} {d['tps']:>8.1f} {d['baseline_tps']:>8.1f} "
            f"{d['ratio']:>6.2f}  (mlx-lm speculative_generate_step, draft-token share "
            f"{_fmt(d.get('draft_token_share', d.get('acceptance_rate')))})"
        )
    return "\n".join(lines)


def markdown(results: dict[str, Any]) -> str:
    """The results as markdown tables (what BENCHMARKS.md quotes)."""
    r = results["regime"]
    out = [
        f"Regime: device `{r['device']}`, BLAS `{r['blas']}`, dtype `{r.get('dtype')}`, "
        f"mlx {r['mlx']}, mlx-lm {r['mlx_lm']}, {r['machine']}; "
        f"{results['max_tokens']} tokens per request, median of {results['repeats']} interleaved runs.",
        "",
    ]
    for k, entry in results.get("calibration", {}).items():
        if isinstance(entry, dict) and "error" in entry:
            out.append(f"- calibration k={k}: `{entry['error']}`: no prediction")
        else:
            figures = ", ".join(
                f"B={t['batch_size']}: t_1 {t['t_1'] * 1e3:.2f} ms, verify {t['t_verify'] * 1e3:.2f} ms, "
                f"head {t['t_head'] * 1e3:.2f} ms"
                for t in entry
            )
            out.append(f"- calibration k={k}: {figures}")
    out += [
        "",
        "| path | B | k | T | tok/s | baseline tok/s | ratio | predicted | measured/predicted | accept "
        "| tau | fwd/token | peak GB (base) | auto/plain | auto/force_on | auto gate | per-position |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in results["cells"]:
        out.append(
            f"| {c['path']} | {c['batch_size']} | {c['k']} | {c['temp']:.1f} | {c['tps']:.0f} "
            f"| {c['baseline_tps']:.0f} | **{c['ratio']:.2f}** | {_fmt(c['predicted_ratio'])} "
            f"| {_fmt(c['measured_over_predicted'])} | {_fmt(c['acceptance_rate'])} "
            f"| {_fmt(c['mean_acceptance_length'])} | {_fmt(c['target_forwards_per_token'])} "
            f"| {c['peak_memory_gb']:.3f} ({c['baseline_peak_memory_gb']:.3f}) "
            f"| {_fmt(c.get('auto_over_plain'))} | {_fmt(c.get('auto_over_force_on'))} "
            f"| {c.get('auto_gate') or '-'} | "
            + " ".join(f"{p:.2f}" for p in c["per_position_acceptance"])
            + " |"
        )
    for d in results.get("draft_cells", []):
        out.append(
            f"| draft model (mlx-lm) | 1 | {d['k']} | {d['temp']:.1f} | {d['tps']:.0f} "
            f"| {d['baseline_tps']:.0f} | **{d['ratio']:.2f}** | - | - | - | - | - | - | - | - | - | - |"
        )
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
                pred = [c["predicted_ratio"] for c in series]
                if all(p is not None for p in pred):
                    ax.plot(xs, pred, "--", color=color, alpha=0.7, label=f"k={k} predicted")
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

"""Figures of a comparison: loss and evaluation curves with their spread over seeds, per-seed differences from the
reference, the settings search, per-layer gradient norm at initialisation, residual RMS, update size against depth,
the final metric against the learning rate."""

import textwrap
from pathlib import Path

import matplotlib


matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from .statistics import task_metrics  # noqa: E402


def _by_variant(results: list[dict]) -> dict[str, list[dict]]:
    grouped = {}
    for result in results:
        grouped.setdefault(result["variant"], []).append(result)
    return grouped


def _curves(runs: list[dict], key: str) -> tuple[list[float], np.ndarray]:
    """The steps every run logged `key` at, and the values (one row per run)."""
    curves = [{entry["step"]: entry[key] for entry in run["log_history"] if key in entry} for run in runs]
    steps = sorted(set.intersection(*(set(curve) for curve in curves)))
    return steps, np.array([[curve[step] for step in steps] for curve in curves], dtype=float).reshape(len(runs), -1)


def _plot_band(axis, runs: list[dict], key: str, label: str, color: str, **style) -> None:
    """The mean over seeds, with a band of ±1 standard deviation when there are several seeds."""
    steps, values = _curves(runs, key)
    mean = values.mean(axis=0)
    axis.plot(steps, mean, color=color, label=label, **style)
    if len(runs) > 1:
        std = values.std(axis=0, ddof=1)
        axis.fill_between(steps, mean - std, mean + std, color=color, alpha=0.2, linewidth=0)


def write_plots(
    output: Path,
    results: list[dict],
    reference: str | None = None,
    search: dict | None = None,
    update_size: dict | None = None,
    sensitivity: list[dict] | None = None,
    precision: dict | None = None,
) -> list[str]:
    """Writes the PNG figures into `output`; returns their file names."""
    grouped = _by_variant(results)
    metric = task_metrics(results[0]["metrics"])[0]
    spread = " (mean ± 1 std over seeds)" if len({r["seed"] for r in results}) > 1 else ""
    eval_key = "eval_loss" if metric == "perplexity" else f"eval_{metric}"
    evaluated = eval_key.removeprefix("eval_")
    figures = {
        "loss.png": _band_figure(grouped, "loss", ylabel="training loss", title="Training loss" + spread),
        "eval_metric.png": _band_figure(
            grouped,
            eval_key,
            ylabel=f"development {evaluated}",
            title=f"Development {evaluated} during training" + spread,
            marker="o",
        ),
    }
    if reference is not None and len(grouped) > 1:
        figures["paired_differences.png"] = _paired_figure(grouped, reference, metric)
    if precision and any(f["se"] is not None for f in precision["differences"].values()):
        figures["precision.png"] = _precision_figure(precision, reference)
    if search:
        figures["grid_search.png"] = _search_figure(search)
    figures["grad_norm_init.png"] = _gradient_figure(grouped)
    figures["residual_rms.png"] = _residual_figure(grouped)
    if any(run.get("source_collapse") and "collapse" in run["diagnostics"][0] for run in results):
        figures["collapse.png"] = _collapse_figure(grouped)
    if update_size:
        figures["update_size.png"] = _update_size_figure(update_size["summary"])
    if sensitivity:
        figures["learning_rate_sensitivity.png"] = _sensitivity_figure(sensitivity)
    for name, figure in figures.items():
        if figure.axes[0].get_legend_handles_labels()[0]:
            figure.axes[0].legend(fontsize=7)
        figure.tight_layout()
        fit_titles(figure)
        figure.savefig(output / name, dpi=120)
        plt.close(figure)
    return list(figures)


def fit_titles(figure) -> None:
    """Wraps each axis title that reaches past the figure's edges onto more lines, then lays the figure out again."""
    renderer = figure.canvas.get_renderer()
    for axis in figure.axes:
        title, text = axis.title, axis.title.get_text()
        characters = len(text)
        while characters > 10:
            extent = title.get_window_extent(renderer)
            if extent.x0 >= 0 and extent.x1 <= figure.bbox.width:
                break
            characters = int(characters * 0.85)
            title.set_text(textwrap.fill(text, characters))
            figure.tight_layout()


def _band_figure(grouped: dict[str, list[dict]], key: str, ylabel: str, title: str, **style):
    """A logged value against step, one band per variant."""
    figure, axis = plt.subplots(figsize=(6, 4))
    for index, (variant, runs) in enumerate(grouped.items()):
        _plot_band(axis, runs, key, variant, f"C{index}", **style)
    axis.set(xlabel="step", ylabel=ylabel, title=title)
    return figure


def _gradient_figure(grouped: dict[str, list[dict]]):
    """Each layer's attention and feed-forward gradient norms at initialisation (mean over seeds)."""
    figure, axis = plt.subplots(figsize=(6, 4))
    for index, (variant, runs) in enumerate(grouped.items()):
        for part, style in (("attention", "-"), ("ffn", "--")):
            norms = np.array([run["diagnostics"][0][part] for run in runs]).mean(axis=0)
            axis.plot(range(len(norms)), norms, style, color=f"C{index}", marker=".", label=f"{variant} {part}")
    axis.xaxis.set_major_locator(MaxNLocator(integer=True))
    axis.set(
        xlabel="layer",
        ylabel="gradient norm at initialisation",
        yscale="log",
        title="Per-layer gradient norm at initialisation (Xiong et al. 2020)",
    )
    return figure


def _residual_figure(grouped: dict[str, list[dict]]):
    """The residual stream's RMS at every depth, at initialisation and at the end (mean over seeds)."""
    figure, axis = plt.subplots(figsize=(6, 4))
    for index, (variant, runs) in enumerate(grouped.items()):
        start = np.array([run["diagnostics"][0]["residual_rms"] for run in runs]).mean(axis=0)
        axis.plot(range(len(start)), start, "--", color=f"C{index}", label=f"{variant}, initialisation")
        ends = [next(r["residual_rms"] for r in reversed(run["diagnostics"]) if "residual_rms" in r) for run in runs]
        axis.plot(range(len(start)), np.array(ends).mean(axis=0), "-", color=f"C{index}", label=f"{variant}, end")
    axis.xaxis.set_major_locator(MaxNLocator(integer=True))
    axis.set(xlabel="depth (0: embeddings)", ylabel="residual-stream RMS", yscale="log", title="Residual stream RMS")
    return figure


def _paired_figure(grouped: dict[str, list[dict]], reference: str, metric: str):
    """Each seed's final `metric` minus the reference's on the same seed, one column per variant."""
    baseline = {run["seed"]: run["metrics"][metric] for run in grouped[reference]}
    others = [variant for variant in grouped if variant != reference]
    figure, axis = plt.subplots(figsize=(max(4, 1.2 * len(others) + 2), 4))
    for index, variant in enumerate(others):
        differences = [
            run["metrics"][metric] - baseline[run["seed"]] for run in grouped[variant] if run["seed"] in baseline
        ]
        offsets = np.linspace(-0.15, 0.15, len(differences)) if len(differences) > 1 else [0.0]
        axis.scatter(index + np.asarray(offsets), differences, color=f"C{list(grouped).index(variant)}", zorder=3)
        if differences:
            axis.hlines(np.mean(differences), index - 0.25, index + 0.25, color="black")
    axis.axhline(0.0, color="grey", linewidth=0.8)
    axis.set_xticks(range(len(others)), others, rotation=30, ha="right", fontsize=8)
    axis.set(
        ylabel=f"{metric} − {reference}'s (same seed)", title=f"Per-seed differences from {reference} (bar: mean)"
    )
    return figure


def _precision_figure(precision: dict, reference: str):
    """Each difference's 95% interval (seeds and examples) against the width asked for, and the two parts of its
    standard error."""
    scale = 1.0 if precision["metric"] in ("loss", "perplexity") else 100.0
    unit = "" if scale == 1.0 else " (points)"
    rows = [(variant, f) for variant, f in precision["differences"].items() if f["se"] is not None]
    figure, (intervals, parts) = plt.subplots(1, 2, figsize=(9, 1.0 + 0.6 * len(rows)), width_ratios=(3, 2))
    for row, (variant, f) in enumerate(rows):
        low, high = (scale * bound for bound in f["ci95"])
        intervals.plot([low, high], [row, row], color="C0", linewidth=3, solid_capstyle="butt")
        intervals.plot(scale * f["mean"], row, "o", color="black")
        parts.barh(row, scale * f["seeds_part"], color="C1", label="seeds" if row == 0 else None)
        parts.barh(
            row,
            scale * f["examples_part"],
            left=scale * f["seeds_part"],
            color="C2",
            label="examples" if row == 0 else None,
        )
    if precision["half_width"]:
        intervals.axvspan(
            -precision["half_width"],
            precision["half_width"],
            color="grey",
            alpha=0.15,
            label=f"±{precision['half_width']:g} asked",
        )
    intervals.axvline(0.0, color="grey", linewidth=0.8)
    for axis in (intervals, parts):
        axis.set_yticks(range(len(rows)), [variant for variant, _ in rows], fontsize=8)
        axis.invert_yaxis()
    intervals.set(xlabel=f"difference from {reference}{unit}, 95% CI")
    parts.set(xlabel=f"standard error's parts{unit}")
    parts.legend(fontsize=7)
    figure.suptitle(f"Precision of the differences from {reference}", fontsize=10)
    return figure


def _search_figure(search: dict):
    """The development score of every grid point, one heat-map per searched variant (chosen point boxed)."""
    variants = search["variants"]
    figure, axes = plt.subplots(1, len(variants), figsize=(3.2 * len(variants) + 1, 3.2), squeeze=False)
    for axis, (variant, found) in zip(axes[0], variants.items()):
        rates = sorted({p["learning_rate"] for p in found["points"]})
        warmups = sorted({p["warmup_ratio"] for p in found["points"]})
        scores = np.full((len(warmups), len(rates)), np.nan)
        for point in found["points"]:
            scores[warmups.index(point["warmup_ratio"]), rates.index(point["learning_rate"])] = point["dev_score"]
        image = axis.imshow(scores, cmap="viridis_r" if found["metric"] == "loss" else "viridis", aspect="auto")
        for row, column in np.ndindex(scores.shape):
            axis.text(column, row, f"{scores[row, column]:.3f}", ha="center", va="center", color="white", fontsize=8)
        chosen = found["chosen"]
        row, column = warmups.index(chosen["warmup_ratio"]), rates.index(chosen["learning_rate"])
        axis.add_patch(plt.Rectangle((column - 0.5, row - 0.5), 1, 1, fill=False, edgecolor="red", linewidth=2))
        axis.set_xticks(range(len(rates)), [f"{r:g}" for r in rates], fontsize=8)
        axis.set_yticks(range(len(warmups)), [f"{w:g}" for w in warmups], fontsize=8)
        axis.set(xlabel="learning rate", ylabel="warm-up ratio", title=f"{variant}: dev {found['metric']}")
        figure.colorbar(image, ax=axis, fraction=0.046)
    return figure


def _collapse_figure(grouped: dict[str, list[dict]]):
    """First-token collapse of the final output against step (mean over seeds), with the source's as a line."""
    figure, axis = plt.subplots(figsize=(6, 4))
    for index, (variant, runs) in enumerate(grouped.items()):
        curves = [
            {r["step"]: r["collapse"]["first_token"][-1] for r in run["diagnostics"] if "collapse" in r}
            for run in runs
        ]
        steps = sorted(set.intersection(*(set(curve) for curve in curves)))
        axis.plot(
            steps,
            np.mean([[curve[s] for s in steps] for curve in curves], axis=0),
            marker=".",
            color=f"C{index}",
            label=variant,
        )
    sources = [
        run["source_collapse"]["first_token"][-1]
        for runs in grouped.values()
        for run in runs
        if run.get("source_collapse")
    ]
    axis.axhline(float(np.mean(sources)), color="gray", linestyle="--", label="source")
    axis.set(
        xlabel="step",
        ylabel="mean pairwise cosine of first-token outputs",
        ylim=(None, 1.02),
        title="Collapse of the probe's first-token outputs",
    )
    return figure


def _update_size_figure(summary: list[dict]):
    """One optimizer step's output change, and the last layer's gradient norm at initialisation, against depth
    (log-log, mean ± 1 std over seeds), one line per variant."""
    figure, axes = plt.subplots(1, 2, figsize=(10, 4))
    for index, variant in enumerate(dict.fromkeys(row["variant"] for row in summary)):
        rows = [row for row in summary if row["variant"] == variant]
        for axis, key in zip(axes, ("output_change", "last_layer_gradient_norm")):
            axis.errorbar(
                [row["depth"] for row in rows],
                [row[key]["mean"] for row in rows],
                yerr=[row[key]["std"] or 0.0 for row in rows],
                marker="o",
                capsize=3,
                color=f"C{index}",
                label=variant,
            )
    axes[0].set(ylabel="mean squared change of the final output", title="Output change after one step (Liu et al.)")
    axes[1].set(ylabel="last layer's gradient norm", title="Last layer's gradient at initialisation (Xiong et al.)")
    depths = sorted({row["depth"] for row in summary})
    for axis in axes:
        axis.set(xlabel="layers", xscale="log", yscale="log")
        axis.set_xticks(depths, [str(depth) for depth in depths])
        axis.set_xticks([], minor=True)
    return figure


def _sensitivity_figure(sensitivity: list[dict]):
    """The final metric against the learning rate (log scale), one line per group of variants, mean ± 1 std over
    seeds."""
    figure, axis = plt.subplots(figsize=(6, 4))
    for index, group in enumerate(sensitivity):
        points = group["points"]
        axis.errorbar(
            [point["learning_rate"] for point in points],
            [point["metric"]["mean"] for point in points],
            yerr=[point["metric"]["std"] or 0.0 for point in points],
            marker="o",
            capsize=3,
            color=f"C{index}",
            label=group["group"],
        )
    metric = sensitivity[0]["metric"]
    axis.set(
        xlabel="learning rate",
        xscale="log",
        ylabel=f"final validation {metric}",
        title="Learning-rate sensitivity (Wortsman et al. 2023)",
    )
    return figure

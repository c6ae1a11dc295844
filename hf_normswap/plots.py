"""Figures of a comparison: loss, evaluation metric, per-layer gradient norm at initialisation, residual RMS."""

from pathlib import Path

import matplotlib


matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def _by_variant(results: list[dict]) -> dict[str, list[dict]]:
    grouped = {}
    for result in results:
        grouped.setdefault(result["variant"], []).append(result)
    return grouped


def _mean_curve(runs: list[dict], key: str) -> tuple[list[float], np.ndarray]:
    curves = [{entry["step"]: entry[key] for entry in run["log_history"] if key in entry} for run in runs]
    steps = sorted(set.intersection(*(set(curve) for curve in curves)))
    return steps, np.array([[curve[step] for step in steps] for curve in curves]).mean(axis=0)


def write_plots(output: Path, results: list[dict]) -> list[str]:
    """Writes the PNG figures into `output`; returns their file names."""
    grouped = _by_variant(results)
    metric = next(name for name in results[0]["metrics"] if name not in ("loss", "runtime", "samples_per_second", "steps_per_second"))
    figures = {}

    figure, axis = plt.subplots(figsize=(6, 4))
    for variant, runs in grouped.items():
        axis.plot(*_mean_curve(runs, "loss"), label=variant)
    axis.set(xlabel="step", ylabel="training loss (mean over seeds)", title="Training loss")
    figures["loss.png"] = figure

    figure, axis = plt.subplots(figsize=(6, 4))
    for variant, runs in grouped.items():
        axis.plot(*_mean_curve(runs, f"eval_{metric}"), marker="o", label=variant)
    axis.set(xlabel="step", ylabel=f"validation {metric} (mean over seeds)", title=f"Validation {metric}")
    figures["eval_metric.png"] = figure

    figure, axis = plt.subplots(figsize=(6, 4))
    for index, (variant, runs) in enumerate(grouped.items()):
        color = f"C{index}"
        for part, style in (("attention", "-"), ("ffn", "--")):
            norms = np.array([run["diagnostics"][0][part] for run in runs]).mean(axis=0)
            axis.plot(range(len(norms)), norms, style, color=color, marker=".", label=f"{variant} {part}")
    axis.set(xlabel="layer", ylabel="gradient norm at initialisation", yscale="log",
             title="Per-layer gradient norm at initialisation (Xiong et al. 2020)")
    figures["grad_norm_init.png"] = figure

    figure, axis = plt.subplots(figsize=(6, 4))
    for index, (variant, runs) in enumerate(grouped.items()):
        start = np.array([run["diagnostics"][0]["residual_rms"] for run in runs]).mean(axis=0)
        axis.plot(range(len(start)), start, "--", color=f"C{index}", label=f"{variant}, initialisation")
        ends = [next(r["residual_rms"] for r in reversed(run["diagnostics"]) if "residual_rms" in r) for run in runs]
        axis.plot(range(len(start)), np.array(ends).mean(axis=0), "-", color=f"C{index}", label=f"{variant}, end")
    axis.set(xlabel="depth (0: embeddings)", ylabel="residual-stream RMS", yscale="log", title="Residual stream RMS")
    figures["residual_rms.png"] = figure

    for name, figure in figures.items():
        figure.axes[0].legend(fontsize=7)
        figure.tight_layout()
        figure.savefig(output / name, dpi=120)
        plt.close(figure)
    return list(figures)

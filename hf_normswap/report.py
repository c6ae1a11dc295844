"""The comparison report: statistics over seeds, failed runs, per-run configurations; markdown and JSON."""

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
from scipy import stats

from .plots import write_plots


def summarize(values: list[float]) -> dict:
    """Mean, sample standard deviation and the 95% Student-t confidence interval of the mean."""
    values = [float(v) for v in values]
    mean = float(np.mean(values))
    if len(values) < 2:
        return {"n": len(values), "mean": mean, "std": None, "ci95": None}
    std = float(np.std(values, ddof=1))
    half = float(stats.t.ppf(0.975, len(values) - 1) * std / math.sqrt(len(values)))
    return {"n": len(values), "mean": mean, "std": std, "ci95": [mean - half, mean + half]}


def write_report(output: Path, experiment, task, results: list[dict]) -> dict:
    """Writes report.md, results.json and the plots into `output`; returns what results.json holds."""
    variants = list(dict.fromkeys(result["variant"] for result in results))
    metric_names = [name for name in results[0]["metrics"] if name not in ("loss", "runtime", "samples_per_second", "steps_per_second")]
    summary = {}
    for variant in variants:
        runs = [r for r in results if r["variant"] == variant]
        summary[variant] = {
            "metrics": {name: summarize([r["metrics"][name] for r in runs]) for name in ["loss", *metric_names]},
            "failed_runs": sum(r["failed"] for r in runs),
            "runs": len(runs),
        }
    document = {
        "experiment": dataclasses.asdict(experiment),
        "task": {"name": task.name, "metric": task.metric, "train_size": len(task.data["train"]),
                 "validation_size": len(task.data["validation"]), "majority_baseline": task.majority_baseline},
        "summary": summary,
        "runs": results,
    }
    output.mkdir(parents=True, exist_ok=True)
    (output / "results.json").write_text(json.dumps(document, indent=1) + "\n")
    plots = write_plots(output, results)
    (output / "report.md").write_text(_markdown(document, metric_names, plots))
    return document


def _cell(summary: dict) -> str:
    if summary["std"] is None:
        return f"{summary['mean']:.4f} (n=1)"
    low, high = summary["ci95"]
    return f"{summary['mean']:.4f} ± {summary['std']:.4f} [{low:.4f}, {high:.4f}]"


def _markdown(document: dict, metric_names: list[str], plots: list[str]) -> str:
    experiment, task = document["experiment"], document["task"]
    lines = [
        "# NormSwap comparison",
        "",
        f"Model `{experiment['model'] or 'all-MiniLM-L6-v2 (demo)'}`, task `{task['name']}` "
        f"({task['train_size']} training / {task['validation_size']} validation examples), "
        f"{experiment['seeds']} seed(s), learning rate {experiment['learning_rate']}, batch {experiment['batch_size']}, "
        f"max length {experiment['max_length']}, "
        + (f"{experiment['max_steps']} steps" if experiment["max_steps"] > 0 else f"{experiment['epochs']} epochs")
        + f", warm-up ratio {experiment['warmup_ratio']}.",
        "",
        "Every variant of a seed sees the same data in the same order and starts from the same classification head. "
        "Cells: mean ± standard deviation over seeds [95% confidence interval, Student t]. A run has failed when its "
        f"final {task['metric']} metric is no better than the majority-class baseline "
        f"({task['majority_baseline']:.4f}; Mosbach et al. 2021).",
        "",
        "| variant | " + " | ".join(["eval loss", *metric_names]) + " | failed runs |",
        "|---|" + "---|" * (len(metric_names) + 2),
    ]
    for variant, summary in document["summary"].items():
        cells = [_cell(summary["metrics"][name]) for name in ["loss", *metric_names]]
        lines.append(f"| {variant} | " + " | ".join(cells) + f" | {summary['failed_runs']} / {summary['runs']} |")
    lines += ["", "## Plots", ""]
    lines += [f"![{name}]({name})" for name in plots]
    lines += ["", "## Runs", "", "| variant | seed | " + " | ".join(metric_names) + " | resumed |", "|---|---|" + "---|" * (len(metric_names) + 1)]
    for run in document["runs"]:
        values = " | ".join(f"{run['metrics'][name]:.4f}" for name in metric_names)
        lines.append(f"| {run['variant']} | {run['seed']} | {values} | {run['resumed']} |")
    lines += ["", "## Configuration of each run", ""]
    for run in document["runs"]:
        model = {k: run["model_config"].get(k) for k in ("model_type", "norm_placement", "position_embedding_type", "norm_type", "num_hidden_layers", "hidden_size", "is_causal")}
        training = {k: run["training_arguments"][k] for k in ("learning_rate", "per_device_train_batch_size", "num_train_epochs", "max_steps", "warmup_steps", "weight_decay", "max_grad_norm", "seed", "data_seed", "lr_scheduler_type", "optim")}
        lines += [f"<details><summary>{run['variant']}, seed {run['seed']}</summary>", "", "```json",
                  json.dumps({"model": model, "training": training}, indent=1), "```", "", "</details>", ""]
    lines.append("Full model configurations, training arguments and every logged step are in `results.json`.")
    return "\n".join(lines) + "\n"

"""The comparison report: statistics over seeds, paired differences, the settings search, collapse, healing, update
size against depth, learning-rate sensitivity, failed runs, per-run configurations; markdown and JSON."""

import json
from pathlib import Path

from ..probes.collapse import COLLAPSE_MARGIN, POOLINGS
from ..probes.stream_mix import largest_layers
from ..sharding import flat_settings
from ..tasks import Task
from .convergence import convergence_sentence, time_sentence
from .experiment import Experiment
from .plots import write_plots
from .precision import failure_rate
from .precision_report import failures_cell, precision_figures, precision_lines
from .statistics import (
    describe,
    learning_rate_sensitivity,
    paired_difference,
    summarize,
    task_metrics,
)


_MODEL_KEYS = (  # of each run's model configuration, in the report
    "model_type",
    "norm_placement",
    "position_embedding_type",
    "norm_type",
    "num_hidden_layers",
    "hidden_size",
    "is_causal",
)
_TRAINING_KEYS = (  # of each run's training arguments, in the report
    "learning_rate",
    "per_device_train_batch_size",
    "num_train_epochs",
    "max_steps",
    "warmup_steps",
    "weight_decay",
    "max_grad_norm",
    "seed",
    "data_seed",
    "lr_scheduler_type",
    "optim",
)


def write_report(
    output: Path,
    experiment: Experiment,
    task: Task,
    results: list[dict],
    search: dict | None = None,
    update_size: dict | None = None,
) -> dict:
    """Writes report.md, results.json and the plots into `output`; returns what results.json holds (with
    `update_size` when measured, and `learning_rate_sensitivity` when variants differ only in learning rate)."""
    variants = list(dict.fromkeys(result["variant"] for result in results))
    metric_names = task_metrics(results[0]["metrics"])
    reference = experiment.reference_variant
    selection_metric = "loss" if experiment.task_type == "causal-lm" else "accuracy"  # as the settings search's
    sensitivity = learning_rate_sensitivity(results, metric=selection_metric)
    labels = None if experiment.task_type == "causal-lm" else list(task.data["validation"]["label"])
    document = {
        "experiment": flat_settings(experiment),
        "task": _task_record(experiment, task),
        "search": search,
        "summary": {
            variant: _variant_summary([r for r in results if r["variant"] == variant], metric_names)
            for variant in variants
        },
        "paired": {"reference": reference, "variants": _paired(results, reference, metric_names)},
        "precision": precision_figures(results, experiment, labels, selection_metric),
        "runs": results,
    }
    if update_size:
        document["update_size"] = update_size
    if sensitivity:
        document["learning_rate_sensitivity"] = sensitivity
    output.mkdir(parents=True, exist_ok=True)
    (output / "results.json").write_text(json.dumps(document, indent=1) + "\n")
    plots = write_plots(
        output=output,
        results=results,
        reference=reference,
        search=search,
        update_size=update_size,
        sensitivity=sensitivity,
        precision=document["precision"],
    )
    (output / "report.md").write_text(_markdown(document, metric_names, plots))
    return document


def _task_record(experiment: Experiment, task: Task) -> dict:
    if experiment.task_type == "causal-lm":
        record = {"name": task.name, "type": "causal-lm", "metric": "perplexity", "unigram_loss": task.unigram_loss}
    else:
        record = {"name": task.name, "metric": task.metric, "majority_baseline": task.majority_baseline}
    return {**record, "train_size": len(task.data["train"]), "validation_size": len(task.data["validation"])}


def _variant_summary(runs: list[dict], metric_names: list[str]) -> dict:
    """A variant's statistics over its seeds, failed runs (with their rate's Wilson interval), runs that converged,
    settings, collapse and healing."""
    return {
        "metrics": {name: summarize([r["metrics"][name] for r in runs]) for name in ["loss", *metric_names]},
        "failed_runs": sum(r["failed"] for r in runs),
        "failure_rate": failure_rate(sum(r["failed"] for r in runs), len(runs)),
        "converged_runs": sum(bool(r.get("converged")) for r in runs),
        "runs": len(runs),
        "settings": runs[0]["point"],
        "collapse": summarize_collapse(runs),
        "heal": runs[0].get("heal"),
    }


def _paired(results: list[dict], reference: str, metric_names: list[str]) -> dict:
    """Every other variant's paired differences from the reference, seed by seed, with a sentence for each metric."""
    paired = {}
    for variant in dict.fromkeys(result["variant"] for result in results):
        if variant == reference:
            continue
        paired[variant] = {}
        for name in ["loss", *metric_names]:
            by_seed = {
                v: {r["seed"]: r["metrics"][name] for r in results if r["variant"] == v} for v in (reference, variant)
            }
            difference = paired_difference(reference=by_seed[reference], other=by_seed[variant])
            sentence = describe(variant=variant, reference=reference, metric=name, difference=difference)
            paired[variant][name] = {**difference, "sentence": sentence}
    return paired


def _markdown(document: dict, metric_names: list[str], plots: list[str]) -> str:
    lines = _introduction(document)
    lines += _summary_table(document["summary"], metric_names)
    lines += _paired_markdown(document["paired"], metric_names)
    lines += precision_lines(document["precision"], document["paired"]["reference"])
    if document["search"]:
        lines += _search_markdown(document["search"])
    lines += [""]
    lines += collapse_report_lines(document["summary"])
    lines += _healing_lines(document["summary"])
    lines += _update_size_lines(document.get("update_size"))
    lines += _sensitivity_lines(document.get("learning_rate_sensitivity"))
    lines += ["## Plots", ""]
    lines += [f"![{name}]({name})" for name in plots]
    lines += _runs_lines(document["runs"], metric_names)
    lines.append("Full model configurations, training arguments and every logged step are in `results.json`.")
    return "\n".join(lines) + "\n"


def _introduction(document: dict) -> list[str]:
    """The title, what was compared and how, and when a run counts as failed."""
    experiment, task = document["experiment"], document["task"]
    length = f"{experiment['max_steps']} steps" if experiment["max_steps"] > 0 else f"{experiment['epochs']} epochs"
    if document["search"]:
        settings = "settings chosen per variant on a development split (below)"
    else:
        settings = f"learning rate {experiment['learning_rate']}, warm-up ratio {experiment['warmup_ratio']}"
    causal = task.get("type") == "causal-lm"
    if causal:
        failure = (
            f"A run has failed when its final validation loss is no better than that of the training tokens' "
            f"frequencies (unigram loss {task['unigram_loss']:.4f}) or is not finite."
        )
    else:
        failure = (
            f"A run has failed when its final {task['metric']} metric is no better than the majority-class "
            f"baseline ({task['majority_baseline']:.4f}; Mosbach et al. 2021)."
        )
    runs = document["runs"]
    counts = sorted({sum(run["variant"] == v for run in runs) for v in document["summary"]})
    seeds = f"{counts[0]} to {counts[-1]}" if len(counts) > 1 else str(counts[0])
    convergence = f"{convergence_sentence(runs)} {time_sentence(runs)}".strip()
    return [
        "# NormSwap comparison",
        "",
        f"Model `{experiment['model'] or 'all-MiniLM-L6-v2 (demo)'}`, task `{task['name']}`"
        + (" (causal language modelling)" if causal else "")
        + f" ({task['train_size']} training / {task['validation_size']} validation examples), "
        f"{seeds} seed(s), {settings}, batch {experiment['batch_size']}, "
        f"max length {experiment['max_length']}, {length}"
        + (f", {experiment['attention']} attention" if experiment.get("attention") else "")
        + (", learning rates relative to the source's" if experiment.get("relative_learning_rates") else "")
        + (", padding-free batches (native variants padded)." if experiment.get("packing") else "."),
        "",
        "Every variant of a seed sees the same data in the same order and starts from the same head. "
        f"Cells: mean ± standard deviation over seeds [95% confidence interval, Student t]. {failure} "
        f"{convergence}",
        "",
    ]


def _summary_table(summary: dict, metric_names: list[str]) -> list[str]:
    lines = [
        "| variant | settings | " + " | ".join(["eval loss", *metric_names]) + " | failed runs |",
        "|---|---|" + "---|" * (len(metric_names) + 2),
    ]
    for variant, figures in summary.items():
        cells = [_cell(figures["metrics"][name]) for name in ["loss", *metric_names]]
        lines.append(
            f"| {variant} | {_settings(figures['settings'])} | " + " | ".join(cells) + f" | {failures_cell(figures)} |"
        )
    return lines


def _cell(summary: dict) -> str:
    if summary["std"] is None:
        return f"{summary['mean']:.4f} (n=1)"
    low, high = summary["ci95"]
    return f"{summary['mean']:.4f} ± {summary['std']:.4f} [{low:.4f}, {high:.4f}]"


def _settings(point: dict) -> str:
    return f"lr {point['learning_rate']:g}, warm-up {point['warmup_ratio']:g}"


def _paired_markdown(paired: dict, metric_names: list[str]) -> list[str]:
    if not paired["variants"]:
        return []
    lines = [
        "",
        f"## Paired differences from {paired['reference']}",
        "",
        "Each seed's score minus the reference's score on the same seed (same data order, same head): mean with the "
        "95% paired-t confidence interval, and the two-sided exact sign-test p-value.",
        "",
    ]
    main = metric_names[0]
    lines += [f"- {paired['variants'][variant][main]['sentence']}." for variant in paired["variants"]]
    lines += ["", "| variant | metric | per-seed differences | mean [95% CI] | sign-test p |", "|---|---|---|---|---|"]
    for variant, by_metric in paired["variants"].items():
        for name in ["loss", *metric_names]:
            difference = by_metric[name]
            values = ", ".join(f"{d:+.4f}" for d in difference["differences"])
            interval = f" [{difference['ci95'][0]:+.4f}, {difference['ci95'][1]:+.4f}]" if difference["ci95"] else ""
            mean = f"{difference['mean']:+.4f}{interval}" if difference["n"] else "-"
            lines.append(f"| {variant} | {name} | {values} | {mean} | {difference['sign_test_p']:.3g} |")
    return lines


def _search_markdown(search: dict) -> list[str]:
    split = search["dev_split"]
    lines = [
        "",
        "## Settings search",
        "",
        f"Each variant trained at every grid point on the training data less a development split "
        f"({split['fraction']:g} of it, {split['size']} examples, carved with seed {split['seed']}); every seed then "
        "ran at the point that scored best on the development split, and was evaluated on validation. The validation "
        "split played no part in the choice.",
        "",
        "| variant | metric | " + " | ".join(["learning rate", "warm-up", "development score", "chosen"]) + " |",
        "|---|---|---|---|---|---|",
    ]
    for variant, found in search["variants"].items():
        for point in found["points"]:
            chosen = all(point[k] == v for k, v in found["chosen"].items())
            lines.append(
                f"| {variant} | {found['metric']} | {point['learning_rate']:g} | {point['warmup_ratio']:g} | "
                f"{point['dev_score']:.4f} | {'**yes**' if chosen else ''} |"
            )
    return lines


def _healing_lines(summary: dict) -> list[str]:
    healed = {variant: figures["heal"] for variant, figures in summary.items() if figures.get("heal")}
    if not healed:
        return []
    causal = any(heal.get("next_token") for heal in healed.values())
    lines = [
        "## Healing",
        "",
        "`+heal` variants were trained to compute what the source computes (`hf-normswap heal`) once, before the "
        "seeds' fine-tuning; figures on held-out text, final output (see each variant's `heal.json`).",
        "",
        "| variant | objective, steps, learning rate | seconds | token cosine to the source "
        "| first-token collapse (source) |"
        + (
            " next-token KL (nats per token) | top-1 agreement | KL by position in the text, after "
            "| KL with one layer alone swapped, before |"
            if causal
            else ""
        ),
        "|---|---|---|---|---|" + ("---|---|---|---|" if causal else ""),
    ]
    for variant, heal in healed.items():
        before, after = heal["before"], heal["after"]
        line = (
            f"| {variant} | {heal['objective']}, {heal['steps']}, {heal['learning_rate']} | {heal['seconds']:.0f}"
            + (" (resumed)" if heal["resumed"] else "")
            + f" | {before['token_cosine']:.4f} → {after['token_cosine']:.4f} "
            f"| {before['collapse_first_token']:.4f} → {after['collapse_first_token']:.4f} "
            f"({heal['teacher_collapse']['first_token'][-1]:.4f}) |"
        )
        if causal:
            line += _next_token_cells(heal)
        lines.append(line)
    return lines + [""]


def _next_token_cells(heal: dict) -> str:
    """A healed causal LM's next-token KL to the source and top-1 agreement with it, before → after (from the
    conversion, through the layers' fit where there was one), its KL by the token's position in the text after
    (`probes.next_token.POSITION_BINS`), and the layers that lost the most alone before (`probes.stream_mix`)."""
    if not heal.get("next_token"):
        return " | | | |"
    before, after = heal["next_token"]["before"], heal["next_token"]["after"]
    converted = (heal.get("reconstruction") or {}).get("conversion") or before

    def path(figure: str) -> str:
        fitted = f"{before[figure]:.4f} (fitted) → " if converted is not before else ""
        return f"{converted[figure]:.4f} → {fitted}{after[figure]:.4f}"

    by_position = ", ".join(f"{bin}: {kl:.3f}" for bin, kl in after.get("kl_by_position", {}).items())
    by_layer = largest_layers(converted["kl_by_layer"]) if "kl_by_layer" in converted else ""
    return f" {path('kl')} | {path('top1_agreement')} | {by_position} | {by_layer} |"


def _update_size_lines(update_size: dict | None) -> list[str]:
    """The update size and the last layer's gradient norm at initialisation against depth."""
    if not update_size:
        return []
    lines = [
        "## Update size against depth",
        "",
        "Each variant's configuration with as many layers as shown, initialised as its runs are (Admin profiled on "
        f"the same batch), takes one AdamW step on the first training batch ({update_size['batch_size']} examples) "
        "at its learning rate: the output change is the mean squared change of the final hidden states over real "
        "tokens and features (Liu et al. 2020), the gradient norm that of the last layer's parameters before the "
        "step (Xiong et al. 2020). Mean ± standard deviation over seeds.",
        "",
        "| variant | learning rate | depth | output change | last layer's gradient norm |",
        "|---|---|---|---|---|",
    ]
    for row in update_size["summary"]:
        change, norm = row["output_change"], row["last_layer_gradient_norm"]
        lines.append(
            f"| {row['variant']} | {row['learning_rate']:g} | {row['depth']} | {_spread(change)} | {_spread(norm)} |"
        )
    return lines + [""]


def _spread(summary: dict) -> str:
    if summary["std"] is None:
        return f"{summary['mean']:.3g} (n=1)"
    return f"{summary['mean']:.3g} ± {summary['std']:.2g}"


def _sensitivity_lines(sensitivity: list[dict] | None) -> list[str]:
    """The final metric against the learning rate, for the variants that differ only in it."""
    if not sensitivity:
        return []
    metric = sensitivity[0]["metric"]
    lines = [
        "## Learning-rate sensitivity",
        "",
        f"Final validation {metric} against the learning rate (Wortsman et al. 2023), for the variants that differ "
        "only in their learning rate (`@learning_rate=`; without it, the rate the variant ran at).",
        "",
        f"| group | learning rate | validation {metric} | failed runs |",
        "|---|---|---|---|",
    ]
    for group in sensitivity:
        for point in group["points"]:
            lines.append(
                f"| {group['group']} | {point['learning_rate']:g} | {_cell(point['metric'])} "
                f"| {point['failed_runs']} / {point['runs']} |"
            )
    return lines + [""]


def _runs_lines(runs: list[dict], metric_names: list[str]) -> list[str]:
    """Each run's final metrics, and the main parts of its model configuration and training arguments."""
    lines = [
        "",
        "## Runs",
        "",
        "| variant | seed | " + " | ".join(metric_names) + " | converged | resumed |",
        "|---|---|" + "---|" * (len(metric_names) + 2),
    ]
    converged = {True: "yes", False: "still improving", None: "not judged"}
    for run in runs:
        values = " | ".join(f"{run['metrics'][name]:.4f}" for name in metric_names)
        lines.append(
            f"| {run['variant']} | {run['seed']} | {values} | {converged[run.get('converged')]} | {run['resumed']} |"
        )
    lines += ["", "## Configuration of each run", ""]
    for run in runs:
        model = {k: run["model_config"].get(k) for k in _MODEL_KEYS}
        training = {k: run["training_arguments"][k] for k in _TRAINING_KEYS}
        lines += [
            f"<details><summary>{run['variant']}, seed {run['seed']}</summary>",
            "",
            "```json",
            json.dumps({"model": model, "training": training}, indent=1),
            "```",
            "",
            "</details>",
            "",
        ]
    return lines


def summarize_collapse(runs: list[dict]) -> dict | None:
    """A variant's final-output collapse figures in a comparison (means over seeds): its source's, at the start and
    at the end of fine-tuning, and whether the start is flagged; None without diagnostics or source."""
    runs = [run for run in runs if run.get("source_collapse") and "collapse" in run["diagnostics"][0]]
    if not runs:
        return None
    ends = [next(r["collapse"] for r in reversed(run["diagnostics"]) if "collapse" in r) for run in runs]

    def mean_last(profiles: list[dict]) -> dict[str, float]:
        return {p: sum(profile[p][-1] for profile in profiles) / len(profiles) for p in POOLINGS}

    summary = {
        "source": mean_last([run["source_collapse"] for run in runs]),
        "start": mean_last([run["diagnostics"][0]["collapse"] for run in runs]),
        "end": mean_last(ends),
    }
    summary["flagged"] = any(summary["start"][p] > summary["source"][p] + COLLAPSE_MARGIN for p in POOLINGS)
    return summary


def collapse_report_lines(summary: dict) -> list[str]:
    """The comparison report's collapse section."""
    rows = {variant: figures["collapse"] for variant, figures in summary.items() if figures.get("collapse")}
    if not rows:
        return []
    lines = [
        "## Collapse",
        "",
        "Mean pairwise cosine between the first-token / mean-pooled final outputs of the diagnostics probe "
        "(1.0: every input gets the same vector), means over seeds. A variant that starts fine-tuning more than "
        f"{COLLAPSE_MARGIN} above its source is flagged: its runs measure a broken model, not the placement.",
        "",
        "| variant | source | start of fine-tuning | end of fine-tuning | flag |",
        "|---|---|---|---|---|",
    ]
    for variant, figures in rows.items():
        cells = [" / ".join(f"{figures[when][p]:.3f}" for p in POOLINGS) for when in ("source", "start", "end")]
        lines.append(f"| {variant} | " + " | ".join(cells) + f" | {'**collapsed**' if figures['flagged'] else ''} |")
    return lines + [""]

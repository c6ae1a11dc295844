"""The comparison report: statistics over seeds, paired differences, the settings search, collapse, healing, update
size against depth, learning-rate sensitivity, failed runs, per-run configurations; markdown and JSON."""

import json
from pathlib import Path

from ..convert.stream_mix import largest_layers
from ..probes.collapse import COLLAPSE_MARGIN, POOLINGS
from ..sharding import flat_settings
from ..tasks import Task
from .experiment import Experiment
from .plots import write_plots
from .precision import (
    BOOTSTRAP_SAMPLES,
    at_width,
    equivalence,
    examples_needed,
    failure_rate,
    first_stage_seeds,
    holm,
    paired_precision,
    stage_one,
)
from .statistics import (
    LOWER_IS_BETTER,
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
        "precision": _precision(results, experiment, labels, selection_metric),
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


def _precision(results: list[dict], experiment: Experiment, labels: list[int] | None, metric: str) -> dict:
    """Each paired difference's interval over seeds and examples, its parts, the difference it would detect, its
    equivalence test and Holm's family-wise p-value; run to `ci_half_width`, its two stages (`at_width`)."""
    reference, width = experiment.reference_variant, experiment.width_in_metric_units
    figures = paired_precision(results, reference, labels, metric)
    measured = {variant: f["p_value"] for variant, f in figures.items() if f["p_value"] is not None}
    for variant, adjusted in holm(measured).items():
        figures[variant]["holm_p"] = adjusted
    precision = {"metric": metric, "half_width": experiment.ci_half_width, "differences": figures, "stages": None}
    if width is None:
        return precision
    stage, seeds, stopped = stage_one(
        results, reference, labels, metric, experiment.seeds, width, experiment.max_seeds
    )
    for variant, figure in figures.items():
        figure["equivalence"] = equivalence(figure, width)
        figure["at_width"] = at_width(stage[variant], figure, width, experiment.max_seeds)
        figure["examples_needed"] = examples_needed(stage[variant], width)
    precision["stages"] = {"first": first_stage_seeds(experiment.seeds), "seeds": seeds, "stopped": stopped}
    return precision


def _markdown(document: dict, metric_names: list[str], plots: list[str]) -> str:
    lines = _introduction(document)
    lines += _summary_table(document["summary"], metric_names)
    lines += _paired_markdown(document["paired"], metric_names)
    lines += _precision_markdown(document["precision"], document["paired"]["reference"])
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
    still = [run for run in runs if run.get("converged") is False]
    if any(run.get("converged") is None for run in runs):
        convergence = "Runs without a development split are not judged for convergence."
    elif still:
        convergence = (
            f"**{len(still)} of {len(runs)} runs were still improving** at their last evaluation (their development "
            "loss fell by more than 1% there): this compared a budget of training, not converged runs."
        )
    else:
        convergence = (
            "Every run had converged: its last evaluation on the development split lowered the best development loss "
            "by 1% or less."
        )
    timed = [run["seconds"] for run in runs if run.get("seconds")]
    if timed:
        mean = {part: sum(t[part] for t in timed) / len(timed) for part in timed[0]}
        convergence += (
            f" A run took {sum(mean.values()) - mean['development']:.1f} s on average: building the model "
            f"{mean['build']:.1f} s, training {mean['train']:.1f} s (development evaluations "
            f"{mean['development']:.1f} s of it), the final evaluation {mean['evaluation']:.1f} s."
        )
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
            f"| {variant} | {_settings(figures['settings'])} | " + " | ".join(cells) + f" | {_failures(figures)} |"
        )
    return lines


def _failures(figures: dict) -> str:
    """`0 / 5 (0-43%)`: failed runs, and the 95% Wilson interval of the failure rate."""
    rate = figures.get("failure_rate")
    interval = f" ({rate['ci95'][0]:.0%}-{rate['ci95'][1]:.0%})" if rate and rate["ci95"] else ""
    return f"{figures['failed_runs']} / {figures['runs']}{interval}"


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


def _precision_markdown(precision: dict, reference: str) -> list[str]:
    """The precision of each difference: its interval over seeds and examples, the parts, what it would detect, and
    run to a width, Stein's interval at it, what it needs, and equivalence."""
    differences, stages = precision["differences"], precision["stages"]
    if not differences:
        return []
    metric, width = precision["metric"], precision["half_width"]
    scale = 1.0 if metric in LOWER_IS_BETTER else 100.0
    lines = [
        "",
        f"## Precision of the differences from {reference}",
        "",
        f"{metric.capitalize()}{'' if scale == 1 else ' in points'}: the 95% interval of each mean difference over "
        "the seeds and the evaluation examples together (a two-way random-effects analysis of variance: seeds and "
        "examples crossed, Student t with Satterthwaite's degrees of freedom), and its two parts as standard errors. "
        "Seeds where either run failed are left out. Detectable: the difference these seeds would find with 80% "
        "power. Holm p: the family-wise p-value over the differences.",
        "",
        "| variant | difference [95% CI] | half-width | seeds part | examples part | detectable | seeds | Holm p |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for variant, f in differences.items():
        if f["se"] is None:
            said = "no seed where neither run failed" if f["mean"] is None else f"{scale * f['mean']:+.2f} (one seed)"
            lines.append(f"| {variant} | {said} | | | | | {f['n']} | |")
            continue
        examples = f"{scale * f['examples_part']:.2f}" if f["examples"] else "not measured"
        cells = [
            _interval(f["mean"], f["ci95"], scale),
            f"{scale * f['half_width']:.2f}",
            f"{scale * f['seeds_part']:.2f}",
            examples,
            f"{scale * f['detectable']:.2f}",
            str(f["n"]) + (f" × {f['examples']} examples" if f["examples"] else ""),
            f"{f['holm_p']:.3g}",
        ]
        lines.append(f"| {variant} | " + " | ".join(cells) + " |")
    if stages:
        said = {
            "reached": f"every difference within ±{width:g}",
            "max_seeds": "max_seeds, before every difference was within the width",
            "examples": "a difference whose evaluation examples alone are too few for the width",
            "unmeasured": "a difference without two first-stage seeds where neither run failed",
        }[stages["stopped"]]
        lines += [
            "",
            f"Run to ±{width:g}{'' if scale == 1 else ' points'} by Stein's two-stage rule: {stages['first']} seeds "
            f"first, then the seeds each difference's spread asks for ({_counts(stages['seeds'])}); stopped at "
            f"{said}. Stein's "
            "interval is the final mean's at the first stage's spread (exact coverage); equivalence: two one-sided "
            f"tests at ±{width:g}.",
            "",
            f"| variant | Stein's 95% CI | within ±{width:g} | seeds asked for | equivalent at ±{width:g} |",
            "|---|---|---|---|---|",
        ]
        for variant, f in differences.items():
            stein = f["at_width"]
            interval = _interval(f["mean"], stein["ci95"], scale) if stein["ci95"] else "-"
            lines.append(
                f"| {variant} | {interval} | {_reach(stein, f)} | {stein['seeds_needed'] or '-'} "
                f"| {'yes' if f['equivalence']['equivalent'] else 'no'} |"
            )
    tested = {variant: f["per_seed"] for variant, f in differences.items() if f.get("per_seed")}
    if tested:
        lines += [
            "",
            "Each seed alone: McNemar's exact p-value, and the standard error of its difference from a paired "
            f"bootstrap over the evaluation examples ({BOOTSTRAP_SAMPLES} resamples).",
            "",
            "| variant | McNemar p by seed | bootstrap standard error by seed |",
            "|---|---|---|",
        ]
        for variant, tests in tested.items():
            p_values = ", ".join(f"{p:.2g}" for p in tests["mcnemar_p"])
            errors = ", ".join(f"{scale * e:.2f}" for e in tests["bootstrap_se"])
            lines.append(f"| {variant} | {p_values} | {errors} |")
    return lines


def _counts(seeds: dict[str, int]) -> str:
    """`post 12, pre 12, pre+heal 5`: the seeds each variant ran."""
    return ", ".join(f"{variant} {count}" for variant, count in seeds.items())


def _interval(mean: float, interval: list[float], scale: float) -> str:
    return f"{scale * mean:+.2f} [{scale * interval[0]:+.2f}, {scale * interval[1]:+.2f}]"


def _reach(stein: dict, figures: dict) -> str:
    """Whether a difference holds the width, or the seeds (or evaluation examples) its first stage implies."""
    if stein["within"]:
        return "yes"
    if stein["seeds_needed"] is None:
        return f"no: needs about {figures['examples_needed']} evaluation examples"
    return f"no: needs {stein['seeds_needed']} seeds"


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
    (`probes.next_token.POSITION_BINS`), and the layers that lost the most alone before (`convert.stream_mix`)."""
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

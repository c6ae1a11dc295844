"""The comparison report's precision of each paired difference (`precision`): its figures for results.json, and its
markdown section."""

from .experiment import Experiment
from .precision import (
    BOOTSTRAP_SAMPLES,
    at_width,
    equivalence,
    examples_needed,
    first_stage_seeds,
    holm,
    paired_precision,
    stage_one,
)
from .statistics import LOWER_IS_BETTER


def precision_figures(results: list[dict], experiment: Experiment, labels: list[int] | None, metric: str) -> dict:
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


def precision_lines(precision: dict, reference: str) -> list[str]:
    """The precision of each difference: its interval over seeds and examples, the parts, what it would detect, and
    run to a width, Stein's interval at it, what it needs, and equivalence."""
    differences, metric = precision["differences"], precision["metric"]
    if not differences:
        return []
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
    return lines + _stein_lines(precision, scale) + _per_seed_lines(differences, scale)


def _stein_lines(precision: dict, scale: float) -> list[str]:
    """Run to a width: where it stopped, and each difference's interval at the first stage's spread."""
    differences, stages, width = precision["differences"], precision["stages"], precision["half_width"]
    lines = []
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
    return lines


def _per_seed_lines(differences: dict, scale: float) -> list[str]:
    """Each seed alone: McNemar's test and the paired bootstrap's standard error."""
    lines = []
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


def failures_cell(figures: dict) -> str:
    """`0 / 5 (0-43%)`: failed runs, and the 95% Wilson interval of the failure rate."""
    rate = figures.get("failure_rate")
    interval = f" ({rate['ci95'][0]:.0%}-{rate['ci95'][1]:.0%})" if rate and rate["ci95"] else ""
    return f"{figures['failed_runs']} / {figures['runs']}{interval}"

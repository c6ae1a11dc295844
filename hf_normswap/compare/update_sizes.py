"""The update size against depth (Liu et al. 2020; Xiong et al. 2020): each variant's configuration at several depths,
initialised as its runs are, after one optimizer step on the first training batch; each measurement is written once
into OUTPUT/update_size, so that a rerun reads it back."""

import itertools
import json
from pathlib import Path

from ..model.configuration_normswap import mix_ln_placement
from ..probes.update_size import update_size
from .experiment import Variant
from .runner import Runner
from .statistics import summarize
from .variants import Start


FIGURES = ("output_change", "last_layer_gradient_norm")


def measure_update_sizes(
    runner: Runner, variants: list[Variant], starts: dict[str, Start], points: dict[str, dict], output: Path
) -> dict:
    """For every start of `variants` (those that differ only in learning rate or warm-up share one, measured at the
    first one's learning rate), every depth of `update_size_depths` and every seed: `update_size` of the model
    initialised from the start's configuration with that many layers. Returns the measurements and their
    statistics over seeds."""
    experiment = runner.experiment
    learning_rates = {}
    for variant in variants:
        learning_rates.setdefault(variant.start_name, (variant, points[variant.spec]["learning_rate"]))
    measurements = []
    for (name, (variant, learning_rate)), depth, seed in itertools.product(
        learning_rates.items(), sorted(experiment.update_size_depths), range(experiment.seeds)
    ):
        file = output / "update_size" / f"{variant.start_folder}-lr{learning_rate:g}-depth{depth}-seed{seed}.json"
        if not file.exists():
            model, admin_profile = runner.build(_at_depth(starts[name], variant, depth), seed)
            device = runner.state.device
            batch = {key: values.to(device) for key, values in runner.first_batch.items()}
            record = {"variant": name, "depth": depth, "seed": seed, "learning_rate": learning_rate}
            record.update(update_size(model.to(device), batch, learning_rate, experiment.weight_decay))
            record.update(admin_profile=admin_profile)
            file.parent.mkdir(exist_ok=True)
            file.write_text(json.dumps(record, indent=1) + "\n")
        measurements.append(json.loads(file.read_text()))
    return {"batch_size": experiment.batch_size, "measurements": measurements, "summary": _summary(measurements)}


def _at_depth(start: Start, variant: Variant, depth: int) -> Start:
    """`start`'s configuration with `depth` layers (Mix-LN's placement and layer types derived again for it)."""
    config = {**start.config, "num_hidden_layers": depth, "layer_types": None}
    if variant.placement == "mix_ln":
        config.update(norm_placement=mix_ln_placement(depth), embedding_norm=None, final_norm=None, final_scale=None)
    return Start(kind="config", config=config)


def _summary(measurements: list[dict]) -> list[dict]:
    """Each (variant, depth)'s figures over seeds."""
    rows = {}
    for record in measurements:
        rows.setdefault((record["variant"], record["depth"], record["learning_rate"]), []).append(record)
    return [
        {
            "variant": variant,
            "depth": depth,
            "learning_rate": learning_rate,
            **{figure: summarize([record[figure] for record in records]) for figure in FIGURES},
        }
        for (variant, depth, learning_rate), records in rows.items()
    ]

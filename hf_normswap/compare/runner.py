"""One fine-tuning run of a comparison: a variant at one seed and one point of settings, trained through the Trainer
(resumed from its last checkpoint when interrupted), or read back when it has finished."""

import dataclasses
import functools
import json
import math
import shutil
import time
from pathlib import Path

import numpy as np
import torch
from accelerate import PartialState
from datasets import Dataset
from transformers import (
    AutoModel,
    DataCollatorForLanguageModeling,
    DataCollatorWithPadding,
    EarlyStoppingCallback,
    Trainer,
    TrainingArguments,
)

from ..convert import load_unswapped
from ..model.packing import DataCollatorWithPacking
from ..probes.collapse import collapse_profile
from ..sharding import (
    RecordShardedOutputs,
    from_main_process,
    is_main_process,
    launch_training_arguments,
    loads_weights,
    prepare_trained,
    process_share,
    sharded,
    take_main_dtypes,
    world_size,
)
from ..tasks import Task, unigram_loss
from .convergence import converged
from .experiment import Experiment, Variant
from .learning_rates import RelativeLearningRateTrainer, learning_rate_scales, weight_sizes
from .metrics import load_metric
from .training_diagnostics import DiagnosticsCallback
from .variants import Start, build_model, profile_admin_start


PROBE_SIZE = 16  # validation examples the diagnostics probe holds


@dataclasses.dataclass
class RunResult:
    """What one run records in its result.json (and results.json)."""

    variant: str
    seed: int
    point: dict  # the settings it trained at: learning_rate, warmup_ratio
    metrics: dict  # the final evaluation, without the `eval_` prefix
    failed: bool  # no better than the majority class (classification) or the unigram loss (causal LM)
    predictions: list[int] | None  # the predicted class of each evaluation example (classification)
    converged: bool | None  # the development loss had stopped falling (`converged`); None: no development split
    seconds: dict  # the run's time: building the model, training (development evaluations in it), the evaluation
    log_history: list[dict]
    diagnostics: list[dict]  # per-layer gradient norms, residual RMS and collapse, at initialisation and later
    model_config: dict
    training_arguments: dict
    resumed: bool
    source_collapse: dict | None  # the pretrained source's collapse on the probe (None for a configuration)
    heal: dict | None  # what the variant's healing did, for a healed variant
    learning_rate_scales: dict | None  # with `relative_learning_rates`, each parameter's (a converted variant's)
    admin_profile: list[float] | None  # Admin's residual weights as profiled (a configuration's Admin layers)


class Runner:
    """Trains one (variant, seed, settings) run through the Trainer, or reads it back when it has finished."""

    def __init__(self, experiment: Experiment, model: str, task: Task, tokenizer, state: PartialState):
        self.experiment, self.model, self.task, self.tokenizer, self.state = experiment, model, task, tokenizer, state
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
                train_ids=self.encoded["train"]["input_ids"],
                validation_ids=self.encoded["validation"]["input_ids"],
                vocab_size=len(tokenizer),
            )
            self.selection_metric = "loss"
        else:
            self.collator = DataCollatorWithPadding(tokenizer)
            self.metric = load_metric(task.metric)
            self.selection_metric = "accuracy"  # what every supported task's metric reports
        self.packing = DataCollatorWithPacking(tokenizer.pad_token_id)
        self.evaluation_labels = None if self.causal else list(self.encoded["validation"]["label"])

    def run(
        self,
        start: Start,
        variant: Variant,
        seed: int,
        point: dict,
        train: Dataset,
        development: Dataset | None,
        evaluation: Dataset,
        run_dir: Path,
    ) -> dict:
        """The run's result: trained now (the main process writes result.json), or read back from result.json. It
        evaluates on `development` during training (when given), and reports its figures on `evaluation`."""
        result_file = run_dir / "result.json"
        if not result_file.exists():
            result = self._train(start, variant, seed, point, train, development, evaluation, run_dir)
            if self.state.is_main_process:
                result_file.write_text(json.dumps(dataclasses.asdict(result), indent=1) + "\n")
                for checkpoint in run_dir.glob("checkpoint-*"):
                    shutil.rmtree(checkpoint)
            self.state.wait_for_everyone()
        return json.loads(result_file.read_text())

    @functools.cached_property
    def first_batch(self) -> dict:
        """The first `batch_size` training examples, collated as a NormSwap variant's training collates them: what
        Admin is profiled on and update sizes are measured on, the same for every seed."""
        train = self.encoded["train"]
        features = [train[i] for i in range(min(self.experiment.batch_size, len(train)))]
        return (self._packed if self.experiment.packing else self.collator)(features)

    @functools.cached_property
    def source_sizes(self) -> dict[str, float]:
        """The size of each weight matrix of the source, unswapped (`weight_sizes`): what `relative_learning_rates`
        measures a converted variant's against."""
        return weight_sizes(load_unswapped(self.model))

    def build(self, start: Start, seed: int) -> tuple[torch.nn.Module, list[float] | None]:
        """A run's model (see `build_model`) with the tokenizer's pad token, and Admin's residual weights as profiled
        on `first_batch` after the seeded initialisation for a configuration with Admin layers (else None)."""
        empty = not loads_weights(self.experiment.sharding, trained=True)  # sharded, the main process alone reads it
        model = build_model(start=start, seed=seed, num_labels=self.task.num_labels, causal=self.causal, empty=empty)
        if sharded(self.experiment.sharding) and start.kind != "config":
            take_main_dtypes(model)
        if model.config.pad_token_id is None:
            model.config.pad_token_id = self.tokenizer.pad_token_id
        return model, profile_admin_start(start, model, self.first_batch)

    def _train(self, start, variant, seed, point, train, development, evaluation, run_dir: Path) -> RunResult:
        began = time.perf_counter()
        model, admin_profile = self.build(start, seed)
        scales = self._learning_rate_scales(start, model)  # before sharding: the main process holds the weights
        prepare_trained(model, self.experiment.sharding)  # sharded across the processes with `fsdp` (on CPU)
        args = self._arguments(point, seed, run_dir, model, evaluates=development is not None)
        probe = self.collator([evaluation[i] for i in range(min(PROBE_SIZE, len(evaluation)))])
        probe = {name: values.tolist() for name, values in probe.items()}
        source_collapse = self._source_collapse(start, probe)
        trainer_class = Trainer
        if scales is not None:
            trainer_class = functools.partial(RelativeLearningRateTrainer, learning_rate_scales=scales)
        trainer = trainer_class(
            model=model,
            args=args,
            train_dataset=train,
            eval_dataset=development,
            data_collator=self._packed if self.experiment.packing and start.kind != "native" else self.collator,
            compute_metrics=None if self.causal else self._compute_metrics,
            callbacks=self._callbacks(
                probe, model.config.num_hidden_layers, early_stopping=args.load_best_model_at_end
            ),
        )
        resume = any(run_dir.glob("checkpoint-*"))
        built = time.perf_counter()
        trainer.train(resume_from_checkpoint=True if resume else None)
        trained = time.perf_counter()
        final = trainer.predict(evaluation, metric_key_prefix="eval")
        metrics, failed = self._final_metrics(final.metrics)
        development_losses = [entry["eval_loss"] for entry in trainer.state.log_history if "eval_loss" in entry]
        diagnostics = next(cb for cb in trainer.callback_handler.callbacks if isinstance(cb, DiagnosticsCallback))
        return RunResult(
            variant=variant.spec,
            seed=seed,
            point=point,
            metrics=metrics,
            failed=failed,
            predictions=None if self.causal else np.argmax(final.predictions, axis=-1).tolist(),
            converged=converged(development_losses) if development is not None else None,
            seconds={
                "build": built - began,
                "train": trained - built,
                "development": sum(e["eval_runtime"] for e in trainer.state.log_history if "eval_runtime" in e),
                "evaluation": time.perf_counter() - trained,
            },
            log_history=trainer.state.log_history,
            diagnostics=diagnostics.records,
            model_config=model.config.to_dict(),
            training_arguments=json.loads(args.to_json_string()),
            resumed=resume,
            source_collapse=source_collapse,
            heal=start.heal,
            admin_profile=admin_profile,
            learning_rate_scales=scales,
        )

    def _callbacks(self, probe: dict, num_layers: int, early_stopping: bool) -> list:
        """The run's callbacks: sharded outputs recorded first (the diagnostics read hidden states), the diagnostics,
        and early stopping on the development loss when asked for."""
        callbacks = [RecordShardedOutputs(), DiagnosticsCallback(probe=probe, num_layers=num_layers)]
        if early_stopping:
            callbacks.append(EarlyStoppingCallback(self.experiment.early_stopping_patience))
        return callbacks

    def _learning_rate_scales(self, start: Start, model: torch.nn.Module) -> dict[str, float] | None:
        """With `relative_learning_rates`, a converted variant's `learning_rate_scales` against the source, measured by
        the main process (sharded, the others may not hold the weights yet) and handed to every process."""
        if not (self.experiment.relative_learning_rates and start.kind == "converted"):
            return None
        names = [name for name, weight in model.named_parameters() if weight.requires_grad]
        measured = None
        if is_main_process():
            scales = learning_rate_scales(model, self.source_sizes)
            measured = torch.tensor([scales[name] for name in names], dtype=torch.float64)
        if world_size() > 1:
            measured = from_main_process(measured, (len(names),), torch.float64)
        return dict(zip(names, measured.tolist()))

    def _arguments(
        self, point: dict, seed: int, run_dir: Path, model: torch.nn.Module, evaluates: bool
    ) -> TrainingArguments:
        """The run's training arguments, with the experiment's sharding and mixed precision, each process on one
        device (`launch_training_arguments`): evaluating on the development split every epoch when it `evaluates`,
        and with early stopping, ending at the epoch of the best development loss."""
        experiment = self.experiment
        early_stopping = evaluates and experiment.early_stopping_patience is not None
        share = process_share(experiment.batch_size)  # of a step's examples, each process's
        arguments = dict(
            output_dir=str(run_dir),
            run_name=run_dir.name if run_dir.parent.name == "runs" else f"search-{run_dir.name}",
            learning_rate=point["learning_rate"],
            per_device_train_batch_size=share,
            per_device_eval_batch_size=share,
            num_train_epochs=experiment.epochs,
            max_steps=experiment.max_steps,
            warmup_steps=point["warmup_ratio"],
            weight_decay=experiment.weight_decay,
            eval_strategy="epoch" if evaluates else "no",
            save_strategy="epoch",
            load_best_model_at_end=early_stopping,
            metric_for_best_model="loss" if early_stopping else None,
            prediction_loss_only=self.causal,  # a causal LM's logits are not kept
            logging_steps=experiment.logging_steps,
            seed=seed,
            data_seed=seed,
            report_to=experiment.report_to,
            restore_callback_states_from_checkpoint=True,
            use_cpu=not torch.accelerator.is_available(),
        )
        return launch_training_arguments(experiment.sharding, model, **arguments)

    def _final_metrics(self, evaluation: dict) -> tuple[dict, bool]:
        """The final evaluation's figures, and whether the run failed."""
        metrics = {key.removeprefix("eval_"): value for key, value in evaluation.items() if key.startswith("eval_")}
        if self.causal:
            metrics["perplexity"] = math.exp(min(metrics["loss"], 700.0))  # nan stays nan
            return metrics, not metrics["loss"] < self.task.unigram_loss
        return metrics, metrics["accuracy"] <= self.task.majority_baseline

    def _source_collapse(self, start: Start, probe: dict) -> dict | None:
        """The collapse figures of the pretrained source on the diagnostics probe (None for a configuration), measured
        once per probe, by the main process alone (it writes the results; None elsewhere)."""
        key = (start.kind == "config", json.dumps(probe))
        if key not in self.source_collapses:
            self.source_collapses[key] = None
            if start.kind != "config" and self.state.is_main_process:
                pretrained = AutoModel.from_pretrained(self.model, dtype=torch.float32)
                batch = {name: torch.tensor(values) for name, values in probe.items()}
                self.source_collapses[key] = collapse_profile(model=pretrained, batches=[batch])
        return self.source_collapses[key]

    def _packed(self, features: list[dict]) -> dict:
        """The padding-free batch of `features`; for causal LM with the labels the padding collator gives them."""
        if self.causal:
            pad = self.tokenizer.pad_token_id
            features = [{**f, "labels": [-100 if t == pad else t for t in f["input_ids"]]} for f in features]
        return self.packing(features)

    def _compute_metrics(self, prediction) -> dict:
        return self.metric.compute(
            predictions=np.argmax(prediction.predictions, axis=-1), references=prediction.label_ids
        )

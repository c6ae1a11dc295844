"""Healing: train a swapped variant (the student) to compute what its unswapped source (the teacher) computes.

The student learns from the teacher's hidden states on unlabeled text, through the Trainer (a `compute_loss`
override), at every layer boundary (the objectives: `losses`; the two models: `models`). A healing reads as its
steps: data -> trainer -> measure -> save. The defaults were measured on all-MiniLM-L6-v2 (post -> pre) for encoders,
on SmolLM2-135M and three small LLaMAs (pre -> post) for causal LMs: docs/experiments/healing.md.
"""

import contextlib
import functools
import itertools
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Sized
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from transformers import AutoTokenizer

from ..checkpoint import check_output, copy_companion_files, output_folder
from ..convert.branch_calibration import removes_norms
from ..convert.converter import ConversionRecord
from ..model import copy_remote_code
from ..model.heads import head_of_config
from ..probes.collapse import collapse_of_states
from ..probes.next_token import (
    agreement,
    final_state_log_probs,
    greedy_agreement,
    greedy_continuation,
    greedy_prompts,
    next_token_log_probs,
)
from ..probes.stream_mix import LayerGates, kl_by_layer
from ..sharding import (
    gathered,
    is_main_process,
    prepare_frozen,
    prepare_trained,
    processes,
    sharded,
    unsharded,
    with_sharding_section,
    world_size,
)
from .checkpoints import CheckpointedHealing, checkpoint_folder, kept_checkpoints
from .data import HealTexts, TeacherSamples, heal_texts, read_texts, sampled_ahead
from .gradual_swap import GradualSwap, conversion_layer_gates
from .measure import masked_lm_loss, measure_states, student_states, teacher_states
from .models import HealModels, for_student, layer_parameters, load_models, memory_settings
from .norm_removal import NormRemoval
from .options import COUNTED_TEXTS, HealOptions
from .reconstruction import reconstruct_layers, reconstruction_batches
from .report import (
    HEAL_PLOT,
    Budget,
    HealData,
    HealReport,
    MaskedLMLoss,
    NextTokenAgreement,
    Reconstruction,
    TeacherSampling,
    plot_history,
)
from .trainer import (
    CheckpointedFigures,
    DevelopmentStop,
    DevelopmentTexts,
    HealProbeCallback,
    HealTrainer,
    TimeBudget,
    training_arguments,
)


def heal_checkpoint(variant: str, output: str, *, overwrite: bool = False, log=print, **options) -> dict:
    """Heals the NormSwap checkpoint VARIANT into OUTPUT (same format, plus heal.json and heal.png); returns heal.json.

    `options` are the fields of `HealOptions`, its sharding section's named flat (`fsdp=True`). With
    `checkpoint_dir`, the Trainer keeps resumable checkpoints there and a rerun continues from the last one. With
    `packing`, student and teacher run on padding-free batches. With `dropout`, the student trains with the dropout of
    its configuration, else with none (saved unchanged). With `freeze_embeddings`, the student's embeddings (and a
    masked-LM decoder tied to them) are not trained. With `fsdp` under a distributed launch, student and teacher are
    sharded across the processes (`sharding`); the main process writes.
    """
    options = HealOptions(**with_sharding_section(options))
    check_output(output, overwrite)
    healing = CheckpointedHealing.of(variant, options)  # whose checkpoints checkpoint_dir may hold
    options, pair = for_student(variant, options)
    checkpoints, resumes = checkpoint_folder(options, output, healing)
    read = read_texts(options)
    models = load_models(pair, options)
    gates = conversion_layer_gates(pair.conversion, models.student.config)
    if options.swap_schedule == "direct" and removes_norms(models.student.config):
        models.student.config.first_position_scales = None  # every norm at once, the first position's divisors too
    tokenizer = AutoTokenizer.from_pretrained(variant)
    texts = heal_texts(read, options=options, tokenizer=tokenizer, teacher=models.teacher)
    if head_of_config(models.student.config) == "causal-lm":
        width, parameters = models.student.config.hidden_size, layer_parameters(models.student)
        options = options.scaled(width, parameters, tokens_per_text=_tokens_per_text(texts, options))
    elif options.max_steps is None:  # given in tokens
        options = options.budgeted(_tokens_per_text(texts, options))
    if isinstance(texts.train, TeacherSamples):
        train = texts.train.planned(options)
        if sharded(options.sharding):  # sampled before the teacher is sharded
            train = sampled_ahead(train, options.max_steps * options.batch_size, options)
        texts = replace(texts, train=train)
    main = is_main_process()
    fit = None
    if options.reconstruct_steps:  # the fit's texts checked by every process; the main one fits, before sharding
        batches = reconstruction_batches(texts.train, tokenizer, options)
        fit = _fit_layers(models, texts, tokenizer, batches, options, gates) if main else None
    prepare_trained(models.student, options.sharding)
    prepare_frozen(models.teacher, options.sharding)
    log = log if main else None
    with (
        kept_checkpoints(checkpoints, healing, main, resumes),
        output_folder(output, overwrite) if main else _scratch_folder() as staging,
    ):
        work = checkpoints or staging / "trainer"
        report = _heal(models, texts, tokenizer, options, work, resumes, quiet=log is None, gates=gates, fit=fit)
        _save(models, source=Path(variant), conversion=pair.conversion, staging=staging, report=report, main=main)
        shutil.rmtree(staging / "trainer", ignore_errors=True)
    processes().wait_for_everyone()  # under a distributed launch, until the main process has written OUTPUT
    if log:
        log(report.summary())
        log(f"wrote {output}")
    return asdict(report)


def _tokens_per_text(texts: HealTexts, options: HealOptions) -> float:
    """A training text's tokens: sampled texts' length, else the mean of the first `COUNTED_TEXTS` texts'."""
    if options.data == "teacher":
        return options.sample_length
    rows = [len(row["input_ids"]) for row in itertools.islice(iter(texts.train), COUNTED_TEXTS)]
    return sum(rows) / max(1, len(rows))


@dataclass
class _FittedLayers:
    """The block-wise fit before sharding, on the main process: its record, and the held-out teacher states and head
    probe it measured the conversion with (`_held_out_probe`)."""

    reconstruction: Reconstruction
    teacher: list[tuple]
    head_figures: Callable[..., dict]


def _gradual_swap(
    student, gates: LayerGates | None, options: HealOptions, development: DevelopmentTexts | None
) -> GradualSwap | NormRemoval | None:
    """The callback that moves the student from its source's function to its own, if `swap_schedule` asks for one
    (a norm-free student's measured on the `development` texts as each group of norms goes)."""
    if options.swap_schedule == "direct":
        return None
    if not removes_norms(student.config):
        return GradualSwap(student, gates, options.swap_schedule, options.max_steps)
    rms = student.config.removed_norm_rms
    return NormRemoval(student, rms, options.swap_schedule, options.max_steps, development=development)


def _heal(
    models: HealModels,
    texts: HealTexts,
    tokenizer,
    options: HealOptions,
    work: Path,
    resumes: bool,
    quiet: bool,
    gates: LayerGates | None,
    fit: _FittedLayers | None,
) -> HealReport:
    """Trains the student, measured on the held-out batches as training begins, every fifth of the way unless the stop
    measures the development texts from the start, and after (by every process, when sharded). The layers were fitted
    before (`fit`, on the main process) with `reconstruct_steps`: the probe then measures the fitted student whole
    (each layer alone swapped: of the conversion only)."""
    teacher, head_figures = _training_probe(models, texts, tokenizer, options, gates, fit)
    development = DevelopmentTexts(texts.development, models.teacher, models.student) if texts.development else None
    swap = _gradual_swap(models.student, gates, options, development)
    stop = DevelopmentStop.planned(development, options, from_step=swap.settled_step if swap else 0)
    probe = HealProbeCallback.planned(texts.held_out, teacher, models.teacher, head_figures, options, stop)
    # the schedule first (what measures after a step sees the next step's student), the probe after what ends training
    callbacks = [c for c in (swap, stop, TimeBudget(options.max_seconds) if options.max_seconds else None, probe) if c]
    log_history, seconds, tokens, steps = _train(models, texts, options, callbacks, work, resumes, quiet)
    if swap:
        swap.remove()  # the saved student is the target placement
    with gathered(models.student, models.teacher):
        states = student_states(models.student, texts.held_out)
        after = measure_states(states, texts.held_out, teacher)
        head_after = head_figures(models.student, states=states)
        masked_lm, next_token = _head_results(models, texts.held_out, tokenizer, probe.head_before, head_after)
    probe.history.append({"step": steps, **after[-1]})
    return HealReport(
        teacher=models.teacher_id,
        data=_heal_data(texts, options),
        objective=options.objective,
        steps=steps,
        learning_rate=options.learning_rate,
        batch_size=options.batch_size,
        max_length=options.max_length,
        packing=options.packing,
        dropout=options.dropout,
        freeze_embeddings=options.freeze_embeddings,
        swap_schedule=options.swap_schedule,
        seconds=seconds,
        measuring_seconds=sum(c.measuring_seconds for c in callbacks if isinstance(c, CheckpointedFigures)),
        tokens=tokens,
        resumed=resumes,
        teacher_collapse=collapse_of_states(teacher, [batch["attention_mask"] for batch in texts.held_out]),
        masked_lm_loss=masked_lm,
        next_token=next_token,
        sampled_next_token=development.next_token(models.student) if development else None,
        before=probe.before,
        after=after,
        history=probe.history,
        log_history=log_history,
        reconstruction=fit.reconstruction if fit else None,
        budget=_budget(texts, options, stop),
        norm_removal=swap.stages if isinstance(swap, NormRemoval) else None,
        **memory_settings(options),
    )


def _training_probe(
    models: HealModels,
    texts: HealTexts,
    tokenizer,
    options: HealOptions,
    gates: LayerGates | None,
    fit: _FittedLayers | None,
) -> tuple[list[tuple], Callable[..., dict]]:
    """`_held_out_probe` as training measures with it: the fit's, where this process measured it (unsharded), and
    after fitted layers the student measured whole."""
    if fit is not None and not sharded(options.sharding):
        teacher, head_figures = fit.teacher, fit.head_figures
    else:
        teacher, head_figures = _held_out_probe(models, texts, tokenizer, gates)
    if options.reconstruct_steps:
        head_figures = functools.partial(head_figures, gates=None)
    return teacher, head_figures


def _budget(texts: HealTexts, options: HealOptions, stop: DevelopmentStop | None) -> Budget:
    """heal.json's record of how long the healing was to train, and where the development texts stopped it."""
    return Budget(
        steps=options.max_steps,
        tokens=options.max_tokens,
        seconds=options.max_seconds,
        development_texts=sum(len(batch["input_ids"]) for batch in texts.development or []),
        patience=options.stop_patience if stop else None,
        development_kl=stop.history if stop else None,
        stopped_at=stop.stopped_at if stop else None,
    )


def _heal_data(texts: HealTexts, options: HealOptions) -> HealData:
    """heal.json's record of the text healed on, with how it was sampled where the teacher sampled it."""
    sampling = None
    if options.data == "teacher":
        sampling = TeacherSampling(
            temperature=options.sample_temperature,
            length=options.sample_length,
            count=options.sample_count,
            reads=options.sample_reads,
        )
    return HealData(
        name=options.data,
        text_columns=texts.columns,
        train_rows=len(texts.train) if isinstance(texts.train, Sized) else None,
        held_out_rows=texts.held_out_rows,
        sampling=sampling,
    )


def _fit_layers(
    models: HealModels,
    texts: HealTexts,
    tokenizer,
    batches: list[dict],
    options: HealOptions,
    gates: LayerGates | None,
) -> _FittedLayers:
    """The student's layers fitted one after another on `batches` (`reconstruct_layers`), before sharding (the main
    process holds both models whole), so that one process and a sharded launch fit alike; its figures through its
    head measured before."""
    teacher, head_figures = _held_out_probe(models, texts, tokenizer, gates)
    conversion = head_figures(models.student, before=True)["next_token"]
    started = time.perf_counter()
    errors = reconstruct_layers(
        models.student, models.teacher, batches, options.reconstruct_steps, options.reconstruct_learning_rate
    )
    reconstruction = Reconstruction(
        sequences=options.reconstruct_sequences,
        steps=options.reconstruct_steps,
        learning_rate=options.reconstruct_learning_rate,
        seconds=time.perf_counter() - started,
        layer_errors=errors,
        conversion=conversion,
    )
    return _FittedLayers(reconstruction, teacher, head_figures)


def _held_out_probe(
    models: HealModels, texts: HealTexts, tokenizer, gates: LayerGates | None
) -> tuple[list[tuple], Callable[..., dict]]:
    """The teacher's states on the held-out batches (every process joining, when sharded) and `_head_probe` on them,
    each layer alone swapped through the student's `gates` where the teacher is the source."""
    with gathered(models.teacher):
        teacher = teacher_states(models.teacher, texts.held_out)
    separable = gates is not None and models.teacher_is_source  # each layer alone: the rest compute the teacher
    return teacher, _head_probe(models, texts, tokenizer, teacher, gates=gates if separable else None)


def _head_results(
    models: HealModels, batches: list[dict], tokenizer, before: dict, after: dict
) -> tuple[MaskedLMLoss | None, NextTokenAgreement | None]:
    """heal.json's figures through the language-model head, from `_head_figures` before and after (and the teacher's
    masked-LM loss)."""
    masked_lm = next_token = None
    if models.masked_lm:
        teacher = masked_lm_loss(models.teacher, batches, tokenizer)
        masked_lm = MaskedLMLoss(teacher=teacher, before=before["masked_lm"], after=after["masked_lm"])
    if before["next_token"]:
        next_token = NextTokenAgreement(before=before["next_token"], after=after["next_token"])
    return masked_lm, next_token


def _head_probe(
    models: HealModels, texts: HealTexts, tokenizer, teacher_states: list[tuple], gates: LayerGates | None
) -> Callable[..., dict]:
    """`_head_figures` on the held-out batches; the frozen teacher's greedy continuation is generated once, here."""
    greedy = None
    if head_of_config(models.student.config) == "causal-lm":
        prompts = greedy_prompts(texts.held_out, tokenizer)
        greedy = prompts, greedy_continuation(models.teacher, prompts)
    return functools.partial(
        _head_figures,
        models=models,
        batches=texts.held_out,
        teacher_states=teacher_states,
        tokenizer=tokenizer,
        greedy=greedy,
        gates=gates,
    )


def _head_figures(
    student,
    *,
    models: HealModels,
    batches: list[dict],
    teacher_states: list[tuple],
    tokenizer,
    greedy: tuple[dict, torch.Tensor] | None,
    gates: LayerGates | None,
    before: bool = False,
    states: list[tuple] | None = None,
) -> dict:
    """The student's figures through its language-model head on the held-out `batches`: its masked-LM loss (with a
    masked-LM head), or its next-token KL and top-1 agreement to the teacher and its greedy agreement with the
    teacher's continuation of the prompts (`greedy`: prompts, the teacher's tokens; with a causal-LM head). The
    next-token distributions come from the teacher's boundary states and the student's `states` where given (both
    through their heads alone), else from the student's forward. `before` healing, with the student's `gates`,
    also the KL with each layer alone swapped (`stream_mix.kl_by_layer`), on the first `batch_size` held-out texts."""
    figures = {"masked_lm": None, "next_token": None}
    if models.masked_lm:
        figures["masked_lm"] = masked_lm_loss(student, batches, tokenizer)
    if greedy is not None:
        prompts, expected = greedy
        teacher = final_state_log_probs(models.teacher, [final for *_, final in teacher_states], batches)
        given = (
            next_token_log_probs(student, batches)
            if states is None
            else final_state_log_probs(student, [final for *_, final in states], batches)
        )
        figures["next_token"] = agreement(teacher, given, batches) | {
            "greedy_agreement": greedy_agreement(expected, student, prompts)
        }
        if before and gates is not None:  # two forwards a layer: on a step's texts only, each process's share
            figures["next_token"]["kl_by_layer"] = kl_by_layer(models.teacher, student, gates, batches[: world_size()])
    return figures


def _train(
    models: HealModels, texts: HealTexts, options: HealOptions, callbacks: list, work: Path, resumes: bool, quiet: bool
) -> tuple[list[dict], float, int, int]:
    """Trains the student towards the teacher, resuming from the last checkpoint in `work` if it `resumes`; returns
    the Trainer's log, the seconds this run trained (its measurements included), the real tokens it trained on
    (before an interruption too) and the steps it took."""
    trainer = HealTrainer(
        model=models.student,
        args=training_arguments(options=options, output_dir=work, quiet=quiet, student=models.student),
        train_dataset=texts.train,
        data_collator=texts.collator,
        teacher=models.teacher,
        objective=options.objective,
        packing=options.packing,
        callbacks=callbacks,
    )
    started = time.perf_counter()
    trainer.train(resume_from_checkpoint=True if resumes else None)
    seconds, state = time.perf_counter() - started, trainer.state
    return state.log_history, seconds, state.num_input_tokens_seen, state.global_step


@contextlib.contextmanager
def _scratch_folder() -> Iterator[Path]:
    """A temporary folder for a process that does not write (not the main one), removed after."""
    with tempfile.TemporaryDirectory() as folder:
        yield Path(folder)


def _save(
    models: HealModels,
    source: Path,
    conversion: ConversionRecord | None,
    staging: Path,
    report: HealReport,
    main: bool,
) -> None:
    """The healed student (its adapters merged in, gathered whole from its shards) with its configured dropout
    (without the weights the variant initialises at load), its code, tokenizer and sentence-transformers modules,
    its `conversion` record (lineage included) with the healing added, heal.json and heal.png; by the main process."""
    at_load = set(conversion.weights.initialized_at_load) if conversion else set()
    student = unsharded(models.healed_student())  # every process joins the gather
    if not main:
        return
    student.config.update(models.configured_dropout)
    state = {name: tensor for name, tensor in student.state_dict().items() if name not in at_load}
    student.save_pretrained(staging, state_dict=state)
    copy_remote_code(staging)
    copy_companion_files(source, staging)
    if conversion:
        conversion.heal = asdict(report.lineage())
        conversion.write(staging)
    report.write(staging)
    plot_history(report, staging / HEAL_PLOT)

"""Healing: train a swapped variant (the student) to compute what its unswapped source (the teacher) computes.

The student learns from the teacher's hidden states on unlabeled text, through the Trainer (a `compute_loss`
override), at every layer boundary (the objectives: `losses`; the two models: `models`). A healing reads as its
steps: data -> trainer -> measure -> save. Which objective, learning rate, dropout and freezing are the defaults was
measured on all-MiniLM-L6-v2 (post -> pre): docs/experiments/healing.md.
"""

import json
import shutil
import time
from dataclasses import asdict
from pathlib import Path

from transformers import AutoTokenizer

from ..checkpoint import check_output, copy_companion_files, output_folder
from ..model import copy_remote_code
from ..probes.collapse import collapse_of_states
from .data import HealTexts, heal_texts
from .measure import masked_lm_loss, measure, teacher_states
from .models import HealModels, load_models
from .options import HealOptions
from .report import HealData, HealReport, MaskedLMLoss, plot_history
from .trainer import HealProbeCallback, HealTrainer, training_arguments


def heal_checkpoint(variant: str, output: str, *, overwrite: bool = False, log=print, **options) -> dict:
    """Heals the NormSwap checkpoint VARIANT into OUTPUT (same format, plus heal.json and heal.png); returns heal.json.

    `options` are the fields of `HealOptions`. With `checkpoint_dir`, the Trainer keeps resumable checkpoints there
    and a rerun continues from the last one. With `packing`, student and teacher run on padding-free batches. With
    `dropout`, the student trains with the dropout of its configuration, else with none (saved unchanged). With
    `freeze_embeddings`, the student's embeddings (and a masked-LM decoder tied to them) are not trained.
    """
    options = HealOptions(**options)
    check_output(output, overwrite)
    models = load_models(variant, options)
    tokenizer = AutoTokenizer.from_pretrained(variant)
    texts = heal_texts(options=options, tokenizer=tokenizer)
    with output_folder(output, overwrite) as staging:
        work = Path(options.checkpoint_dir) if options.checkpoint_dir else staging / "trainer"
        report = _heal(models, texts=texts, tokenizer=tokenizer, options=options, work=work, quiet=log is None)
        _save(models, source=Path(variant), staging=staging, report=report)
        shutil.rmtree(staging / "trainer", ignore_errors=True)
    if options.checkpoint_dir:
        shutil.rmtree(options.checkpoint_dir, ignore_errors=True)
    if log:
        log(report.summary())
        log(f"wrote {output}")
    return asdict(report)


def _heal(
    models: HealModels, texts: HealTexts, tokenizer, options: HealOptions, work: Path, quiet: bool
) -> HealReport:
    """Trains the student, measured on the held-out batches before, every fifth of the way and after."""
    teacher = teacher_states(models.teacher, texts.held_out)
    before = measure(models.student, texts.held_out, teacher)
    masked_lm_before = masked_lm_loss(models.student, texts.held_out, tokenizer) if models.masked_lm else None
    probe = HealProbeCallback(texts.held_out, teacher, every=max(1, options.max_steps // 5))
    probe.history.append({"step": 0, **before[-1]})
    log_history, seconds, resumed = _train(models, texts=texts, options=options, probe=probe, work=work, quiet=quiet)
    after = measure(models.student, texts.held_out, teacher)
    probe.history.append({"step": options.max_steps, **after[-1]})
    masked_lm = None
    if models.masked_lm:
        masked_lm = MaskedLMLoss(
            teacher=masked_lm_loss(models.teacher, texts.held_out, tokenizer),
            before=masked_lm_before,
            after=masked_lm_loss(models.student, texts.held_out, tokenizer),
        )
    data = HealData(
        name=options.data,
        text_columns=texts.columns,
        train_rows=len(texts.train),
        held_out_rows=texts.held_out_rows,
    )
    return HealReport(
        teacher=models.teacher_id,
        data=data,
        objective=options.objective,
        steps=options.max_steps,
        learning_rate=options.learning_rate,
        batch_size=options.batch_size,
        max_length=options.max_length,
        packing=options.packing,
        dropout=options.dropout,
        freeze_embeddings=options.freeze_embeddings,
        seconds=seconds,
        resumed=resumed,
        teacher_collapse=collapse_of_states(teacher, [batch["attention_mask"] for batch in texts.held_out]),
        masked_lm_loss=masked_lm,
        before=before,
        after=after,
        history=probe.history,
        log_history=log_history,
    )


def _train(
    models: HealModels, texts: HealTexts, options: HealOptions, probe: HealProbeCallback, work: Path, quiet: bool
) -> tuple[list[dict], float, bool]:
    """Trains the student towards the teacher, resuming from a checkpoint in `checkpoint_dir` if there is one;
    returns the Trainer's log, the seconds it trained and whether it resumed."""
    trainer = HealTrainer(
        model=models.student,
        args=training_arguments(options=options, output_dir=work, quiet=quiet),
        train_dataset=texts.train,
        data_collator=texts.collator,
        teacher=models.teacher,
        objective=options.objective,
        packing=options.packing,
        callbacks=[probe],
    )
    resumed = options.checkpoint_dir is not None and any(work.glob("checkpoint-*"))
    started = time.perf_counter()
    trainer.train(resume_from_checkpoint=True if resumed else None)
    return trainer.state.log_history, time.perf_counter() - started, resumed


def _save(models: HealModels, source: Path, staging: Path, report: HealReport) -> None:
    """The healed student with its configured dropout (without the weights the variant initialises at load), its
    code, tokenizer and sentence-transformers modules, conversion.json (lineage included) with the healing added,
    heal.json and heal.png."""
    record = source / "conversion.json"
    conversion = json.loads(record.read_text()) if record.exists() else None
    at_load = set(conversion["weights"]["initialized_at_load"]) if conversion else set()
    models.student.config.update(models.configured_dropout)
    state = {name: tensor for name, tensor in models.student.state_dict().items() if name not in at_load}
    models.student.save_pretrained(staging, state_dict=state)
    copy_remote_code(staging)
    copy_companion_files(source, staging)
    if conversion:
        conversion["heal"] = report.lineage()
        (staging / "conversion.json").write_text(json.dumps(conversion, indent=2) + "\n")
    (staging / "heal.json").write_text(json.dumps(asdict(report), indent=1) + "\n")
    plot_history(report, staging / "heal.png")

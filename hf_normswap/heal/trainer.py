"""The Trainer that heals: its loss is the distance of the student's boundary states to the teacher's, on the same
batch (padding-free with `packing`); a callback measures the student on held-out text as it begins and along the way.

Under data parallelism (or FSDP2: `sharding`) each process's loss is its mean over its own tokens weighted by its
share of the global batch's tokens, so that the processes' averaged gradient is that of one process taking the whole
batch (exactly so for `hidden` and `kl`; the batch-level terms of `similarity`, `cka` and `mlm` stay per process).
"""

import contextlib
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.modeling_outputs import CausalLMOutputWithPast

from ..model.packing import pack_padded, unpack
from ..probes.next_token import agreement, next_token_log_probs
from ..sharding import (
    RecordShardedOutputs,
    agreed_max,
    gathered,
    launch_training_arguments,
    process_share,
    token_share,
)
from .data import TEACHER_STATES
from .losses import heal_loss, masked_lm_distillation, next_token_kl, teacher_logits_from_forward
from .measure import measure, measure_states, student_states
from .options import HealError, HealOptions
from .report import NextTokenAgreement


class HealTrainer(Trainer):
    """A Trainer whose loss is the distance of the model's boundary states to the teacher's (both run on the same
    batch, padding-free with `packing`; on text sampled from the teacher, its states come with the text)."""

    def __init__(self, *args, teacher: torch.nn.Module, objective: str, packing: bool = False, **kwargs):
        # the outputs recorded first, since other callbacks may record; a diverged step stops before it is taken
        callbacks = [RecordShardedOutputs(), FiniteGradients(), *(kwargs.pop("callbacks", None) or [])]
        super().__init__(*args, callbacks=callbacks, **kwargs)
        if not isinstance(teacher, FSDPModule):  # a sharded teacher is placed already
            teacher = teacher.to(self.args.device)
        self.teacher = teacher.eval()  # not the student's submodule: the Trainer never trains it
        self.objective = objective
        self.packing = packing

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs.pop("labels", None)
        sampled = inputs.pop(TEACHER_STATES, None)  # the teacher's states on sampled text, from its sampling
        padded = not bool(inputs["attention_mask"].all())  # a batch without padding is padding-free as it is
        packed, index = pack_padded(inputs) if self.packing and padded else (inputs, None)
        packed = {key: value.to(self.args.device) for key, value in packed.items()}
        mask = inputs["attention_mask"].to(self.args.device)
        # a causal LM's next-token logits are computed from its final states, a chunk at a time (`next_token_kl`);
        # the teacher's come from its forward, if it runs, where they take less memory (`teacher_logits_from_forward`)
        kl = self.objective == "kl"
        teacher_logits = (
            kl and sampled is None and teacher_logits_from_forward(mask.numel(), self.teacher, self.args.device)
        )
        keep = {"logits_to_keep": 1} if kl else {}
        teacher_keep = {} if teacher_logits else keep
        if sampled is not None:
            teacher = CausalLMOutputWithPast(hidden_states=sampled.to(self.args.device).unbind(1))
        else:
            with torch.no_grad():
                teacher = _outputs(self.teacher, packed, index, labels is not None or teacher_logits, **teacher_keep)
        student = _outputs(model, packed, index, token_logits=labels is not None, **keep)
        tokens = token_share(mask.sum(), self.args.device)
        objective = "hidden" if kl else self.objective
        loss = heal_loss(objective, student.hidden_states, teacher.hidden_states, mask) * tokens
        if labels is not None:  # masked-LM distillation on the masked tokens
            masked = token_share((labels != -100).sum(), self.args.device)
            loss = loss + masked_lm_distillation(student.logits, teacher.logits, labels=labels) * masked
        if kl:
            real = mask.bool()
            final, teacher_final = student.hidden_states[-1][real], teacher.hidden_states[-1][real]
            targets = F.log_softmax(teacher.logits[real].float(), -1) if teacher_logits else None
            teacher.logits = None
            head = self.accelerator.unwrap_model(model)  # a DDP wrapper hides the head
            loss = loss + next_token_kl(head, self.teacher, final, teacher_final, targets) * tokens
        return (loss, student) if return_outputs else loss


def _outputs(model: torch.nn.Module, batch: dict, index: torch.Tensor | None, token_logits: bool, **kwargs):
    """The model's outputs on `batch`; for a packed batch (`index` from `pack_padded`), its hidden states (and
    per-token logits) laid back out as the padded batch."""
    outputs = model(**batch, output_hidden_states=True, **kwargs)
    if index is not None:
        outputs.hidden_states = tuple(unpack(states, index) for states in outputs.hidden_states)
        if token_logits:
            outputs.logits = unpack(outputs.logits, index)
    return outputs


def training_arguments(
    *, options: HealOptions, output_dir: Path, quiet: bool, student: torch.nn.Module
) -> TrainingArguments:
    """The Trainer's arguments: 10% warm-up then linear decay, seeded, the real tokens trained on counted; resumable
    checkpoints only in the options' `checkpoint_dir`; the student's sharding and mixed precision
    (`launch_training_arguments`)."""
    arguments = dict(
        output_dir=str(output_dir),
        max_steps=options.max_steps,
        learning_rate=options.learning_rate,
        per_device_train_batch_size=process_share(options.batch_size),
        warmup_steps=0.1,
        lr_scheduler_type="linear",
        logging_steps=max(1, options.max_steps // 20),
        save_strategy="steps" if options.checkpoint_dir else "no",
        save_steps=max(1, options.max_steps // 5),
        save_total_limit=1,
        seed=0,
        data_seed=0,
        report_to=[],
        remove_unused_columns=False,
        include_num_input_tokens_seen="non_padding",
        disable_tqdm=quiet,
        use_cpu=not torch.accelerator.is_available(),
    )
    return launch_training_arguments(options.sharding, student, **arguments)


class CheckpointedFigures(TrainerCallback):
    """A callback whose figures go beside the Trainer's checkpoints (`FILE`, with the checkpoint's step) whenever it
    saves one, and are read back when training resumes from that checkpoint; `measuring_seconds`: the time it spent
    measuring the student (`measuring`) in this run."""

    FILE: str
    measuring_seconds = 0.0

    @contextlib.contextmanager
    def measuring(self) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.measuring_seconds += time.perf_counter() - started

    def figures(self) -> dict:
        raise NotImplementedError

    def restore(self, figures: dict) -> None:
        raise NotImplementedError

    def resumed(self, args, state) -> bool:
        """Whether training resumes from a checkpoint; if so, with this callback's figures read back."""
        if state.global_step == 0:
            return False
        file = Path(args.output_dir) / self.FILE
        figures = json.loads(file.read_text()) if file.exists() else {}
        if figures.get("step") != state.global_step:  # the run ended as the Trainer saved, or an older one wrote them
            raise HealError(
                f"{file.parent}: resuming at step {state.global_step}, but the figures measured until then "
                f"({self.FILE}) are missing or of another step; remove the folder to heal from the start"
            )
        self.restore(figures)
        return True

    def on_train_begin(self, args, state, control, **kwargs):
        self.resumed(args, state)

    def on_save(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            written = Path(args.output_dir) / f".{self.FILE}"
            written.write_text(json.dumps({"step": state.global_step, **self.figures()}))
            written.replace(Path(args.output_dir) / self.FILE)  # whole or not at all


class HealProbeCallback(CheckpointedFigures):
    """Measures the student on the held-out batches as the Trainer trains it (sharded, on its device): when training
    begins (`before`, and from the same states `head_figures(student, before=True, states=...)`: `head_before`),
    then, with `every`, every `every` steps but the one that ends training, for the plot; its figures kept beside the
    checkpoints."""

    FILE = "heal_probe.json"

    def __init__(
        self,
        batches: list[dict],
        teacher_states: list[tuple],
        teacher: torch.nn.Module,
        every: int | None,
        head_figures: Callable[..., dict],
    ):
        self.batches, self.teacher_states, self.teacher, self.every = batches, teacher_states, teacher, every
        self.head_figures = head_figures
        self.before, self.head_before, self.history = None, None, []

    @classmethod
    def planned(
        cls,
        batches: list[dict],
        teacher_states: list[tuple],
        teacher: torch.nn.Module,
        head_figures: Callable[..., dict],
        options: HealOptions,
        stop: "DevelopmentStop | None",
    ) -> "HealProbeCallback":
        """The probe measuring every fifth of the steps, or as training begins only where the `stop` measures the
        development texts from the first step."""
        every = None if stop and stop.from_step == 0 else max(1, options.max_steps // 5)
        return cls(batches, teacher_states, teacher, every=every, head_figures=head_figures)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if self.resumed(args, state):
            return
        with self.measuring(), gathered(model, self.teacher):  # every process measures (a sharded student needs them)
            states = student_states(model, self.batches)
            self.before = measure_states(states, self.batches, self.teacher_states)
            self.head_before = self.head_figures(model, before=True, states=states)
        self.history = [{"step": 0, **self.before[-1]}]

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if self.every and state.global_step % self.every == 0 and not control.should_training_stop:
            with self.measuring(), gathered(model):
                last = measure(model, self.batches, self.teacher_states)[-1]
            self.history.append({"step": state.global_step, **last})

    def figures(self) -> dict:
        return {"before": self.before, "head_before": self.head_before, "history": self.history}

    def restore(self, figures: dict) -> None:
        self.before, self.head_before, self.history = figures["before"], figures["head_before"], figures["history"]


class DevelopmentTexts:
    """The development batches (texts sampled from the teacher, held out from training) with the teacher's
    next-token log-probabilities on them, a student's `agreement` there, and the `student`'s as it starts (`before`);
    every process measures (a sharded student needs them all)."""

    def __init__(self, batches: list[dict], teacher: torch.nn.Module, student: torch.nn.Module):
        with gathered(teacher):
            self.expected = [log_probs.cpu() for log_probs in next_token_log_probs(teacher, batches)]
        self.batches = batches
        self.before = self.figures(student)
        self.measured: tuple[int, dict] | None = None  # the last training step's figures and the step

    def next_token(self, student: torch.nn.Module) -> NextTokenAgreement:
        """The student's figures as it started and now."""
        return NextTokenAgreement(before=self.before, after=self.figures(student))

    def figures(self, model: torch.nn.Module, step: int | None = None) -> dict:
        """The model's figures; after training step `step`, measured once however many callbacks ask."""
        if step is not None and self.measured and self.measured[0] == step:
            return self.measured[1]
        with gathered(model):
            figures = agreement(self.expected, next_token_log_probs(model, self.batches), self.batches)
        if step is not None:
            self.measured = (step, figures)
        return figures


class DevelopmentStop(CheckpointedFigures):
    """Stops training once the student's next-token KL to the teacher on the development texts has not fallen
    `IMPROVEMENT` below its best for `patience` measurements, every `every` steps from `from_step` (where a gradual
    schedule has moved the student to its own function; before it the KL rises by design); the processes stop
    together. `history` holds each measurement (kept beside the checkpoints), `stopped_at` the step."""

    IMPROVEMENT = 0.01
    FILE = "development_stop.json"

    def __init__(self, development: DevelopmentTexts, every: int, patience: int, from_step: int = 0):
        self.development, self.every, self.patience, self.from_step = development, every, patience, from_step
        self.history, self.stopped_at = [], None

    @classmethod
    def planned(
        cls, development: DevelopmentTexts | None, options: HealOptions, from_step: int
    ) -> "DevelopmentStop | None":
        """With development texts and `stop_patience`, the stop on their KL, measured every tenth of the steps from
        `from_step`; else None."""
        if not (development and options.stop_patience):
            return None
        every_tenth = max(1, options.max_steps // 10)
        return cls(development, every=every_tenth, patience=options.stop_patience, from_step=from_step)

    def figures(self) -> dict:
        return {"history": self.history}

    def restore(self, figures: dict) -> None:
        self.history = figures["history"]

    def on_step_end(self, args, state, control, model=None, **kwargs):
        step = state.global_step
        if step % self.every or step < self.from_step or step >= state.max_steps:
            return
        with self.measuring():
            self.history.append({"step": step, "kl": self.development.figures(model, step)["kl"]})
        earlier, recent = self.history[: -self.patience], self.history[-self.patience :]
        best = min((entry["kl"] for entry in earlier), default=0.0)
        stalled = bool(earlier) and all(entry["kl"] > best * (1 - self.IMPROVEMENT) for entry in recent)
        if agreed_max(int(stalled), args.device):  # the processes measured alike; they stop together regardless
            control.should_training_stop = True
            self.stopped_at = state.global_step


class FiniteGradients(TrainerCallback):
    """Ends a healing whose gradient is not finite, before the optimizer applies it (it would make every trained
    weight NaN): raises `HealError` naming the step, on every process alike."""

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        local = [grad.to_local() if isinstance(grad, DTensor) else grad for grad in grads]
        finite = torch.stack([grad.isfinite().all() for grad in local]).all()  # one device sync
        if agreed_max(int(not finite), args.device):
            raise HealError(
                f"the healing diverged at step {state.global_step + 1} of {state.max_steps}: its gradient is not "
                "finite (a lower learning_rate, or another swap_schedule, may train)"
            )


class TimeBudget(TrainerCallback):
    """Stops training once it has run `seconds` (the processes stop together, at the slowest one's step)."""

    def __init__(self, seconds: float):
        self.seconds, self.started = seconds, None

    def on_train_begin(self, args, state, control, **kwargs):
        self.started = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if agreed_max(int(time.perf_counter() - self.started >= self.seconds), args.device):
            control.should_training_stop = True

"""The two models of a healing: the student (the swapped variant) and the teacher (its unswapped source).

The teacher is the source as NormSwap without a swap (the model conversions are verified against), so that it runs
on padding-free batches with the student. The student trains without dropout unless asked: it is matching a
deterministic function, and dropout's noise costs more of it than it regularises (measured). Its embeddings stay
frozen unless asked: a swap moves norms, not the lexicon, and a text sample reaches only the embeddings of its own
tokens. In bfloat16, the student's trainable norms stay in float32: bfloat16 spaces numbers near 1 by 0.004 to 0.008,
so a norm weight's steps (about the learning rate) would round away (measured: they did not move at all).
"""

import copy
import types
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from transformers import AutoConfig

from ..convert import ConversionError, load_unswapped
from ..convert.converter import ConversionRecord
from ..convert.families import normswap_config
from ..convert.gguf import is_gguf, shipped_model
from ..model.configuration_normswap import NormSwapConfig
from ..model.heads import HEAD_CLASSES, empty_model, head_of_config
from ..model.norms_normswap import NormSwapDyT, NormSwapRMSNorm
from ..sharding import loads_weights, processes, sharded
from .gradual_swap import calibrated_out_of_pre_ln, check_swap_schedule
from .lora import merged, with_adapters
from .options import HealError, HealOptions


DROPOUT_FIELDS = ("attention_dropout", "hidden_dropout", "classifier_dropout")
NORM_CLASSES = (torch.nn.LayerNorm, NormSwapRMSNorm, NormSwapDyT)
LANGUAGE_OBJECTIVES = {"mlm": "masked-lm", "kl": "causal-lm"}  # objective -> the head student and teacher need
SHARED_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers")  # where student and teacher must agree


@dataclass
class HealModels:
    """Student (a PEFT model with `lora`) and teacher of `pair` in the options' dtype."""

    student: torch.nn.Module
    configured_dropout: dict  # the student's configuration's dropout, saved with it whatever it trained with
    teacher: torch.nn.Module
    pair: "HealPair"
    dtype: torch.dtype

    @property
    def teacher_id(self) -> str:
        return self.pair.teacher_id

    @property
    def teacher_is_source(self) -> bool:
        return self.pair.teacher_is_source

    @property
    def masked_lm(self) -> bool:
        """Whether both have a masked-LM head (its loss is measured then)."""
        return self.pair.teacher_head == "masked-lm"

    def healed_student(self) -> torch.nn.Module:
        """The student as a plain NormSwap model in the dtype it was loaded in: its adapters, if it has any, merged
        into its weights."""
        return merged(self.student).to(self.dtype)


@dataclass
class HealPair:
    """A healing's two configurations, read and checked against each other and the options (`for_head`'s) before
    either model loads: the student VARIANT's, with its conversion.json, and its teacher's (`resolve_teacher`)."""

    variant: str
    student: NormSwapConfig
    conversion: ConversionRecord | None
    teacher_id: str
    teacher: NormSwapConfig

    @classmethod
    def read(
        cls, variant: str, student: NormSwapConfig, conversion: ConversionRecord | None, options: HealOptions
    ) -> "HealPair":
        """VARIANT (of configuration `student`, converted as `conversion` says) with its teacher's configuration,
        checked (`check_for_student`, `teacher_config`, sampled texts within their positions)."""
        check_for_student(variant, student, conversion, options)
        teacher_id = resolve_teacher(variant, conversion, options.teacher)
        teacher = teacher_config(teacher_id, student, options.objective)
        pair = cls(variant, student, conversion, teacher_id, teacher)
        if options.data == "teacher" and pair.teacher_head != "causal-lm":
            raise HealError(f"--data teacher needs a teacher that generates (a causal LM); {teacher_id} has none")
        count, holder = pair.positions or (None, None)
        if options.data == "teacher" and count is not None and options.sample_length > count:
            raise HealError(
                f"sample_length={options.sample_length} is invalid: {holder} holds {count} positions; at most that"
            )
        return pair

    @property
    def positions(self) -> tuple[int, str] | None:
        """The fewest positions an absolute position table of student or teacher holds, and whose it is; None where
        neither has one."""
        held = [
            (usable_positions(self.student), self.variant),
            (usable_positions(self.teacher), f"the teacher {self.teacher_id}"),
        ]
        return min(
            ((count, name) for count, name in held if count is not None), key=lambda item: item[0], default=None
        )

    @property
    def teacher_head(self) -> str:
        """The head the teacher runs with: the language-model head (masked or causal) where student and teacher both
        have it, else none (`base`)."""
        head = head_of_config(self.student)
        return head if head in LANGUAGE_OBJECTIVES.values() and head_of_config(self.teacher) == head else "base"

    @property
    def teacher_is_source(self) -> bool:
        """Whether the teacher is the model the student was converted from (conversion.json's source)."""
        return self.conversion is not None and _same_model(self.teacher_id, self.conversion.source.id)


def for_student(variant: str, options: HealOptions) -> tuple[HealOptions, HealPair]:
    """The options with the defaults that VARIANT's head and conversion give (`for_head`), its text no longer than the
    absolute positions of student and teacher hold; and the two configurations, checked (`HealPair`): what `heal` and
    `heal --plan` refuse before any model loads."""
    student, conversion = student_config(variant), ConversionRecord.read(Path(variant))
    options = options.for_head(head_of_config(student), out_of_pre_ln=calibrated_out_of_pre_ln(conversion))
    pair = HealPair.read(variant, student, conversion, options)
    positions = pair.positions
    if positions:
        options = replace(options, max_length=min(options.max_length, positions[0]))
    return options, pair


def load_models(pair: HealPair, options: HealOptions) -> HealModels:
    """The student and teacher of `pair` (the student's embeddings frozen with `freeze_embeddings`); unsharded, both
    on the launch's device (an accelerator if there is one)."""
    dtype = getattr(torch, options.dtype)
    empty = not loads_weights(options.sharding, trained=True)
    student, configured_dropout = _load_student(Path(pair.variant), copy.deepcopy(pair.student), options, empty=empty)
    teacher = _load_teacher(pair, dtype=dtype, empty=not loads_weights(options.sharding))
    if not sharded(options.sharding):  # where the Trainer will train: the fit and the sampling run there too
        student, teacher = student.to(processes().device), teacher.to(processes().device)
    return HealModels(
        student=student,
        configured_dropout=configured_dropout,
        teacher=teacher,
        pair=pair,
        dtype=dtype,
    )


def check_for_student(
    variant: str, config: NormSwapConfig, conversion: ConversionRecord | None, options: HealOptions
) -> None:
    """The options' rules that need the student VARIANT (its `config`, its `conversion` record), with the defaults its
    head gives (`for_head`); the rest are declared with the options, or need the teacher too (`HealPair`)."""
    head = head_of_config(config)
    if options.objective in LANGUAGE_OBJECTIVES and head != LANGUAGE_OBJECTIVES[options.objective]:
        needed = LANGUAGE_OBJECTIVES[options.objective].replace("-lm", "-LM")
        raise HealError(f"objective={options.objective!r} needs a {needed} student; {variant} has the {head!r} head")
    if options.data == "teacher" and head != "causal-lm":
        raise HealError(f"--data teacher needs a causal-LM student; {variant} has the {head!r} head")
    if options.reconstruct_steps and not calibrated_out_of_pre_ln(conversion):
        raise HealError(
            f"reconstruct_steps={options.reconstruct_steps} needs a calibrated conversion out of pre-LN; "
            f"{variant}'s conversion.json records none"
        )
    check_swap_schedule(variant, conversion, config, options.swap_schedule)


def teacher_config(teacher_id: str, student: NormSwapConfig, objective: str | None) -> NormSwapConfig:
    """The configuration of the teacher TEACHER_ID (`source_config`), refused in one line if it does not fit the
    `student` (`SHARED_FIELDS`) or lacks the head the `objective` needs."""
    try:
        config = source_config(teacher_id)
    except HealError as error:
        raise HealError(f"teacher {error}") from None
    needed = LANGUAGE_OBJECTIVES.get(objective)
    if needed and head_of_config(config) != needed:
        needed = needed.replace("-lm", "-LM")
        raise HealError(f"objective={objective!r} needs a {needed} teacher; {teacher_id} has none")
    for field in SHARED_FIELDS:
        ours, theirs = getattr(student, field), getattr(config, field, None)
        if ours != theirs:
            raise HealError(f"teacher {teacher_id}: {field} {theirs} differs from the student's {ours}")
    return config


def usable_positions(config: NormSwapConfig) -> int | None:
    """The positions a model of absolute position embeddings holds (its table less its offset); None for others,
    which have no table to run past."""
    if config.position_embedding_type != "absolute":
        return None
    return config.max_position_embeddings - config.position_offset


def layer_parameters(model: torch.nn.Module) -> int:
    """The parameters of `model` outside its embeddings and head (adapters aside): those a healing's budget scales
    with."""
    outside = ("embed", "lm_head", "lora_")
    return sum(p.numel() for name, p in model.named_parameters() if not any(part in name for part in outside))


def memory_settings(options: HealOptions) -> dict:
    """The settings that decide how much memory the two models take, as heal.json records them."""
    return {"lora": options.lora, "lora_rank": options.lora_rank if options.lora else None, "dtype": options.dtype}


def _same_model(first: str, second: str) -> bool:
    """Whether two model ids name the same model: the same folder, or the same Hub id or file."""
    if Path(first).exists() and Path(second).exists():
        return Path(first).resolve() == Path(second).resolve()
    return first == second


def resolve_teacher(variant: str, conversion: ConversionRecord | None, teacher: str | None) -> str:
    """The teacher: `teacher` if given (a shipped model's name read as its file: `gguf.SHIPPED_MODELS`), else the
    source named in VARIANT's `conversion` record."""
    if teacher is not None:
        return shipped_model(teacher)
    if conversion is None:
        raise HealError(f"{variant}: no conversion.json naming its source; pass --teacher")
    return conversion.source.id


def student_config(variant: str | Path) -> NormSwapConfig:
    """VARIANT's configuration; refused in one line if it is not a NormSwap checkpoint."""
    if not (Path(variant) / "config.json").exists():
        raise HealError(f"{variant}: not a checkpoint folder (no config.json)")
    try:
        return NormSwapConfig.from_pretrained(variant)
    except (OSError, ValueError) as error:
        raise HealError(f"{variant}: not a NormSwap checkpoint ({str(error).splitlines()[0]})") from None


def _load_student(
    folder: Path, config: NormSwapConfig, options: HealOptions, empty: bool = False
) -> tuple[torch.nn.Module, dict]:
    """The variant in `folder` (of configuration `config`, which this changes) with its own head class in the options'
    dtype (its trainable norms in float32), without dropout unless `dropout`, its embeddings frozen with
    `freeze_embeddings`, with adapters with `lora`; and its configured dropout. With `empty`, its weights are not read
    (`empty_model`)."""
    configured = {field: getattr(config, field) for field in DROPOUT_FIELDS}
    config.update({} if options.dropout else {field: 0.0 for field, value in configured.items() if value is not None})
    dtype, head = getattr(torch, options.dtype), head_of_config(config)
    if empty:
        student = empty_model(config, head, dtype)
        student.tie_weights()
    else:
        student = HEAD_CLASSES[head].from_pretrained(folder, config=config, dtype=dtype)
    embeddings = student.base_model.embeddings
    embeddings.requires_grad_(not options.freeze_embeddings)
    norms = {
        name: module
        for name, module in student.named_modules()
        if isinstance(module, NORM_CLASSES) and module.weight.requires_grad
    }
    if options.dtype != "float32":
        _in_float32(norms.values())
    if options.lora:
        student = with_adapters(student, rank=options.lora_rank, norms=list(norms))
        if options.freeze_embeddings:  # PEFT picks modules_to_save by suffix: `norm` picks `embeddings.norm` too
            embeddings.requires_grad_(False)
    return student, configured


def _in_float32(norms) -> None:
    """Keeps `norms` in float32 inside a lower-precision model: each computes in its weights' dtype and hands its
    output back in its input's (by its own forward, so that hooks on it see both as they are)."""
    for norm in norms:
        norm.float()
        norm.forward = types.MethodType(_forward_in_weight_dtype, norm)


def _forward_in_weight_dtype(norm: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    return type(norm).forward(norm, hidden_states.to(norm.weight.dtype)).to(hidden_states.dtype)


def _load_teacher(pair: HealPair, dtype: torch.dtype, empty: bool = False) -> torch.nn.Module:
    """The pair's teacher, the unswapped source, with its `teacher_head`. With `empty`, its weights are not read
    (`empty_model`)."""
    try:
        if empty:
            teacher = empty_model(pair.teacher, pair.teacher_head, dtype).eval()
            teacher.tie_weights()
            return teacher
        return load_unswapped(pair.teacher_id, head=pair.teacher_head, dtype=dtype)
    except ConversionError as error:
        raise HealError(f"teacher {error}") from None
    except (OSError, ValueError) as error:
        raise HealError(f"teacher {pair.teacher_id}: cannot be loaded ({str(error).splitlines()[0]})") from None


def source_config(source: str) -> NormSwapConfig:
    """SOURCE's configuration (folder, Hub id or GGUF file) as the unswapped NormSwap configuration, read without its
    weights."""
    if not Path(source).exists() and (source.startswith((".", "/", "~")) or source.count("/") > 1):
        raise HealError(f"{source}: no such folder or file")
    try:
        if is_gguf(source):  # Transformers reads a GGUF file as a causal LM
            path = Path(source)
            config, head = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name), "causal-lm"
        else:
            config = AutoConfig.from_pretrained(source)
            head = head_of_config(config)
        return normswap_config(config, architectures=[HEAD_CLASSES[head].__name__])
    except (OSError, ValueError, KeyError) as error:
        raise HealError(f"{source}: no readable configuration ({str(error).splitlines()[0]})") from None

"""`heal --plan`: the memory each process of a healing will hold, from the configurations alone (nothing loads)."""

from pathlib import Path

from transformers import AutoConfig

from ..convert.families import normswap_config
from ..gguf import is_gguf
from ..model.configuration_normswap import NormSwapConfig
from ..model.heads import HEAD_CLASSES, head_of_config
from ..sharding.memory_plan import MemoryPlan, plan_memory
from .models import resolve_teacher
from .options import HealError, HealOptions


def heal_plan(variant: str, options: HealOptions, processes: int) -> MemoryPlan:
    """The per-process memory of healing VARIANT with `options` on `processes` processes: the student's weights,
    gradients and AdamW states (its embeddings frozen with `freeze_embeddings`, only its norms trained with `lora`:
    the adapters are not counted) and the teacher's weights."""
    try:
        student = NormSwapConfig.from_pretrained(variant)
    except (OSError, ValueError) as error:
        raise HealError(f"{variant}: not a NormSwap checkpoint ({str(error).splitlines()[0]})") from None
    teacher = source_config(resolve_teacher(Path(variant), options.teacher))
    if head_of_config(teacher) != head_of_config(student):  # the teacher runs without a head then
        teacher.architectures = None

    def trainable(name: str) -> bool:
        frozen = options.freeze_embeddings and ".embeddings." in name
        return not frozen and (not options.lora or "norm" in name)

    return plan_memory(
        student,
        processes=processes,
        sharded=options.fsdp and processes > 1,
        dtype=options.dtype,
        bf16=options.bf16,
        teacher_config=teacher,
        trainable=trainable,
    )


def source_config(source: str) -> NormSwapConfig:
    """SOURCE's configuration (folder, Hub id or GGUF file) as the unswapped NormSwap configuration, read without its
    weights."""
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

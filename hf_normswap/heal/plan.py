"""`heal --plan`: the memory each process of a healing will hold, from the configurations alone (nothing loads)."""

from ..sharding import MemoryPlan, plan_memory
from .models import for_student
from .options import HealOptions


def heal_plan(variant: str, options: HealOptions, processes: int) -> MemoryPlan:
    """The per-process memory of healing VARIANT with `options` on `processes` processes: the student's weights,
    gradients and AdamW states (its embeddings frozen with `freeze_embeddings`, only its norms trained with `lora`:
    the adapters are not counted) and the teacher's weights."""
    options, pair = for_student(variant, options)  # refused as `heal` refuses it
    if pair.teacher_head == "base":  # the teacher runs without a head then
        pair.teacher.architectures = None

    def trainable(name: str) -> bool:
        frozen = options.freeze_embeddings and ".embeddings." in name
        return not frozen and (not options.lora or "norm" in name)

    return plan_memory(
        pair.student,
        processes=processes,
        sharded=options.sharding.fsdp and processes > 1,
        dtype=options.dtype,
        bf16=options.sharding.bf16,
        teacher_config=pair.teacher,
        trainable=trainable,
    )

"""Healing with low-rank adapters (LoRA, through PEFT): the student's weights stay frozen but for its norms, which a
swap changed; adapters on the linear layers of its layers learn the rest, and are merged in before saving, so that
the healed checkpoint is a plain NormSwap checkpoint."""

import torch

from .options import HealError


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def with_adapters(student: torch.nn.Module, rank: int, norms: list[str]) -> torch.nn.Module:
    """The student as a PEFT model: LoRA adapters of `rank` (scale 1, no dropout) on the linear layers of its layers,
    and the modules named `norms` trained whole (as `modules_to_save`, so that the Trainer's checkpoints hold them)."""
    try:
        import peft
    except ImportError:
        raise HealError("--lora needs PEFT: pip install peft") from None
    config = peft.LoraConfig(
        r=rank, lora_alpha=rank, lora_dropout=0.0, target_modules=LORA_TARGETS, modules_to_save=norms
    )
    return peft.get_peft_model(student, config)


def merged(student: torch.nn.Module) -> torch.nn.Module:
    """The student with its adapters (if it has any) merged into its weights: a plain NormSwap model."""
    return student.merge_and_unload() if hasattr(student, "merge_and_unload") else student

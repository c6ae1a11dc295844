"""Healing: training a swapped variant to compute what its unswapped source computes."""

from .healing import heal_checkpoint
from .options import HealError, HealOptions


__all__ = ["HealError", "HealOptions", "heal_checkpoint"]

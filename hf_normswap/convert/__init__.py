"""Converters: families onto NormSwap, norm mapping, exact swaps, calibration, verification, export back."""

from .converter import convert_checkpoint
from .export import export_native
from .options import ConversionError, ConvertOptions
from .verification import load_unswapped


__all__ = ["ConversionError", "ConvertOptions", "convert_checkpoint", "export_native", "load_unswapped"]

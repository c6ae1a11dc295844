"""Converters: families onto NormSwap, norm mapping, exact swaps, calibration, verification, export back."""

from .converter import convert_checkpoint, load_unswapped
from .export import export_native
from .options import ConversionError, ConvertOptions


__all__ = ["ConversionError", "ConvertOptions", "convert_checkpoint", "export_native", "load_unswapped"]

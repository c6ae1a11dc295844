"""Comparisons: experiments, fine-tuning runs, settings search, statistics, report and plots."""

from .experiment import Experiment


__all__ = ["Experiment", "default_model", "run_comparison"]


def __getattr__(name: str):
    """`run_comparison` and `default_model`, imported when first used: their imports (evaluate, matplotlib) would
    otherwise cost every process of a command that only reads an experiment's options 55 MiB."""
    if name in ("default_model", "run_comparison"):
        from . import comparison

        return getattr(comparison, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

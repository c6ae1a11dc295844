"""Comparisons: experiments, fine-tuning runs, settings search, statistics, report and plots."""

from .comparison import default_model, run_comparison
from .experiment import Experiment


__all__ = ["Experiment", "default_model", "run_comparison"]

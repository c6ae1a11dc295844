"""Task metrics through `evaluate`, with GLUE's names."""

from pathlib import Path

import evaluate


_OFFLINE = Path(__file__).parent / "glue_local.py"


def load_metric(config_name: str) -> evaluate.EvaluationModule:
    """`evaluate.load("glue", config_name)` (or `"accuracy"`), falling back to the shipped module when offline."""
    try:
        if config_name == "accuracy":
            return evaluate.load("accuracy")
        return evaluate.load("glue", config_name)
    except FileNotFoundError:  # what evaluate raises when the Hub is out of reach and the module is not cached
        return evaluate.load(str(_OFFLINE), config_name)

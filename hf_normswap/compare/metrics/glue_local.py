"""GLUE's classification metrics as an `evaluate` module, for machines that cannot reach the Hub.

Same names and values as `evaluate.load("glue", config)`: accuracy (sst2, rte, ...), accuracy and f1 (mrpc, qqp),
matthews_correlation (cola).
"""

import datasets
import evaluate
import numpy as np


_KIND = {"cola": "matthews", "mrpc": "accuracy_f1", "qqp": "accuracy_f1"}


class GlueLocal(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=__doc__,
            citation="Wang et al. 2018, GLUE: A Multi-Task Benchmark and Analysis Platform for Natural Language Understanding.",
            inputs_description="predictions and references: lists of integer labels",
            features=datasets.Features(
                {"predictions": datasets.Value("int64"), "references": datasets.Value("int64")}
            ),
        )

    def _compute(self, predictions, references):
        predictions, references = np.asarray(predictions), np.asarray(references)
        accuracy = float((predictions == references).mean())
        kind = _KIND.get(self.config_name, "accuracy")
        if kind == "matthews":
            return {"matthews_correlation": _matthews(predictions, references)}
        if kind == "accuracy_f1":
            true_positive = float(((predictions == 1) & (references == 1)).sum())
            precision_recall = (predictions == 1).sum() + (references == 1).sum()
            return {
                "accuracy": accuracy,
                "f1": float(2 * true_positive / precision_recall) if precision_recall else 0.0,
            }
        return {"accuracy": accuracy}


def _matthews(predictions, references) -> float:
    classes = np.union1d(predictions, references)
    confusion = np.array([[np.sum((references == a) & (predictions == b)) for b in classes] for a in classes], float)
    samples, correct = confusion.sum(), np.trace(confusion)
    true_totals, predicted_totals = confusion.sum(1), confusion.sum(0)
    numerator = correct * samples - true_totals @ predicted_totals
    denominator = np.sqrt(
        (samples**2 - predicted_totals @ predicted_totals) * (samples**2 - true_totals @ true_totals)
    )
    return float(numerator / denominator) if denominator else 0.0

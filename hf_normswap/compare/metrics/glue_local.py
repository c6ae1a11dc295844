"""The metric of every task a comparison can load, as an `evaluate` module, for machines that cannot reach the Hub.

The tasks are SST-2 and RTE (GLUE configurations `sst2` and `rte`) and local files (`accuracy`): each reports
accuracy, with the name and value of `evaluate.load("glue", config)` and `evaluate.load("accuracy")`.
"""

import datasets
import evaluate
import numpy as np


class GlueLocal(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=__doc__,
            citation="Wang et al. 2018, GLUE: A Multi-Task Benchmark and Analysis Platform for Natural Language "
            "Understanding.",
            inputs_description="predictions and references: lists of integer labels",
            features=datasets.Features(
                {"predictions": datasets.Value("int64"), "references": datasets.Value("int64")}
            ),
        )

    def _compute(self, predictions, references):
        return {"accuracy": float((np.asarray(predictions) == np.asarray(references)).mean())}

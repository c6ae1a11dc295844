"""Fine-tuning tasks: GLUE SST-2 and RTE by name, the shipped SST-2 sample, or a local CSV / JSON-lines file."""

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from datasets import ClassLabel, DatasetDict, load_dataset


DATA_DIR = Path(__file__).parent / "data"
GLUE_TASKS = {"sst2": ("sentence", None), "rte": ("sentence1", "sentence2")}  # name: its text columns


@dataclass
class Task:
    name: str
    data: DatasetDict  # "train" and "validation", each with the text column(s) and "label"
    text_columns: tuple[str, ...]
    metric: str  # GLUE configuration name for the metric, e.g. "sst2"
    num_labels: int
    unigram_loss: float | None = None  # language modelling: the validation loss of training-token frequencies

    @property
    def majority_baseline(self) -> float:
        """Accuracy of always answering the most frequent validation label."""
        labels = self.data["validation"]["label"]
        return max(labels.count(label) for label in set(labels)) / len(labels)


def load_task(
    task: str,
    text_columns: tuple[str, ...] | None = None,
    label_column: str | None = "label",
    data_dir: str | None = None,
) -> Task:
    """Loads `task`: a GLUE name (`sst2`, `rte`), `sst2-sample` (704 SST-2 training and 3,000 evaluation
    sentences, shipped with the package), or a path to a CSV / JSON-lines file or a folder of them.

    GLUE tasks come from `data_dir` (default: the `HF_NORMSWAP_GLUE_DIR` environment variable) when given, else from
    the datasets hub. Without `label_column` (language modelling) only the text is kept.
    """
    text_only = label_column is None
    if task == "sst2-sample":
        data, metric = _local(DATA_DIR / "sst2"), "sst2"
        text_columns, label_column = GLUE_TASKS["sst2"][:1], "label"
    elif task in GLUE_TASKS:
        data, metric = _glue(task, data_dir), task
        text_columns, label_column = tuple(c for c in GLUE_TASKS[task] if c), "label"
    elif Path(task).exists():
        if not text_columns:
            raise ValueError(f"task file {task}: say which column(s) hold the text (--text-columns)")
        data, metric = _local(Path(task)), "accuracy"
    else:
        raise ValueError(
            f"task {task!r} is neither a GLUE task ({', '.join(GLUE_TASKS)}, sst2-sample) nor an existing file or "
            "folder"
        )
    for split in ("train", "validation"):
        if len(data[split]) == 0:
            raise ValueError(f"task {task!r}: the {split} split is empty")
        for column in text_columns if text_only else (*text_columns, label_column):
            if column not in data[split].column_names:
                raise ValueError(
                    f"task {task!r}: no column {column!r} in {split}; columns: {data[split].column_names}"
                )
    if text_only:
        data = data.remove_columns([c for c in data["train"].column_names if c not in text_columns])
        return Task(Path(task).stem, data, tuple(text_columns), metric, 0)
    if label_column != "label":
        data = data.rename_column(label_column, "label")
    if data["train"].features["label"].dtype == "string":  # one id per name, the same in both splits
        names = sorted(set(data["train"]["label"]) | set(data["validation"]["label"]))
        data = data.cast_column("label", ClassLabel(names=names))
    num_labels = len(set(data["train"]["label"]) | set(data["validation"]["label"]))
    data = data.remove_columns([c for c in data["train"].column_names if c not in (*text_columns, "label")])
    return Task(Path(task).stem, data, tuple(text_columns), metric, num_labels)


def unigram_loss(train_ids: list[list[int]], validation_ids: list[list[int]], vocab_size: int) -> float:
    """Cross-entropy on the validation targets (every token after the first) of the training tokens' frequencies
    (add-one smoothed): what a causal LM that ignores context reaches."""
    counts = np.bincount(
        np.concatenate([np.asarray(ids[1:], dtype=np.int64) for ids in train_ids]), minlength=vocab_size
    )
    counts = counts + 1.0
    targets = np.concatenate([np.asarray(ids[1:], dtype=np.int64) for ids in validation_ids])
    return float(-np.log(counts[targets] / counts.sum()).mean())


def _glue(task: str, data_dir: str | None) -> DatasetDict:
    """GLUE from local files when a folder is given (or HF_NORMSWAP_GLUE_DIR is set), else from the datasets hub."""
    folder = data_dir or os.environ.get("HF_NORMSWAP_GLUE_DIR")
    if folder:
        if not (Path(folder) / task).is_dir():
            raise ValueError(
                f"GLUE task {task!r}: no folder {Path(folder) / task} with train.jsonl and validation.jsonl"
            )
        return _local(Path(folder) / task)
    try:
        return load_dataset("nyu-mll/glue", task)
    except Exception as error:
        raise ValueError(
            f"GLUE task {task!r} could not be loaded from the datasets hub ({str(error).splitlines()[0]}); offline, "
            "pass --data-dir (or set HF_NORMSWAP_GLUE_DIR) to a folder holding TASK/train.jsonl and "
            "TASK/validation.jsonl"
        ) from None


def _local(path: Path) -> DatasetDict:
    """train / validation splits from a folder of `train.*` and `validation.*`, or one file split 90 / 10."""
    files = {}
    if path.is_dir():
        for split in ("train", "validation"):
            found = [p for ext in ("jsonl", "json", "csv") for p in [path / f"{split}.{ext}"] if p.exists()]
            if not found:
                raise ValueError(f"{path}: no {split}.jsonl or {split}.csv")
            files[split] = str(found[0])
    else:
        files["train"] = str(path)
    kind = "csv" if Path(files["train"]).suffix == ".csv" else "json"
    try:
        data = load_dataset(kind, data_files=files)
    except Exception as error:
        raise ValueError(f"{path}: cannot be read as {kind} ({str(error).splitlines()[0]})") from None
    if "validation" not in data:
        data = data["train"].train_test_split(test_size=0.1, seed=0)
        data = DatasetDict(train=data["train"], validation=data["test"])
    return data

"""Trains every NormSwap head for a few Trainer steps and evaluates it, on CPU, under `torchrun` with any number of
processes; rank 0 writes the logged losses and gradient norms to the JSON file named on the command line.

Run by `tests/test_declarations.py`: 2 processes with PER_DEVICE examples each must log what 1 process with
2 * PER_DEVICE logs, the same examples making up every step (sequential sampling, no dropout)."""

import json
import sys
import tempfile
from pathlib import Path

import torch
from torch.utils.data import Dataset
from transformers import Trainer, TrainingArguments

from hf_normswap import (
    NormSwapForCausalLM,
    NormSwapForMaskedLM,
    NormSwapForQuestionAnswering,
    NormSwapForSequenceClassification,
    NormSwapForTokenClassification,
)
from hf_normswap.sharding import end_processes

from helpers import tiny_config


HEADS = {
    "sequence-classification": (NormSwapForSequenceClassification, {"num_labels": 2}),
    "token-classification": (NormSwapForTokenClassification, {"num_labels": 3}),
    "question-answering": (NormSwapForQuestionAnswering, {}),
    "masked-lm": (NormSwapForMaskedLM, {}),
    "causal-lm": (NormSwapForCausalLM, {"is_causal": True}),
}
ROWS, LENGTH, STEPS = 32, 8, 4


class Rows(Dataset):
    """Random rows with the labels of `head`; about a third of the token labels are -100, unevenly across rows, so
    that token-level losses weigh the processes' shares differently."""

    def __init__(self, head: str, rows: int, seed: int):
        generator = torch.Generator().manual_seed(seed)
        input_ids = torch.randint(1, 99, (rows, LENGTH), generator=generator)
        ignored = torch.rand(rows, LENGTH, generator=generator) < torch.linspace(0.0, 0.7, rows)[:, None]
        token_labels = {"token-classification": input_ids % 3, "masked-lm": input_ids, "causal-lm": input_ids}
        self.rows = []
        for row in range(rows):
            example = {"input_ids": input_ids[row], "attention_mask": torch.ones(LENGTH, dtype=torch.long)}
            if head == "sequence-classification":
                example["labels"] = input_ids[row, 0] % 2
            elif head == "question-answering":
                example["start_positions"], example["end_positions"] = input_ids[row, :2].sort().values % LENGTH
            else:
                example["labels"] = token_labels[head][row].masked_fill(ignored[row], -100)
            self.rows.append(example)

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, index):
        return self.rows[index]


def losses(head: str, per_device: int) -> dict:
    model_class, fields = HEADS[head]
    torch.manual_seed(0)
    model = model_class(tiny_config(norm_placement="pre", position_embedding_type="rope", **fields))
    with tempfile.TemporaryDirectory() as output:
        args = TrainingArguments(
            output_dir=output,
            per_device_train_batch_size=per_device,
            per_device_eval_batch_size=per_device,
            max_steps=STEPS,
            learning_rate=1e-2,
            max_grad_norm=1.0,
            train_sampling_strategy="sequential",
            logging_steps=1,
            save_strategy="no",
            report_to=[],
            use_cpu=True,
            disable_tqdm=True,
            seed=0,
        )
        trainer = Trainer(model=model, args=args, train_dataset=Rows(head, ROWS, 0), eval_dataset=Rows(head, 16, 1))
        trainer.train()
        evaluation = trainer.evaluate()
    logged = [entry for entry in trainer.state.log_history if "loss" in entry and "train_loss" not in entry]
    return {
        "accepts_loss_kwargs": trainer.model_accepts_loss_kwargs,
        "loss": [entry["loss"] for entry in logged],
        "grad_norm": [entry["grad_norm"] for entry in logged],
        "eval_loss": evaluation["eval_loss"],
    }


if __name__ == "__main__":
    output, per_device = Path(sys.argv[1]), int(sys.argv[2])
    results = {head: losses(head, per_device) for head in HEADS}
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        output.write_text(json.dumps(results, indent=1))
    end_processes()

"""Each head trains through the Trainer on a tiny learnable task, and its loss goes down."""

import pytest
import torch
from datasets import Dataset
from transformers import Trainer, TrainingArguments

from hf_normswap import (
    NormSwapForCausalLM,
    NormSwapForMaskedLM,
    NormSwapForQuestionAnswering,
    NormSwapForSequenceClassification,
    NormSwapForTokenClassification,
)

from helpers import tiny_config


def tiny_task(head: str, size: int = 64, length: int = 8) -> Dataset:
    """Learnable toy data: the label is a function of the tokens."""
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(2, 20, (size, length), generator=generator)
    marker = torch.randint(0, length, (size,), generator=generator)
    rows = {"input_ids": input_ids.tolist(), "attention_mask": torch.ones_like(input_ids).tolist()}
    if head == "sequence":
        rows["labels"] = (input_ids[:, 0] > 10).long().tolist()
    elif head == "token":
        rows["labels"] = (input_ids > 10).long().tolist()
    elif head == "qa":
        input_ids[torch.arange(size), marker] = 1
        rows["input_ids"] = input_ids.tolist()
        rows["start_positions"] = rows["end_positions"] = marker.tolist()
    else:
        rows["labels"] = input_ids.tolist()
    return Dataset.from_dict(rows)


HEADS = {
    "masked-lm": (NormSwapForMaskedLM, {}),
    "sequence": (NormSwapForSequenceClassification, {"num_labels": 2}),
    "token": (NormSwapForTokenClassification, {"num_labels": 2}),
    "qa": (NormSwapForQuestionAnswering, {}),
    "causal-lm": (NormSwapForCausalLM, {"is_causal": True}),
}


@pytest.mark.parametrize("head", HEADS)
def test_head_trains_with_the_trainer(tmp_path, head):
    model_class, overrides = HEADS[head]
    model = model_class(tiny_config(norm_placement="pre", position_embedding_type="rope", **overrides))
    args = TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=16,
        learning_rate=3e-3,
        num_train_epochs=6,
        logging_steps=4,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    trainer = Trainer(model=model, args=args, train_dataset=tiny_task(head))
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) >= 4
    assert losses[-1] < 0.8 * losses[0], losses

"""How much one optimizer step at initialisation changes what a model computes (Liu et al. 2020: post-LN's change
grows with depth, faster than pre-LN's and Admin's), and the last layer's gradient norm there (Xiong et al. 2020)."""

import torch
from transformers import Trainer

from ..model.evaluation_mode import evaluation_mode


def update_size(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], learning_rate: float, weight_decay: float
) -> dict[str, float]:
    """One AdamW step (default betas and epsilon, the Trainer's weight-decay groups) of `model` (a head model) on
    `batch` (its inputs with `labels`), without dropout. Returns `output_change`, the mean over real tokens and
    features of the squared change of the base model's final hidden states, and `last_layer_gradient_norm`, the L2
    norm of the gradients of the last layer's parameters before the step. Changes `model`'s weights."""
    inputs = {name: values for name, values in batch.items() if name != "labels"}
    real = _real_tokens(batch)
    decayed = set(Trainer.get_decay_parameter_names(None, model))  # the Trainer's: no decay for biases and norms
    parameters = dict(model.named_parameters())
    optimizer = torch.optim.AdamW(
        [
            {"params": [p for name, p in parameters.items() if name in decayed], "weight_decay": weight_decay},
            {"params": [p for name, p in parameters.items() if name not in decayed], "weight_decay": 0.0},
        ],
        lr=learning_rate,
    )
    with evaluation_mode(model):
        with torch.no_grad():
            before = model.base_model(**inputs).last_hidden_state[real].float()
        model.zero_grad()
        model(**batch).loss.backward()
        gradients = [p.grad.flatten() for p in model.base_model.layers[-1].parameters() if p.grad is not None]
        last_layer_gradient_norm = torch.cat(gradients).float().norm().item()
        optimizer.step()
        model.zero_grad()
        with torch.no_grad():
            after = model.base_model(**inputs).last_hidden_state[real].float()
    return {
        "output_change": (after - before).pow(2).mean().item(),
        "last_layer_gradient_norm": last_layer_gradient_norm,
    }


def _real_tokens(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Which positions hold real tokens: the attention mask's, a packed batch's (`seq_idx` -1 at the row ends), or
    all."""
    if "attention_mask" in batch:
        return batch["attention_mask"].bool()
    if "seq_idx" in batch:
        return batch["seq_idx"] >= 0
    return torch.ones_like(batch["input_ids"], dtype=torch.bool)

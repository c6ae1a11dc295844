"""Loads tiny NormSwap checkpoints with Transformers' tensor parallelism (`base_model_tp_plan`) on CPU under
`torchrun --nproc_per_node 2` (gloo) and compares them with the same checkpoints loaded whole: logits, loss, every
parameter's gradient, and greedy generation (dynamic and static cache) for the causal ones. Rank 0 writes the largest
differences to the JSON file named on the command line.

Run by `tests/test_declarations.py`."""

import json
import re
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard
from transformers import DistributedConfig

from hf_normswap import NormSwapForCausalLM, NormSwapForMaskedLM, NormSwapForSequenceClassification
from hf_normswap.sharding import end_processes

from helpers import padded_batch, tiny_config


LLAMA = dict(norm_placement="pre", norm_type="rmsnorm", position_embedding_type="rope", hidden_act="silu")
CASES = {  # heads split over the ranks, GQA (2 key/value heads for 4), per-head q/k norms, an untied LM head
    "llama-gqa-qk-norm": (
        NormSwapForCausalLM,
        dict(LLAMA, is_causal=True, mlp_type="glu", num_key_value_heads=2, qk_norm=True, tie_word_embeddings=False),
    ),
    # ALiBi's slopes and q/k norms over the whole projection need every head: gathered projections
    "alibi-sandwich-tied": (
        NormSwapForCausalLM,
        dict(is_causal=True, norm_placement="sandwich", position_embedding_type="alibi"),
    ),
    "projection-qk-norm": (
        NormSwapForCausalLM,
        dict(LLAMA, is_causal=True, qk_norm=True, qk_norm_scope="projection", num_key_value_heads=2),
    ),
    "bert-masked-lm": (NormSwapForMaskedLM, {}),  # standard MLP (no gate), decoder tied to the embeddings
    "bert-sequence-classification": (NormSwapForSequenceClassification, {}),
}


def gradients(model) -> dict:
    return {
        name: (parameter.grad.full_tensor() if isinstance(parameter.grad, DTensor) else parameter.grad)
        for name, parameter in model.named_parameters()
    }


def compare(folder: Path, model_class) -> dict:
    sharded = model_class.from_pretrained(folder, distributed_config=DistributedConfig(tp_size=2)).eval()
    whole = model_class.from_pretrained(folder).eval()
    input_ids, attention_mask = padded_batch()
    causal = model_class is NormSwapForCausalLM
    labels = torch.tensor([0, 1]) if model_class is NormSwapForSequenceClassification else input_ids
    outputs = [model(input_ids, attention_mask=attention_mask, labels=labels) for model in (sharded, whole)]
    for output in outputs:
        output.loss.backward()
    (sharded_grads, whole_grads) = (gradients(model) for model in (sharded, whole))
    result = {
        "sharded": sorted(
            {
                re.sub(r"\.\d+\.", ".*.", name)
                for name, parameter in sharded.named_parameters()
                if isinstance(parameter, DTensor) and any(isinstance(p, Shard) for p in parameter.placements)
            }
        ),
        "logits": (outputs[0].logits - outputs[1].logits).abs().max().item(),
        "loss": abs(outputs[0].loss.item() - outputs[1].loss.item()),
        "gradients": max((sharded_grads[name] - grad).abs().max().item() for name, grad in whole_grads.items()),
    }
    if causal:
        prompts = (input_ids.flip(1), attention_mask.flip(1))  # left-padded
        for cache in ("dynamic", "static"):
            tokens = [
                model.generate(
                    prompts[0],
                    attention_mask=prompts[1],
                    max_new_tokens=8,
                    min_new_tokens=8,
                    do_sample=False,
                    pad_token_id=0,
                    cache_implementation=cache,
                ).tolist()
                for model in (sharded, whole)
            ]
            result[f"same_greedy_tokens_{cache}"] = tokens[0] == tokens[1]
    return result


if __name__ == "__main__":
    output, folder = Path(sys.argv[1]), Path(sys.argv[2])
    dist.init_process_group("gloo")
    if dist.get_rank() == 0:
        for name, (model_class, fields) in CASES.items():
            torch.manual_seed(0)
            model_class(tiny_config(**fields)).save_pretrained(folder / name)
    dist.barrier()
    results = {name: compare(folder / name, model_class) for name, (model_class, _) in CASES.items()}
    dist.barrier()
    if dist.get_rank() == 0:
        output.write_text(json.dumps(results, indent=1))
    end_processes()

"""NormSwapModel compiles as one graph (no graph breaks), padded and packed, forward and backward."""

import pytest
import torch

from hf_normswap import DataCollatorWithPacking, NormSwapModel

from helpers import LLAMA_LIKE, padded_batch, tiny_config


CONFIGS = {
    "default": {},
    "llama-like": dict(LLAMA_LIKE, is_causal=True),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_fullgraph_compile_padded_and_packed(name):
    torch._dynamo.reset()
    model = NormSwapModel._from_config(tiny_config(**CONFIGS[name]), attn_implementation="sdpa").train()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")  # a graph break raises here
    input_ids, attention_mask = padded_batch()
    packed = DataCollatorWithPacking()(
        [{"input_ids": ids[mask.bool()].tolist()} for ids, mask in zip(input_ids, attention_mask)]
    )
    for batch in ({"input_ids": input_ids, "attention_mask": attention_mask}, packed):
        outputs = []
        for forward in (model, compiled):
            model.zero_grad()
            hidden = forward(**batch).last_hidden_state
            hidden.pow(2).mean().backward()
            outputs.append((hidden.detach(), [p.grad.clone() for p in model.parameters()]))
        (eager_hidden, eager_grads), (compiled_hidden, compiled_grads) = outputs
        assert (eager_hidden - compiled_hidden).abs().max().item() <= 1e-6
        assert max((a - b).abs().max().item() for a, b in zip(eager_grads, compiled_grads)) <= 1e-6

"""Swaps that keep the function exactly, by rewriting the weights instead of retraining them.

- post <-> deepnorm: LayerNorm is scale-invariant, so scaling each sublayer's output projection (weight and bias) by
  alpha gives N(alpha * x + alpha * F(x)) = N(x + F(x)), up to eps.
- post -> admin: Admin's residual weight starts at 1, where N(1 * x + F(x)) is post-LN's.
- pre <-> lns: LayerNorm Scaling divides the input norms of the layer at depth l by sqrt(l); `convert.weights`
  multiplies their gains and biases by sqrt(l) on the way (in any conversion between the two), so
  F(N'(x) / sqrt(l)) = F(N(x)).
- pre-LN LayerNorm -> pre-LN RMSNorm (Jiang et al. 2023, "Pre-RMSNorm and Pre-CRMSNorm Transformers"): every tensor
  that writes into the residual stream is re-centred, so the stream has zero mean and LayerNorm equals RMSNorm there;
  each norm's gain and bias are folded into the linear layers that read it, and the norm starts at weight 1.

Any other swap is approximate: `convert` measures and reports how far it moved the model.
"""

import torch

from ..model.configuration_normswap import NormSwapConfig


# The placement swaps that keep the function, by (source, target) placement.
PLACEMENT_SWAPS = {
    ("post", "deepnorm"): "post<->deepnorm",
    ("deepnorm", "post"): "post<->deepnorm",
    ("post", "admin"): "post->admin",
    ("pre", "lns"): "pre<->lns",
    ("lns", "pre"): "pre<->lns",
}
# Heads whose layers reading the final norm have a bias to fold the norm's bias into, by their classifier head.
_FINAL_NORM_READERS = {
    "sequence-classification": lambda config: ["pooler.dense" if config.classifier_activation else "classifier"],
    "token-classification": lambda config: ["head.dense" if config.token_classifier_head else "classifier"],
    "question-answering": lambda config: ["head.dense" if config.token_classifier_head else "qa_outputs"],
}


def plan_exact_swap(
    plain: NormSwapConfig, target: NormSwapConfig, head: str, norm_sources: dict
) -> tuple[str | None, dict]:
    """The exact swap from `plain` to `target` (placement swaps of `PLACEMENT_SWAPS`, joined by " + " when layers
    take several, or "layernorm->rmsnorm"), or None, and the target configuration fields it needs (biases to fold norm
    biases into, an untied LM head)."""
    if any(goal != source for goal, source in norm_sources.items()):
        return None, {}
    same = ("position_embedding_type", "is_causal", "embedding_norm", "final_norm", "qk_norm", "norm_eps")
    if any(getattr(plain, field) != getattr(target, field) for field in same):
        return None, {}
    pairs = set(zip(plain.layer_norm_placements, target.layer_norm_placements))
    if plain.norm_type == target.norm_type:
        changed = {(before, after) for before, after in pairs if before != after}
        if changed and changed <= set(PLACEMENT_SWAPS):
            return " + ".join(sorted({PLACEMENT_SWAPS[pair] for pair in changed})), {}
        return None, {}
    pre_ln = pairs == {("pre", "pre")} and not plain.embedding_norm and not plain.qk_norm
    pre_ln = pre_ln and plain.first_attention_input_norm and plain.embedding_size == plain.hidden_size
    if not (pre_ln and plain.norm_type == "layernorm" and target.norm_type == "rmsnorm"):
        return None, {}
    if plain.position_embedding_type == "sinusoidal" or head == "masked-lm":  # a fixed table, a norm inside the head
        return None, {}
    if head in _FINAL_NORM_READERS:
        reader = _FINAL_NORM_READERS[head](plain)[0]
        bias_field = {
            "classifier": "classifier_bias",
            "pooler.dense": "head_dense_bias",
            "head.dense": "head_dense_bias",
        }
        fields = {bias_field[reader]: True} if plain.norm_bias and reader in bias_field else {}
    elif plain.norm_bias:  # the base model's output and the bias-free LM head cannot take the final norm's bias
        return None, {}
    else:
        fields = {"tie_word_embeddings": False} if head == "causal-lm" else {}
    if plain.norm_bias:
        fields.update(attention_bias=True, attention_output_bias=plain.attention_output_bias, mlp_bias=True)
    return "layernorm->rmsnorm", fields


def keeps_last_hidden_state(kind: str | None, head: str) -> bool:
    """Whether the swap leaves the last hidden state as it was (otherwise only the head's logits are kept)."""
    return not (kind == "layernorm->rmsnorm" and head in _FINAL_NORM_READERS)


def apply_exact_swap(
    kind: str, state: dict[str, torch.Tensor], plain: NormSwapConfig, target: NormSwapConfig, head: str
) -> dict:
    """Rewrites `state` (names as in a `NormSwapFor...` model, body under `model.`) for the exact swap `kind`."""
    if kind == "layernorm->rmsnorm":
        return _layernorm_to_rmsnorm(state, target, head)
    for layer, (before, after) in enumerate(zip(plain.layer_norm_placements, target.layer_norm_placements)):
        if {before, after} != {"post", "deepnorm"}:
            continue  # post -> admin: the residual weights start at 1; pre <-> lns: the input norms were rescaled
        scale = target.deepnorm_alpha if after == "deepnorm" else 1 / plain.deepnorm_alpha
        for projection in ("self_attn.o_proj", "mlp.down_proj"):
            for parameter in ("weight", "bias"):
                name = f"model.layers.{layer}.{projection}.{parameter}"
                if name in state:
                    state[name] = state[name] * scale
    return state


def _layernorm_to_rmsnorm(state, target, head):
    dtype = state["model.embeddings.word_embeddings.weight"].dtype
    state = {name: tensor.double() for name, tensor in state.items()}
    if not target.tie_word_embeddings and head == "causal-lm":
        state.setdefault("lm_head.weight", state["model.embeddings.word_embeddings.weight"].clone())
    for name in ("word_embeddings", "position_embeddings", "token_type_embeddings"):
        name = f"model.embeddings.{name}.weight"
        if name in state:
            state[name] = state[name] - state[name].mean(-1, keepdim=True)
    readers = {"model.norm": _FINAL_NORM_READERS[head](target) if head in _FINAL_NORM_READERS else []}
    for layer in range(target.num_hidden_layers):
        prefix = f"model.layers.{layer}"
        for projection in ("self_attn.o_proj", "mlp.down_proj"):
            weight, bias = f"{prefix}.{projection}.weight", f"{prefix}.{projection}.bias"
            state[weight] = state[weight] - state[weight].mean(0, keepdim=True)
            if bias in state:
                state[bias] = state[bias] - state[bias].mean()
        mlp_inputs = ("gate_proj", "up_proj") if target.mlp_type == "glu" else ("up_proj",)
        readers[f"{prefix}.attention_norms.input_norm"] = [
            f"{prefix}.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj")
        ]
        readers[f"{prefix}.mlp_norms.input_norm"] = [f"{prefix}.mlp.{p}" for p in mlp_inputs]
    for norm, linears in readers.items():
        gain, shift = state.pop(f"{norm}.weight"), state.pop(f"{norm}.bias", None)
        if not linears or any(f"{linear}.weight" not in state for linear in linears):
            state[f"{norm}.weight"] = gain  # nothing to fold into: exact only without a bias (measured by `convert`)
            continue
        for linear in linears:
            weight = state[f"{linear}.weight"]
            if shift is not None:
                bias = state.get(f"{linear}.bias", torch.zeros(weight.shape[0], dtype=weight.dtype))
                state[f"{linear}.bias"] = bias + weight @ shift
            state[f"{linear}.weight"] = weight * gain
        state[f"{norm}.weight"] = torch.ones_like(gain)
    return {name: tensor.to(dtype) for name, tensor in state.items()}

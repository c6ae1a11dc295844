import torch

from hf_normswap import NormSwapConfig, NormSwapForCausalLM
from hf_normswap.probes.update_size import update_size


def tiny_causal_lm(depth: int, seed: int, placement: str = "post") -> NormSwapForCausalLM:
    torch.manual_seed(seed)
    config = NormSwapConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=depth,
        num_attention_heads=4,
        max_position_embeddings=32,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        is_causal=True,
        norm_placement=placement,
        initializer="xavier",
    )
    return NormSwapForCausalLM(config)


def token_batch(padded: bool = False) -> dict[str, torch.Tensor]:
    ids = torch.randint(3, 64, (4, 16), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    if padded:
        mask[0, 10:] = 0
        ids = ids.masked_fill(mask == 0, 0)
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def test_post_ln_output_change_grows_with_depth():
    """Liu et al. (2020): after one Adam step at initialisation (no warm-up), post-LN's output changes more the deeper
    it is. Over 20 seeds, the smallest change at 8 layers is over 3 times the largest at 1 or 2; three seeds here."""
    changes = {
        depth: [
            update_size(tiny_causal_lm(depth, seed), token_batch(), 1e-3, 0.0)["output_change"] for seed in range(3)
        ]
        for depth in (1, 2, 8)
    }
    assert min(changes[8]) > 2 * max(changes[1] + changes[2]), changes
    assert all(1e-3 < change < 1.0 for values in changes.values() for change in values), changes


def test_update_size_measures_one_step_on_real_tokens():
    batch = token_batch(padded=True)
    model = tiny_causal_lm(depth=2, seed=0)
    weights = {name: parameter.detach().clone() for name, parameter in model.named_parameters()}
    model.zero_grad()
    model(**batch).loss.backward()
    expected_norm = torch.cat([p.grad.flatten() for p in model.base_model.layers[-1].parameters()]).norm().item()
    model.zero_grad()
    inputs = {name: batch[name] for name in ("input_ids", "attention_mask")}
    with torch.no_grad():
        before = model.base_model(**inputs).last_hidden_state

    figures = update_size(model, batch, learning_rate=1e-3, weight_decay=0.1)
    assert abs(figures["last_layer_gradient_norm"] - expected_norm) <= 1e-6 * expected_norm
    with torch.no_grad():
        after = model.base_model(**inputs).last_hidden_state
    real = batch["attention_mask"].bool()
    assert (
        abs(figures["output_change"] - (after - before)[real].pow(2).mean().item()) <= 1e-6 * figures["output_change"]
    )
    # Adam's first step moves each weight by about the learning rate; weights decay, norms (LayerNorm) do not.
    for name, decayed in (
        ("layers.0.mlp.up_proj.weight", True),
        ("layers.0.attention_norms.residual_norm.weight", False),
    ):
        before_step = weights[f"model.{name}"]
        step = (model.base_model.get_parameter(name) - before_step).abs().max().item()
        expected = 1e-3 * (1 + 0.1 * before_step.abs().max().item() * decayed)
        assert abs(step - expected) <= 1e-5, (name, step)

    unchanged = tiny_causal_lm(depth=2, seed=0)
    assert update_size(unchanged, batch, learning_rate=0.0, weight_decay=0.0)["output_change"] == 0.0

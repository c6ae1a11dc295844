"""Per-layer attention types: sliding windows (causal and bidirectional, with Transformers' mask semantics) and
rope parameters per layer type."""

import pytest
import torch

from hf_normswap import NormSwapConfig, NormSwapForCausalLM, NormSwapModel

from helpers import padded_batch, save_source, tiny_config


SLIDING = ["sliding_attention", "full_attention"]


def test_defaults_are_all_full_attention():
    config = tiny_config()
    assert config.layer_types == ["full_attention", "full_attention"] and config.sliding_window is None
    assert config.rope_parameters is None  # only RoPE configurations carry rope parameters
    rope = tiny_config(position_embedding_type="rope")
    assert rope.rope_parameters == {"rope_type": "default", "rope_theta": 10000.0}


@pytest.mark.parametrize(
    "fields, message",
    [
        (
            dict(layer_types=["full_attention"]),
            "layer_types=\\['full_attention'\\] .*one value for each of the 2 layers",
        ),
        (dict(layer_types=["local", "full_attention"]), "layer_types='local' .*allowed are"),
        (dict(layer_types=SLIDING), "sliding_window=None .*'sliding_attention' layers need a window"),
        (dict(layer_types=SLIDING, sliding_window=0), "sliding_window=0 .*positive integer"),
        (
            dict(layer_types=SLIDING, sliding_window=2, rope_parameters={"full_attention": {"rope_theta": 10.0}}),
            "rope_parameters=.*one entry for each type in layer_types",
        ),
        (dict(rope_parameters={"full_attention": 3}), "rope_parameters=.*each entry must be a dict"),
        (
            dict(rope_parameters={"full_attention": {"rope_type": "unknown"}}),
            "rope_parameters=.*rope_type must be in",
        ),
    ],
)
def test_bad_attention_fields_are_named(fields, message):
    with pytest.raises(ValueError, match=message):
        tiny_config(**fields)


def test_rope_per_layer_type_round_trips(tmp_path):
    rope = {
        "full_attention": {"rope_theta": 1e6, "rope_type": "linear", "factor": 2.0},
        "sliding_attention": {"rope_theta": 1e4},
    }
    config = tiny_config(position_embedding_type="rope", layer_types=SLIDING, sliding_window=3, rope_parameters=rope)
    assert config.rope_parameters["sliding_attention"] == {"rope_theta": 1e4, "rope_type": "default"}
    config.save_pretrained(tmp_path)
    assert NormSwapConfig.from_pretrained(tmp_path).to_dict() == config.to_dict()


def _band_mask(attention_mask, window, causal):
    """The additive mask that Transformers' sliding-window masks mean: causally j in (i - window, i], bidirectionally
    |i - j| <= window; padded keys masked."""
    length = attention_mask.shape[1]
    i, j = torch.arange(length)[:, None], torch.arange(length)[None, :]
    allowed = (j > i - window) & (j <= i) if causal else (i - j).abs() <= window
    allowed = allowed[None, None] & attention_mask.bool()[:, None, None, :]
    return torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_sliding_window_layers_use_transformers_semantics(is_causal, implementation):
    window = 3
    sliding = tiny_config(
        layer_types=["sliding_attention"] * 2,
        sliding_window=window,
        is_causal=is_causal,
        position_embedding_type="rope",
        norm_placement="pre",
        attn_implementation=implementation,
    )
    model = NormSwapModel(sliding).eval()
    full = NormSwapModel(
        tiny_config(
            **{**sliding.to_diff_dict(), "layer_types": None, "sliding_window": None, "attn_implementation": "eager"}
        )
    ).eval()
    full.load_state_dict(model.state_dict())
    input_ids, attention_mask = padded_batch(lengths=(12, 8))
    with torch.no_grad():
        got = model(input_ids, attention_mask=attention_mask).last_hidden_state
        expected = full(input_ids, attention_mask=_band_mask(attention_mask, window, is_causal)).last_hidden_state
        unwindowed = full(input_ids, attention_mask=attention_mask).last_hidden_state
    real = attention_mask.bool()
    assert (got - expected)[real].abs().max().item() <= 1e-5
    assert (got - unwindowed)[real].abs().max().item() > 1e-3  # beyond the window, it matters


def test_tokens_beyond_the_window_have_no_influence_in_one_layer():
    config = tiny_config(
        num_hidden_layers=1,
        layer_types=["sliding_attention"],
        sliding_window=2,
        position_embedding_type="rope",
        norm_placement="pre",
    )
    model = NormSwapModel(config).eval()
    input_ids, _ = padded_batch(lengths=(10,))
    changed = input_ids.clone()
    changed[0, 9] = (changed[0, 9] + 1) % 99
    with torch.no_grad():
        a, b = model(input_ids).last_hidden_state, model(changed).last_hidden_state
    assert torch.equal(a[0, :7], b[0, :7])  # position 6 is 3 away from 9: outside a window of 2
    assert not torch.equal(a[0, 7:], b[0, 7:])


def test_rope_per_layer_type_matches_flat_when_equal_and_differs_otherwise():
    flat = tiny_config(position_embedding_type="rope", layer_types=SLIDING, sliding_window=4)
    same = tiny_config(
        **{
            **flat.to_diff_dict(),
            "rope_parameters": {
                "full_attention": {"rope_theta": 10000.0},
                "sliding_attention": {"rope_theta": 10000.0},
            },
        }
    )
    other = tiny_config(
        **{
            **flat.to_diff_dict(),
            "rope_parameters": {"full_attention": {"rope_theta": 10000.0}, "sliding_attention": {"rope_theta": 10.0}},
        }
    )
    models = [NormSwapModel(config).eval() for config in (flat, same, other)]
    for model in models[1:]:
        model.load_state_dict(models[0].state_dict())
    input_ids, attention_mask = padded_batch()
    with torch.no_grad():
        a, b, c = (model(input_ids, attention_mask=attention_mask).last_hidden_state for model in models)
    assert torch.equal(a, b)
    assert (a - c).abs().max().item() > 1e-5  # small: random init, post-LN
    # the sliding layer's rope is the local one: layer 0 of `other` sees theta 10
    assert models[2].rotary_emb.sliding_attention_inv_freq[1].item() == pytest.approx(10.0 ** (-2 / 8))


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_mistral_sliding_window_is_exact_beyond_the_window(tmp_path, implementation):
    native = save_source(tmp_path / "source", "mistral", "ForCausalLM", tokenizer=False, sliding_window=4)
    native = type(native).from_pretrained(tmp_path / "source", attn_implementation=implementation).eval()
    ours = NormSwapForCausalLM(
        tiny_config(
            vocab_size=64,
            intermediate_size=64,
            num_key_value_heads=2,
            norm_placement="pre",
            norm_type="rmsnorm",
            norm_eps=native.config.rms_norm_eps,
            position_embedding_type="rope",
            is_causal=True,
            attention_bias=False,
            mlp_type="glu",
            hidden_act="silu",
            mlp_bias=False,
            type_vocab_size=0,
            tie_word_embeddings=False,
            layer_types=["sliding_attention"] * 2,
            sliding_window=4,
            attn_implementation=implementation,
        )
    ).eval()
    from hf_normswap.convert.families import LLAMA

    state = {LLAMA.rename(name): tensor for name, tensor in native.state_dict().items()}
    ours.load_state_dict({name: tensor for name, tensor in state.items() if name is not None})
    input_ids, attention_mask = padded_batch(vocab_size=64, lengths=(16, 11))
    with torch.no_grad():
        expected = native(input_ids, attention_mask=attention_mask).logits
        got = ours(input_ids, attention_mask=attention_mask).logits
    assert (expected - got)[attention_mask.bool()].abs().max().item() <= 1e-4


def test_rope_per_layer_type_reloads_exactly(tmp_path):
    rope = {
        "full_attention": {"rope_theta": 1e6, "rope_type": "linear", "factor": 2.0},
        "sliding_attention": {"rope_theta": 1e4},
    }
    config = tiny_config(
        position_embedding_type="rope",
        layer_types=SLIDING,
        sliding_window=3,
        rope_parameters=rope,
        is_causal=True,
        norm_placement="pre",
    )
    model = NormSwapForCausalLM(config).eval()
    model.save_pretrained(tmp_path)
    loaded = NormSwapForCausalLM.from_pretrained(tmp_path).eval()  # frequency buffers are not saved: recomputed
    input_ids, attention_mask = padded_batch()
    with torch.no_grad():
        assert torch.equal(
            model(input_ids, attention_mask=attention_mask).logits,
            loaded(input_ids, attention_mask=attention_mask).logits,
        )


@pytest.mark.parametrize("is_causal", [False, True])
def test_packed_batches_compose_with_sliding_windows(is_causal):
    config = tiny_config(
        layer_types=SLIDING,
        sliding_window=2,
        is_causal=is_causal,
        position_embedding_type="rope",
        norm_placement="pre",
    )
    model = NormSwapModel(config).eval()
    first, second = torch.arange(3, 10)[None], torch.arange(20, 25)[None]
    packed = torch.cat([first, second], dim=1)
    position_ids = torch.cat([torch.arange(7), torch.arange(5)])[None]  # restarting: two sequences
    with torch.no_grad():
        together = model(packed, position_ids=position_ids).last_hidden_state
        alone = torch.cat([model(first).last_hidden_state, model(second).last_hidden_state], dim=1)
    assert (together - alone).abs().max().item() <= 1e-5

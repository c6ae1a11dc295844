import itertools

import pytest
import torch
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
)

from hf_normswap import (
    NormSwapForCausalLM,
    NormSwapForMaskedLM,
    NormSwapForQuestionAnswering,
    NormSwapForSequenceClassification,
    NormSwapForTokenClassification,
    NormSwapModel,
    mix_ln_placement,
)
from hf_normswap.model.configuration_normswap import NORM_PLACEMENTS, NORM_TYPES, POSITION_EMBEDDING_TYPES

from helpers import padded_batch, tiny_config


PLACEMENTS = [*NORM_PLACEMENTS, "mix_ln"]


def grid_config(placement, position, norm_type, **overrides):
    placement = mix_ln_placement(4, post_fraction=0.5) if placement == "mix_ln" else placement
    return tiny_config(
        norm_placement=placement,
        position_embedding_type=position,
        norm_type=norm_type,
        num_hidden_layers=4 if isinstance(placement, list) else 2,
        **overrides,
    )


@pytest.mark.parametrize(
    "placement, position, norm_type", list(itertools.product(PLACEMENTS, POSITION_EMBEDDING_TYPES, NORM_TYPES))
)
def test_every_variant_runs_forward_and_backward(placement, position, norm_type):
    config = grid_config(placement, position, norm_type)
    model = NormSwapForMaskedLM(config)
    input_ids, attention_mask = padded_batch()
    output = model(input_ids, attention_mask=attention_mask, labels=input_ids, output_hidden_states=True)
    assert output.logits.shape == (2, 9, config.vocab_size)
    assert len(output.hidden_states) == config.num_hidden_layers + 1
    assert torch.isfinite(output.loss)
    output.loss.backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("position", POSITION_EMBEDDING_TYPES)
@pytest.mark.parametrize("is_causal", [False, True])
def test_padding_does_not_change_real_tokens(placement, position, is_causal):
    model = NormSwapModel(grid_config(placement, position, "layernorm", is_causal=is_causal)).eval()
    input_ids, attention_mask = padded_batch(lengths=(9, 6))
    with torch.no_grad():
        padded = model(input_ids, attention_mask=attention_mask).last_hidden_state
        alone = model(input_ids[1:, :6]).last_hidden_state
    assert (padded[1, :6] - alone[0]).abs().max().item() <= 1e-5


@pytest.mark.parametrize("position", POSITION_EMBEDDING_TYPES)
def test_causal_outputs_ignore_later_tokens(position):
    model = NormSwapModel(tiny_config(is_causal=True, position_embedding_type=position)).eval()
    input_ids, _ = padded_batch(lengths=(9, 9))
    changed = input_ids.clone()
    changed[:, 5:] = (changed[:, 5:] + 7) % 98 + 1
    with torch.no_grad():
        original = model(input_ids).last_hidden_state
        altered = model(changed).last_hidden_state
    assert (original[:, :5] - altered[:, :5]).abs().max().item() <= 1e-6
    assert (original[:, 5:] - altered[:, 5:]).abs().max().item() > 1e-3


def test_bidirectional_outputs_see_later_tokens():
    model = NormSwapModel(tiny_config()).eval()
    input_ids, _ = padded_batch(lengths=(9, 9))
    changed = input_ids.clone()
    changed[:, -1] = changed[:, -1] % 98 + 1
    with torch.no_grad():
        delta = model(input_ids).last_hidden_state[:, 0] - model(changed).last_hidden_state[:, 0]
    assert delta.abs().max().item() > 1e-4


@pytest.mark.parametrize("position", POSITION_EMBEDDING_TYPES)
@pytest.mark.parametrize("is_causal", [False, True])
def test_eager_and_sdpa_agree(position, is_causal):
    config = tiny_config(position_embedding_type=position, is_causal=is_causal, num_key_value_heads=2, qk_norm=True)
    eager = NormSwapModel._from_config(config, attn_implementation="eager").eval()
    sdpa = NormSwapModel._from_config(config, attn_implementation="sdpa").eval()
    sdpa.load_state_dict(eager.state_dict())
    input_ids, attention_mask = padded_batch()
    with torch.no_grad():
        a = eager(input_ids, attention_mask=attention_mask).last_hidden_state
        b = sdpa(input_ids, attention_mask=attention_mask).last_hidden_state
    real = attention_mask.bool()
    assert (a[real] - b[real]).abs().max().item() <= 1e-5


def test_alibi_refuses_other_attention_implementations():
    model = NormSwapModel(tiny_config(position_embedding_type="alibi")).eval()
    model.config._attn_implementation = "flex_attention"
    with pytest.raises(ValueError, match="alibi.*'eager' or 'sdpa'"):
        model(torch.tensor([[1, 2, 3]]))


def test_alibi_slopes_follow_the_paper():
    from hf_normswap.model.positions_normswap import alibi_slopes

    assert torch.allclose(alibi_slopes(8), torch.tensor([2.0 ** -(i + 1) for i in range(8)]))
    six = alibi_slopes(6)
    assert six.shape == (6,) and torch.allclose(six[:4], torch.tensor([2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8]))
    assert torch.allclose(six[4:], torch.tensor([2.0**-1, 2.0**-3]))


def test_deepnorm_scales_residual_and_init():
    config = tiny_config(norm_placement="deepnorm", num_hidden_layers=8, initializer_range=0.5, hidden_size=64)
    model = NormSwapModel(config)
    layer = model.layers[0]
    assert layer.attention_norms.residual_scale == pytest.approx(16**0.25)
    beta = 64**-0.25
    assert layer.self_attn.v_proj.weight.std().item() == pytest.approx(0.5 * beta, rel=0.1)
    assert layer.mlp.down_proj.weight.std().item() == pytest.approx(0.5 * beta, rel=0.1)
    assert layer.self_attn.q_proj.weight.std().item() == pytest.approx(0.5, rel=0.1)


def test_placement_formulas_by_hand():
    """Each placement computes the formula in its docstring, checked against a hand-written layer."""
    for placement in NORM_PLACEMENTS:
        config = tiny_config(norm_placement=placement, num_hidden_layers=2)
        model = NormSwapModel(config).eval()
        layer = model.layers[1]  # at depth 2
        for norm in layer.modules():
            if isinstance(norm, torch.nn.LayerNorm):
                torch.nn.init.normal_(norm.weight)
                torch.nn.init.normal_(norm.bias)
            if getattr(norm, "residual_weight", None) is not None:
                torch.nn.init.normal_(norm.residual_weight)
        x = torch.randn(2, 5, 32)
        attn = lambda h: layer.self_attn(h)[0]  # noqa: E731
        a, m = layer.attention_norms, layer.mlp_norms
        alpha = config.deepnorm_alpha if placement == "deepnorm" else 1.0
        expected = {
            "post": lambda x, f, n: n.residual_norm(x + f(x)),
            "pre": lambda x, f, n: x + f(n.input_norm(x)),
            "sandwich": lambda x, f, n: x + n.output_norm(f(n.input_norm(x))),
            "pre_post": lambda x, f, n: n.residual_norm(x + f(n.input_norm(x))),
            "deepnorm": lambda x, f, n: n.residual_norm(alpha * x + f(x)),
            "output": lambda x, f, n: x + n.output_norm(f(x)),
            "lns": lambda x, f, n: x + f(n.input_norm(x) / 2**0.5),
            "admin": lambda x, f, n: n.residual_norm(n.residual_weight * x + f(x)),
            "none": lambda x, f, n: x + f(x),
        }[placement]
        with torch.no_grad():
            reference = expected(expected(x, attn, a), layer.mlp, m)
            assert (layer(x) - reference).abs().max().item() <= 1e-5, placement


HEADS = [
    (NormSwapModel, AutoModel, {}),
    (NormSwapForMaskedLM, AutoModelForMaskedLM, {}),
    (NormSwapForSequenceClassification, AutoModelForSequenceClassification, {"num_labels": 3}),
    (NormSwapForTokenClassification, AutoModelForTokenClassification, {"num_labels": 5}),
    (NormSwapForQuestionAnswering, AutoModelForQuestionAnswering, {}),
    (NormSwapForCausalLM, AutoModelForCausalLM, {"is_causal": True}),
]


@pytest.mark.parametrize("model_class, auto_class, overrides", HEADS)
def test_head_shapes_and_auto_classes(model_class, auto_class, overrides):
    config = tiny_config(**overrides)
    model = auto_class.from_config(config, attn_implementation="eager")
    assert type(model) is model_class
    input_ids, attention_mask = padded_batch()
    out = model(input_ids, attention_mask=attention_mask, output_hidden_states=True, output_attentions=True)
    expected = {
        NormSwapModel: ("last_hidden_state", (2, 9, 32)),
        NormSwapForMaskedLM: ("logits", (2, 9, 99)),
        NormSwapForSequenceClassification: ("logits", (2, 3)),
        NormSwapForTokenClassification: ("logits", (2, 9, 5)),
        NormSwapForQuestionAnswering: ("start_logits", (2, 9)),
        NormSwapForCausalLM: ("logits", (2, 9, 99)),
    }[model_class]
    assert getattr(out, expected[0]).shape == expected[1]
    assert len(out.hidden_states) == 3 and len(out.attentions) == 2
    assert out.attentions[0].shape == (2, 4, 9, 9)
    as_tuple = model(input_ids, attention_mask=attention_mask, return_dict=False)
    assert isinstance(as_tuple, tuple) and torch.equal(as_tuple[0], getattr(out, expected[0]))


def test_causal_lm_needs_causal_config():
    with pytest.raises(ValueError, match="is_causal=True"):
        NormSwapForCausalLM(tiny_config())


@pytest.mark.parametrize("pooling", ["cls", "mean", "last"])
def test_sequence_pooling(pooling):
    model = NormSwapForSequenceClassification(tiny_config(classifier_pooling=pooling)).eval()
    input_ids, attention_mask = padded_batch()
    with torch.no_grad():
        hidden = model.model(input_ids, attention_mask=attention_mask).last_hidden_state
        pooled = model.pooler(hidden, attention_mask)
    reference = {
        "cls": lambda: torch.tanh(model.pooler.dense(hidden[:, 0])),
        "mean": lambda: torch.stack([hidden[0, :9].mean(0), hidden[1, :6].mean(0)]),
        "last": lambda: torch.stack([hidden[0, 8], hidden[1, 5]]),
    }[pooling]()
    assert (pooled - reference).abs().max().item() <= 1e-6


def test_inputs_embeds_and_token_type_ids():
    model = NormSwapModel(tiny_config()).eval()
    input_ids, attention_mask = padded_batch()
    token_type_ids = torch.zeros_like(input_ids)
    token_type_ids[:, 4:] = 1
    with torch.no_grad():
        by_ids = model(input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids).last_hidden_state
        embeds = model.get_input_embeddings()(input_ids)
        by_embeds = model(inputs_embeds=embeds, attention_mask=attention_mask, token_type_ids=token_type_ids)
        no_types = model(input_ids, attention_mask=attention_mask).last_hidden_state
    assert torch.equal(by_ids, by_embeds.last_hidden_state)
    assert (by_ids - no_types).abs().max().item() > 1e-4
    with pytest.raises(ValueError, match="exactly one of input_ids or inputs_embeds"):
        model(input_ids, inputs_embeds=embeds)


def test_masked_lm_decoder_is_tied():
    model = NormSwapForMaskedLM(tiny_config())
    assert model.lm_head.decoder.weight is model.model.embeddings.word_embeddings.weight
    assert model.lm_head.decoder.bias is not None
    untied = NormSwapForCausalLM(tiny_config(is_causal=True, tie_word_embeddings=False))
    assert untied.lm_head.weight is not untied.model.embeddings.word_embeddings.weight


@pytest.mark.parametrize("model_class, auto_class, overrides", HEADS)
def test_save_and_load_is_bit_exact(tmp_path, model_class, auto_class, overrides):
    config = tiny_config(norm_type="dyt", position_embedding_type="rope", norm_placement="sandwich", **overrides)
    model = model_class(config).eval()
    model.save_pretrained(tmp_path)
    loaded = auto_class.from_pretrained(tmp_path).eval()
    assert type(loaded) is model_class
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    input_ids, attention_mask = padded_batch()
    with torch.no_grad():
        assert torch.equal(
            model(input_ids, attention_mask=attention_mask)[0], loaded(input_ids, attention_mask=attention_mask)[0]
        )
    auto_map = AutoConfig.from_pretrained(tmp_path).auto_map
    assert set(auto_map) == {"AutoConfig", *(auto.__name__ for _, auto, _ in HEADS)}
    assert (tmp_path / "modeling_normswap.py").exists() and (tmp_path / "configuration_normswap.py").exists()


@pytest.mark.parametrize("position", ["absolute", "rope", "alibi"])
def test_gradient_checkpointing_gives_the_same_gradients(position):
    config = tiny_config(position_embedding_type=position, norm_placement="pre")
    model = NormSwapForMaskedLM(config).train()
    input_ids, attention_mask = padded_batch()

    def gradients():
        model.zero_grad()
        model(input_ids, attention_mask=attention_mask, labels=input_ids).loss.backward()
        return {name: p.grad.clone() for name, p in model.named_parameters()}

    plain = gradients()
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    checkpointed = gradients()
    for name, grad in plain.items():
        assert torch.allclose(grad, checkpointed[name], atol=1e-7, rtol=0), name


@pytest.mark.parametrize("is_causal", [False, True])
def test_flex_attention_agrees_with_eager(is_causal):
    config = tiny_config(position_embedding_type="rope", is_causal=is_causal, num_key_value_heads=2)
    eager = NormSwapModel._from_config(config, attn_implementation="eager").eval()
    flex = NormSwapModel._from_config(config, attn_implementation="flex_attention").eval()
    flex.load_state_dict(eager.state_dict())
    input_ids, attention_mask = padded_batch()
    with torch.no_grad():
        a = eager(input_ids, attention_mask=attention_mask).last_hidden_state
        b = flex(input_ids, attention_mask=attention_mask).last_hidden_state
    assert flex.config._attn_implementation == "flex_attention"
    real = attention_mask.bool()
    assert (a[real] - b[real]).abs().max().item() <= 1e-5


def test_device_map_auto_places_the_model(tmp_path):
    model = NormSwapForMaskedLM(tiny_config()).eval()
    model.save_pretrained(tmp_path)
    placed = AutoModelForMaskedLM.from_pretrained(tmp_path, device_map="auto").eval()
    input_ids, attention_mask = padded_batch()
    with torch.no_grad():
        expected = model(input_ids, attention_mask=attention_mask).logits
        got = placed(input_ids.to(placed.device), attention_mask=attention_mask.to(placed.device)).logits.cpu()
    assert torch.equal(expected, got)
    module_names = {type(module).__name__ for module in placed.modules()}
    assert set(placed._no_split_modules) <= module_names

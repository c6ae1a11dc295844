"""GPT-2, Gemma 2, Gemma 3 (text) and OLMo 2: exact conversion for every head, padding, sliding windows, generation."""

import pytest
import torch
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

from hf_normswap import NormSwapConfig, convert_checkpoint
from hf_normswap.model.heads import HEAD_CLASSES
from hf_normswap.probes.probe_data import SENTENCES

from helpers import greedy, left_padded_prompts, save_source


CASES = [
    ("gpt2", "Model", "base"),
    ("gpt2", "LMHeadModel", "causal-lm"),
    ("gpt2", "ForSequenceClassification", "sequence-classification"),
    ("gemma2", "Model", "base"),
    ("gemma2", "ForCausalLM", "causal-lm"),
    ("gemma3_text", "TextModel", "base"),
    ("gemma3_text", "ForCausalLM", "causal-lm"),
    ("olmo2", "Model", "base"),
    ("olmo2", "ForCausalLM", "causal-lm"),
]
CAUSAL_LM = {"gpt2": "LMHeadModel", "gemma2": "ForCausalLM", "gemma3_text": "ForCausalLM", "olmo2": "ForCausalLM"}


def convert(tmp_path, model_type, suffix, name="out", **options):
    native = save_source(tmp_path / "source", model_type, suffix)
    report = convert_checkpoint(
        str(tmp_path / "source"), str(tmp_path / name), attention="causal", log=lambda _: None, **options
    )
    return native.eval(), report


@pytest.mark.parametrize("model_type, suffix, head", CASES, ids=[f"{t}-{s}" for t, s, _ in CASES])
def test_conversion_is_exact_for_every_head(tmp_path, model_type, suffix, head):
    native, report = convert(tmp_path, model_type, suffix)
    assert report["head"] == head and report["measured"]["mode"] == "causal"
    assert report["measured"]["last_hidden_state_max_abs_diff"] <= 1e-5
    logits = report["measured"]["logits_max_abs_diff"]
    assert (logits is None) == (head == "base") and (logits is None or logits <= 1e-4)

    # loaded the ordinary way, on real sentences padded on the right
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "out")
    batch = tokenizer(SENTENCES, padding=True, return_tensors="pt", return_token_type_ids=False)
    ours = HEAD_CLASSES[head].from_pretrained(tmp_path / "out").eval()
    native.config.pad_token_id = tokenizer.pad_token_id
    with torch.no_grad():
        expected, got = native(**batch)[0], ours(**batch)[0]
    difference = (expected - got).abs()
    real = batch["attention_mask"].bool()
    assert (difference[real] if difference.shape[:2] == real.shape else difference).max().item() <= 1e-4


@pytest.mark.parametrize("model_type", CAUSAL_LM)
def test_padding_does_not_change_real_tokens(tmp_path, model_type):
    convert(tmp_path, model_type, CAUSAL_LM[model_type])
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "out")
    batch = tokenizer(SENTENCES[:3], padding=True, return_tensors="pt", return_token_type_ids=False)
    with torch.no_grad():
        padded = model(**batch).logits
        for row, sentence in enumerate(SENTENCES[:3]):
            alone = model(**tokenizer(sentence, return_tensors="pt", return_token_type_ids=False)).logits[0]
            assert (padded[row, : alone.shape[0]] - alone).abs().max().item() <= 1e-5


@pytest.mark.parametrize("model_type", ["gemma2", "gemma3_text"])
def test_sliding_window_layers_match_beyond_the_window(tmp_path, model_type):
    native, _ = convert(tmp_path, model_type, "ForCausalLM")
    config = NormSwapConfig.from_pretrained(tmp_path / "out")
    assert config.layer_types == ["sliding_attention", "full_attention"] and config.sliding_window == 4
    windowed = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    unwindowed = AutoModelForCausalLM.from_pretrained(tmp_path / "out", layer_types=["full_attention"] * 2).eval()
    input_ids = torch.randint(3, native.config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = native(input_ids).logits
        assert (windowed(input_ids).logits - expected).abs().max().item() <= 1e-4
        assert (unwindowed(input_ids).logits - expected).abs().max().item() > 1e-3  # the window matters at 20


def test_gemma_folds_the_norm_offset_and_scales_embeddings(tmp_path):
    native, _ = convert(tmp_path, "gemma3_text", "ForCausalLM")
    config = NormSwapConfig.from_pretrained(tmp_path / "out")
    assert config.norm_placement == "sandwich" and config.qk_norm and config.qk_norm_scope == "head"
    assert config.embedding_multiplier == pytest.approx(32**0.5) and config.query_pre_attn_scalar == 16
    assert set(config.rope_parameters) == {"full_attention", "sliding_attention"}
    ours = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    layer = native.model.layers[0]
    for native_norm, our_norm in [
        (layer.input_layernorm, ours.model.layers[0].attention_norms.input_norm),
        (layer.post_attention_layernorm, ours.model.layers[0].attention_norms.output_norm),
        (layer.pre_feedforward_layernorm, ours.model.layers[0].mlp_norms.input_norm),
        (layer.post_feedforward_layernorm, ours.model.layers[0].mlp_norms.output_norm),
        (layer.self_attn.q_norm, ours.model.layers[0].self_attn.q_norm),
    ]:
        assert torch.equal(our_norm.weight, 1.0 + native_norm.weight)


def test_olmo2_normalizes_the_whole_projection(tmp_path):
    convert(tmp_path, "olmo2", "ForCausalLM")
    config = NormSwapConfig.from_pretrained(tmp_path / "out")
    assert (config.norm_placement, config.qk_norm_scope) == ("output", "projection")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert model.model.layers[0].self_attn.q_norm.weight.shape == (32,)  # 4 heads x 8
    assert model.model.layers[0].self_attn.k_norm.weight.shape == (16,)  # 2 kv heads x 8


def test_gpt2_conv1d_weights_are_transposed_and_split(tmp_path):
    native, _ = convert(tmp_path, "gpt2", "LMHeadModel")
    ours = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    c_attn = native.transformer.h[1].attn.c_attn
    attention = ours.model.layers[1].self_attn
    q, k, v = c_attn.weight.t().chunk(3)
    assert torch.equal(attention.q_proj.weight, q) and torch.equal(attention.v_proj.weight, v)
    assert torch.equal(attention.k_proj.bias, c_attn.bias.chunk(3)[1])
    assert torch.equal(ours.model.layers[1].mlp.up_proj.weight, native.transformer.h[1].mlp.c_fc.weight.t())


@pytest.mark.parametrize("model_type", CAUSAL_LM)
def test_generation_matches_native_greedy_tokens(tmp_path, model_type):
    native, _ = convert(tmp_path, model_type, CAUSAL_LM[model_type])
    ours = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    input_ids, attention_mask = left_padded_prompts(native.config.vocab_size)
    expected, got = greedy(native, input_ids, attention_mask), greedy(ours, input_ids, attention_mask)
    assert got.shape[1] == input_ids.shape[1] + 32 and torch.equal(expected, got)


@pytest.mark.parametrize("model_type, placement", [("gemma2", "pre"), ("olmo2", "post"), ("gpt2", "sandwich")])
def test_swapped_variants_generate(tmp_path, model_type, placement):
    _, report = convert(tmp_path, model_type, CAUSAL_LM[model_type], norm_placement=placement)
    assert report["swap_effect"]["metric"] == "perplexity"
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert model.config.layer_norm_placements == [placement] * 2
    input_ids, attention_mask = left_padded_prompts(model.config.vocab_size)
    tokens = greedy(model, input_ids, attention_mask)
    assert tokens.shape == (2, input_ids.shape[1] + 32)


def test_bidirectional_conversion_keeps_windows_and_verifies_causally(tmp_path):
    save_source(tmp_path / "source", "gemma2", "ForCausalLM")
    report = convert_checkpoint(
        str(tmp_path / "source"), str(tmp_path / "out"), attention="bidirectional", log=lambda _: None
    )
    assert report["head"] == "base" and report["measured"]["mode"] == "causal"
    model = AutoModel.from_pretrained(tmp_path / "out")
    assert model.config.is_causal is False and model.config.sliding_window == 4
    assert model.config._attn_implementation == "eager"  # sdpa cannot soft-cap


def test_unsupported_source_settings_are_refused(tmp_path):
    save_source(tmp_path / "source", "gpt2", "LMHeadModel", scale_attn_by_inverse_layer_idx=True)
    with pytest.raises(ValueError, match="gpt2 with scale_attn_by_inverse_layer_idx=True is not supported"):
        convert_checkpoint(str(tmp_path / "source"), str(tmp_path / "out"), attention="causal")
    assert not (tmp_path / "out").exists()


def tensors(folder):
    from safetensors.torch import load_file

    return load_file(folder / "model.safetensors")


@pytest.mark.parametrize(
    "model_type, suffix",
    [
        ("gpt2", "LMHeadModel"),
        ("gpt2", "ForSequenceClassification"),
        ("olmo2", "ForCausalLM"),
        ("gemma2", "ForCausalLM"),
        ("gemma3_text", "ForCausalLM"),
        ("gemma3_text", "TextModel"),
    ],
)
def test_export_native_round_trip(tmp_path, model_type, suffix):
    from hf_normswap.cli import main as cli

    native, _ = convert(tmp_path, model_type, suffix)
    assert cli(["export-native", str(tmp_path / "out"), str(tmp_path / "back")]) == 0
    original, back = tensors(tmp_path / "source"), tensors(tmp_path / "back")
    assert set(original) == set(back)
    config = AutoModel.from_pretrained(tmp_path / "back").config
    assert config.model_type == native.config.model_type and config.architectures == native.config.architectures
    for name, tensor in original.items():
        if model_type.startswith("gemma") and name.endswith("norm.weight"):
            # Gemma's (1 + w) is folded into NormSwap's w and unfolded on the way back, exact to float32's rounding
            # of 1 + w; from NormSwap to Gemma and back is bit-exact
            assert (tensor - back[name]).abs().max().item() <= 2**-24, name
        else:
            assert torch.equal(tensor, back[name]), name
    if model_type.startswith("gemma"):
        assert (
            convert_checkpoint(
                str(tmp_path / "back"), str(tmp_path / "again"), attention="causal", log=lambda _: None
            )["measured"]["last_hidden_state_max_abs_diff"]
            <= 1e-5
        )
        first, again = tensors(tmp_path / "out"), tensors(tmp_path / "again")
        assert all(torch.equal(first[name], again[name]) for name in first)


def test_export_names_the_blocking_fields(tmp_path, capsys):
    from hf_normswap.cli import main as cli

    convert(tmp_path, "gemma2", "ForCausalLM", norm_placement="pre")
    capsys.readouterr()
    assert cli(["export-native", str(tmp_path / "out"), str(tmp_path / "back")]) == 1
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and "norm_placement='pre' (needs sandwich)" in error
    assert not (tmp_path / "back").exists()

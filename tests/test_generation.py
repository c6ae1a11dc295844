"""Generation with Transformers' caches: converted causal models write exactly the native model's greedy tokens."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, pipeline

from hf_normswap import NormSwapForCausalLM, convert_checkpoint

from helpers import NEW_TOKENS, greedy, left_padded_prompts, padded_batch, save_source, tiny_config


def assert_generates_as_native(tmp_path, model_type, **overrides):
    native = save_source(tmp_path / "source", model_type, "ForCausalLM", **overrides)
    convert_checkpoint(str(tmp_path / "source"), str(tmp_path / "out"), attention="causal", log=lambda _: None)
    native = AutoModelForCausalLM.from_pretrained(tmp_path / "source").eval()
    ours = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(ours) is NormSwapForCausalLM
    input_ids, attention_mask = left_padded_prompts(native.config.vocab_size)
    expected, got = greedy(native, input_ids, attention_mask), greedy(ours, input_ids, attention_mask)
    assert got.shape == (2, input_ids.shape[1] + NEW_TOKENS)
    assert torch.equal(expected, got)
    return ours


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_llama_family_generates_the_native_greedy_tokens(tmp_path, model_type):
    assert_generates_as_native(tmp_path, model_type)


def test_sliding_window_cache_generates_as_mistral(tmp_path):
    ours = assert_generates_as_native(tmp_path, "mistral", sliding_window=5)
    assert ours.config.layer_types == ["sliding_attention"] * 2 and ours.config.sliding_window == 5
    cache = DynamicCache(config=ours.config)
    assert all(layer.is_sliding for layer in cache.layers)


def test_cache_gives_the_same_logits_as_recomputing():
    for position in ("rope", "alibi", "absolute", "sinusoidal"):
        model = NormSwapForCausalLM(
            tiny_config(
                is_causal=True,
                position_embedding_type=position,
                norm_placement="pre",
                layer_types=["sliding_attention", "full_attention"],
                sliding_window=3,
            )
        ).eval()
        input_ids, _ = padded_batch(lengths=(10, 10))
        with torch.no_grad():
            full = model(input_ids).logits
            cache = DynamicCache(config=model.config)
            first = model(input_ids[:, :6], past_key_values=cache, use_cache=True)
            steps = [
                model(input_ids[:, i : i + 1], past_key_values=cache, use_cache=True).logits for i in range(6, 10)
            ]
        stepped = torch.cat([first.logits, *steps], dim=1)
        assert (stepped - full).abs().max().item() <= 1e-5, position


def test_cache_is_taken_by_either_name():
    """Transformers 5.24 renamed the cache argument `past_key_values` to `cache`: the model takes either, not both."""
    model = NormSwapForCausalLM(tiny_config(is_causal=True, norm_placement="pre")).eval()
    input_ids, _ = padded_batch(lengths=(10, 10))
    stepped = {}
    with torch.no_grad():
        full = model(input_ids).logits[:, 6:]
        for name in ("cache", "past_key_values"):
            cache = DynamicCache(config=model.config)
            model(input_ids[:, :6], **{name: cache})
            stepped[name] = model(input_ids[:, 6:], **{name: cache}).logits
            assert cache.get_seq_length() == 10, name
    assert (stepped["cache"] - full).abs().max().item() <= 1e-5
    assert torch.equal(stepped["cache"], stepped["past_key_values"])
    with pytest.raises(ValueError, match="as `cache` or as `past_key_values`, not both"):
        model(input_ids, cache=DynamicCache(config=model.config), past_key_values=DynamicCache(config=model.config))


def test_text_generation_pipeline_and_a_swapped_variant(tmp_path):
    save_source(tmp_path / "source", "llama", "ForCausalLM")
    convert_checkpoint(
        str(tmp_path / "source"),
        str(tmp_path / "swapped"),
        attention="causal",
        norm_placement="post",
        log=lambda _: None,
    )
    generator = pipeline("text-generation", model=str(tmp_path / "swapped"))
    text = generator("the cat sat on the", max_new_tokens=8, do_sample=False)[0]["generated_text"]
    assert text.startswith("the cat sat on the") and len(text.split()) > 5
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "swapped")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "swapped")
    prompt = tokenizer("the cat sat on the", return_tensors="pt")
    tokens = model.generate(**prompt, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    from_pipeline = generator(
        "the cat sat on the", max_new_tokens=8, min_new_tokens=8, do_sample=False, return_tensors=True
    )[0]["generated_token_ids"]
    assert list(from_pipeline) == tokens[0].tolist()


def test_generate_command_is_the_pipeline(tmp_path, capsys):
    from hf_normswap.cli import main as cli

    save_source(tmp_path / "source", "llama", "ForCausalLM")
    convert_checkpoint(str(tmp_path / "source"), str(tmp_path / "out"), attention="causal", log=lambda _: None)
    capsys.readouterr()
    assert (
        cli(
            [
                "generate",
                str(tmp_path / "out"),
                "--prompt",
                "the cat sat",
                "--prompt",
                "paris is",
                "--max-new-tokens",
                "6",
            ]
        )
        == 0
    )
    lines = capsys.readouterr().out.strip().splitlines()
    generator = pipeline("text-generation", model=str(tmp_path / "out"))
    expected = [
        generator(prompt, max_new_tokens=6, do_sample=False)[0]["generated_text"]
        for prompt in ("the cat sat", "paris is")
    ]
    assert lines == expected

    convert_checkpoint(
        str(tmp_path / "source"), str(tmp_path / "encoder"), attention="bidirectional", log=lambda _: None
    )
    assert cli(["generate", str(tmp_path / "encoder"), "--prompt", "the cat"]) == 1
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and "is_causal=True" in error


def test_config_use_cache_is_honoured():
    model = NormSwapForCausalLM(tiny_config(is_causal=True, norm_placement="pre")).eval()
    input_ids, _ = padded_batch()
    assert model(input_ids, use_cache=True).past_key_values.get_seq_length() == 9
    model.config.use_cache = False  # as the Trainer sets it for gradient checkpointing
    assert model(input_ids).past_key_values is None
    assert model(input_ids, use_cache=True).past_key_values is not None

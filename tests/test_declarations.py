"""What the model declares to Transformers, and that each declaration holds: how the Trainer may scale each head's
loss (2 processes report what 1 does), the cache a causal forward returns, static caches and fullgraph compilation,
rope parameters only for RoPE, and a tensor-parallel plan (2 CPU processes compute what 1 does)."""

import json

import pytest
import torch
from torch import nn
from transformers import AutoConfig, DynamicCache, Trainer, TrainingArguments

from hf_normswap import (
    NormSwapConfig,
    NormSwapForCausalLM,
    NormSwapForMaskedLM,
    NormSwapForQuestionAnswering,
    NormSwapForSequenceClassification,
    NormSwapForTokenClassification,
    NormSwapModel,
)

from helpers import LLAMA_LIKE, left_padded_prompts, padded_batch, tiny_config
from launches import TESTS, torchrun


LLAMA = LLAMA_LIKE
DECODERS = {  # the configurations Transformers' common tests were run on, and a Gemma-like one
    "llama": LLAMA,
    "sandwich-alibi": dict(norm_placement="sandwich", position_embedding_type="alibi"),
    "deepnorm-dyt-sinusoidal": dict(norm_placement="deepnorm", norm_type="dyt", position_embedding_type="sinusoidal"),
    "gemma-like": dict(
        norm_placement="sandwich",
        norm_type="rmsnorm",
        position_embedding_type="rope",
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=4,
        qk_norm=True,
        attn_logit_softcapping=3.0,
        final_logit_softcapping=5.0,
        attn_implementation="eager",
    ),
}
CONFIGS = {"bert-like": {}, **{name: dict(fields, is_causal=True) for name, fields in DECODERS.items()}}


def greedy(model, **kwargs):
    input_ids, attention_mask = left_padded_prompts(model.config.vocab_size)
    return model.generate(
        input_ids,
        attention_mask=attention_mask,
        max_new_tokens=12,
        min_new_tokens=12,
        do_sample=False,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
        **kwargs,
    )


def held(config) -> dict:
    """What a config holds, less where it was loaded from."""
    return {key: value for key, value in config.to_dict().items() if key != "_name_or_path"}


def assert_same_generation(expected, got, tolerance=1e-5):
    assert torch.equal(expected.sequences, got.sequences)
    assert max((a - b).abs().max().item() for a, b in zip(expected.logits, got.logits)) <= tolerance


# Losses under data parallelism


def test_heads_declare_whether_the_trainer_may_rescale_their_loss(tmp_path):
    """Heads averaging their own loss refuse the loss kwargs; token-level losses take `num_items_in_batch`."""
    expected = {
        NormSwapForSequenceClassification: False,
        NormSwapForQuestionAnswering: False,
        NormSwapForTokenClassification: True,
        NormSwapForMaskedLM: True,
        NormSwapForCausalLM: True,
    }
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    for model_class, accepts in expected.items():
        model = model_class(tiny_config(is_causal=model_class is NormSwapForCausalLM))
        assert getattr(model_class, "accepts_loss_kwargs", True) is accepts
        assert Trainer(model=model, args=args).model_accepts_loss_kwargs is accepts, model_class.__name__


def test_two_processes_report_the_losses_of_one(tmp_path):
    """Every head, a few Trainer steps: 2 processes of 4 examples log the per-step loss, gradient norm and eval loss
    of 1 process of 8 (to 1e-5; measured: under 1e-6). Before the declaration, 2 processes read 1.388 for 0.694."""
    torchrun(TESTS / "distributed_loss.py", tmp_path / "two.json", 4, processes=2, cwd=tmp_path)
    torchrun(TESTS / "distributed_loss.py", tmp_path / "one.json", 8, processes=1, cwd=tmp_path)
    two, one = (json.loads((tmp_path / f"{name}.json").read_text()) for name in ("two", "one"))
    assert set(two) == {
        "sequence-classification",
        "token-classification",
        "question-answering",
        "masked-lm",
        "causal-lm",
    }
    for head, expected in one.items():
        got = two[head]
        assert len(got["loss"]) == len(expected["loss"]) == 4, head
        for key in ("loss", "grad_norm"):
            assert max(abs(a - b) for a, b in zip(got[key], expected[key])) <= 1e-5, (head, key, got, expected)
        assert abs(got["eval_loss"] - expected["eval_loss"]) <= 1e-5, (head, got, expected)
    assert abs(two["sequence-classification"]["loss"][0] - 0.6931) <= 0.05  # two classes, untrained: about ln 2


# Cache


def test_a_causal_forward_returns_its_cache_as_llama():
    assert NormSwapConfig().use_cache is True
    input_ids, _ = padded_batch(lengths=(10, 10))
    for model_class in (NormSwapForCausalLM, NormSwapModel):
        model = model_class(tiny_config(is_causal=True, **LLAMA)).eval()
        with torch.no_grad():
            full = model(input_ids)
            first = model(input_ids[:, :7])
            assert isinstance(first.past_key_values, DynamicCache) and first.past_key_values.get_seq_length() == 7
            rest = model(input_ids[:, 7:], past_key_values=first.past_key_values)
            assert model(input_ids, use_cache=False).past_key_values is None
        assert full.past_key_values.get_seq_length() == 10 and rest.past_key_values.get_seq_length() == 10
        name = "logits" if model_class is NormSwapForCausalLM else "last_hidden_state"
        stepped = torch.cat([getattr(first, name), getattr(rest, name)], dim=1)
        assert (stepped - getattr(full, name)).abs().max().item() <= 1e-5
    encoder = NormSwapModel(tiny_config()).eval()
    assert encoder.config.use_cache and encoder(input_ids).past_key_values is None  # bidirectional: no cache


@pytest.mark.parametrize("name", DECODERS)
def test_generation_with_no_dynamic_or_static_cache_agrees(name):
    """Greedy tokens equal and logits within 1e-5 (measured: under 2e-7) for every cache."""
    model = NormSwapForCausalLM(tiny_config(is_causal=True, **DECODERS[name])).eval()
    assert model._can_compile_fullgraph
    dynamic = greedy(model)
    assert_same_generation(dynamic, greedy(model, use_cache=False))
    assert_same_generation(dynamic, greedy(model, cache_implementation="static"))


@pytest.mark.parametrize("name", ["llama", "sandwich-alibi"])
def test_fullgraph_compiled_forward_equals_eager(name):
    """`torch.compile(fullgraph=True)` on CPU (aot_eager: the graph capture that `fullgraph` is about; inductor
    takes a minute a model here): a padded forward, and static-cache generation with the compiled forward."""
    torch._dynamo.reset()
    model = NormSwapForCausalLM(tiny_config(is_causal=True, attn_implementation="sdpa", **DECODERS[name])).eval()
    input_ids, attention_mask = padded_batch()
    with torch.no_grad():
        eager_logits = model(input_ids, attention_mask=attention_mask).logits
    eager = greedy(model, cache_implementation="static")
    model.forward = torch.compile(model.forward, fullgraph=True, backend="aot_eager")  # a graph break raises
    with torch.no_grad():
        compiled_logits = model(input_ids, attention_mask=attention_mask).logits
    assert (compiled_logits - eager_logits).abs().max().item() <= 1e-5
    assert_same_generation(eager, greedy(model, cache_implementation="static"))


# Rope parameters


@pytest.mark.parametrize("name", [*CONFIGS, "rope-per-layer-type"])
def test_config_round_trip(tmp_path, name):
    fields = (
        CONFIGS[name]
        if name in CONFIGS
        else dict(
            position_embedding_type="rope",
            layer_types=["sliding_attention", "full_attention"],
            sliding_window=3,
            rope_parameters={"full_attention": {"rope_theta": 1e6}, "sliding_attention": {"rope_theta": 1e4}},
        )
    )
    config = tiny_config(**fields, num_labels=3)
    rope = config.position_embedding_type == "rope"
    assert (config.rope_parameters is not None) is rope
    assert NormSwapConfig.from_dict(json.loads(config.to_json_string())).to_dict() == config.to_dict()
    config.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert (saved["rope_parameters"] == config.rope_parameters is not None) is rope and saved["use_cache"] is True
    loaded = AutoConfig.from_pretrained(tmp_path)
    assert type(loaded) is NormSwapConfig and held(loaded) == held(config)
    assert loaded.num_labels == 3 and loaded.use_cache is True
    if name == "llama":
        assert loaded.rope_parameters == {"rope_type": "default", "rope_theta": 10000.0}


@pytest.mark.parametrize("position", ["absolute", "sinusoidal", "alibi", "none"])
def test_old_configs_with_rope_parameters_still_load_and_compute_the_same(tmp_path, position):
    model = NormSwapForMaskedLM(tiny_config(position_embedding_type=position)).eval()
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["rope_parameters"] is None
    saved["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}  # as every config was saved before
    (tmp_path / "config.json").write_text(json.dumps(saved))
    loaded = NormSwapForMaskedLM.from_pretrained(tmp_path).eval()
    assert loaded.config.rope_parameters is None and held(loaded.config) == held(model.config)
    input_ids, attention_mask = padded_batch()
    with torch.no_grad():
        assert torch.equal(
            loaded(input_ids, attention_mask=attention_mask).logits,
            model(input_ids, attention_mask=attention_mask).logits,
        )


def test_changing_the_position_scheme_drops_or_fills_the_rope_parameters():
    rope = tiny_config(position_embedding_type="rope", rope_parameters={"rope_type": "linear", "factor": 2.0})
    assert rope.rope_parameters == {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    alibi = NormSwapConfig.from_dict({**rope.to_dict(), "position_embedding_type": "alibi"})
    assert alibi.rope_parameters is None and alibi.layer_rope_parameters == {"full_attention": {}}
    back = NormSwapConfig.from_dict({**alibi.to_dict(), "position_embedding_type": "rope"})
    assert back.rope_parameters == {"rope_type": "default", "rope_theta": 10000.0}
    with pytest.raises(ValueError, match="rope_parameters=.*rope_type must be in"):  # still checked before dropped
        tiny_config(position_embedding_type="absolute", rope_parameters={"rope_type": "spiral"})


# Tensor parallelism


def generic(name: str) -> str:
    """A module name with the layer numbers replaced by `*`, as the plans name them."""
    return ".".join("*" if part.isdigit() else part for part in name.split("."))


PLAN_CONFIGS = {
    **CONFIGS,
    "qk-norm-projection": dict(is_causal=True, qk_norm=True, qk_norm_scope="projection"),
    "standard-mlp-gqa": dict(num_key_value_heads=2),
}


@pytest.mark.parametrize("name", PLAN_CONFIGS)
def test_tensor_parallel_plan_names_existing_modules(name):
    config = tiny_config(**PLAN_CONFIGS[name])
    plan, modules = config.base_model_tp_plan, dict(NormSwapModel(config).named_modules())
    assert set(plan) <= {generic(module_name) for module_name in modules}  # every rule names modules of this model
    projections = {
        generic(module_name)
        for module_name, module in modules.items()
        if isinstance(module, nn.Linear) and (".self_attn." in module_name or ".mlp." in module_name)
    }
    assert projections <= set(plan)  # every projection is split
    split_heads = config.position_embedding_type != "alibi" and config.qk_norm_scope == "head"
    assert plan["layers.*.self_attn.q_proj"] == ("colwise" if split_heads else "colwise_gather_output")
    assert plan["layers.*.self_attn.o_proj"] == ("rowwise" if split_heads else "rowwise_split_input")
    assert ("layers.*.mlp.gate_proj" in plan) is (config.mlp_type == "glu")
    assert ("layers.*.self_attn.q_norm" in plan) is (config.qk_norm and split_heads)
    assert plan["embeddings.word_embeddings"] == "embedding_rowwise"
    causal = config.is_causal
    head = (NormSwapForCausalLM if causal else NormSwapForMaskedLM)(config)
    assert head.tp_plan[("lm_head" if causal else "lm_head.decoder")] == "colwise_gather_output"
    assert head.tp_plan["model.layers.*.mlp.down_proj"] == "rowwise"


def test_tensor_parallel_on_two_cpu_processes_computes_what_one_does(tmp_path):
    """`from_pretrained(..., distributed_config=DistributedConfig(tp_size=2))` (the `tp_plan="auto"` of
    Transformers 5) under torchrun with gloo: logits, loss and every gradient within 1e-5 of the unsharded model
    (measured: under 1e-6), the same greedy tokens with dynamic and static caches."""
    torchrun(
        TESTS / "distributed_tensor_parallel.py", tmp_path / "tp.json", tmp_path / "models", processes=2, cwd=tmp_path
    )
    results = json.loads((tmp_path / "tp.json").read_text())
    assert len(results) == 5
    attention = {f"model.layers.*.self_attn.{name}_proj.weight" for name in "qkvo"}
    for name, result in results.items():
        assert max(result["logits"], result["loss"], result["gradients"]) <= 1e-5, (name, result)
        sharded = set(result["sharded"])
        expected = attention | {"model.embeddings.word_embeddings.weight", "model.layers.*.mlp.up_proj.weight"}
        assert expected | {"model.layers.*.mlp.down_proj.weight"} <= sharded, (name, sharded)
        if name.startswith(("llama", "alibi", "projection")):
            assert result["same_greedy_tokens_dynamic"] and result["same_greedy_tokens_static"], name
    assert "model.layers.*.mlp.gate_proj.weight" in results["llama-gqa-qk-norm"]["sharded"]
    assert "lm_head.weight" in results["llama-gqa-qk-norm"]["sharded"]  # untied: sharded over the vocabulary


def test_every_head_of_the_head_table_is_registered_exported_and_tagged():
    import transformers

    import hf_normswap
    from hf_normswap.model.heads import PIPELINE_TAGS, head_of_architecture
    from hf_normswap.model.modeling_normswap import AUTO_MAP, HEADS

    assert list(HEADS) == ["base", "masked-lm", "sequence-classification", "token-classification"] + [
        "question-answering",
        "causal-lm",
    ]
    for head, (model_class, auto_class, pipeline_tag) in HEADS.items():
        assert getattr(transformers, auto_class)._model_mapping[NormSwapConfig] is model_class
        assert AUTO_MAP[auto_class] == f"modeling_normswap.{model_class.__name__}"
        assert (
            getattr(hf_normswap, model_class.__name__) is model_class and model_class.__name__ in hf_normswap.__all__
        )
        assert head_of_architecture(model_class.__name__) == head and PIPELINE_TAGS[head] == pipeline_tag

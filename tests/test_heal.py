import json
import re
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModel, AutoTokenizer, BertConfig, BertModel, OPTConfig, OPTModel

import hf_normswap
from hf_normswap import convert_checkpoint, heal_checkpoint
from hf_normswap.cli import main as cli
from hf_normswap.compare.report import collapse_report_lines as report_lines
from hf_normswap.compare.report import summarize_collapse as summarize_runs
from hf_normswap.heal import models as heal_models
from hf_normswap.heal.checkpoints import CheckpointedHealing
from hf_normswap.heal.data import load_texts
from hf_normswap.heal.options import HealError, HealOptions
from hf_normswap.heal.report import HealReport
from hf_normswap.model import REMOTE_CODE_FILES
from hf_normswap.model.modeling_normswap import AUTO_MAP
from hf_normswap.probes.collapse import mean_pairwise_cosine
from hf_normswap.sharding import ShardingOptions

from helpers import SENTENCES, interrupted, save_source


HEAL = dict(max_steps=24, learning_rate=1e-3, batch_size=8, eval_size=16, log=None)


@pytest.fixture(scope="module")
def variant(tmp_path_factory):
    """A tiny BERT converted to pre-LN, and a text file to heal it on."""
    folder = tmp_path_factory.mktemp("heal")
    save_source(folder / "bert", "bert", "Model", initializer_range=0.2)  # inputs told apart, unlike at 0.02
    # Norms shifted only: far from the source (calibrated writes would start this tiny model at token cosine 0.97).
    convert_checkpoint(
        str(folder / "bert"), str(folder / "pre"), norm_placement="pre", calibrate=False, log=lambda line: None
    )
    (folder / "text.txt").write_text("\n".join(SENTENCES * 8) + "\n")
    return folder


def test_collapse_figure():
    assert mean_pairwise_cosine(torch.ones(1, 16).repeat(10, 1) * 3.0) == pytest.approx(1.0, abs=1e-9)
    assert abs(mean_pairwise_cosine(torch.randn(64, 128, generator=torch.Generator().manual_seed(0)))) < 0.5
    assert mean_pairwise_cosine(torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])) == pytest.approx(2**-0.5 * 2 / 3)


def test_conversion_records_collapse(variant):
    record = json.loads((variant / "pre" / "conversion.json").read_text())["collapse"]
    assert "SST-2" in record["probe"]
    for pooling in ("first_token", "mean"):
        assert len(record["source"][pooling]) == len(record["variant"][pooling]) == 3  # embeddings + 2 layers
        assert all(-1 <= value <= 1 for value in record["source"][pooling] + record["variant"][pooling])
    assert record["flagged"] == any(
        record["variant"][p][-1] > record["source"][p][-1] + 0.1 for p in ("first_token", "mean")
    )
    # The unswapped conversion has the source's figures.
    plain = convert_checkpoint(str(variant / "bert"), str(variant / "post"), log=lambda line: None)["collapse"]
    assert plain["variant"]["mean"] == pytest.approx(plain["source"]["mean"], abs=1e-5) and not plain["flagged"]


@pytest.mark.parametrize("objective", ["similarity", "cka", "hidden"])
def test_healing_reduces_distance(variant, objective):
    output = variant / f"healed-{objective}"
    report = heal_checkpoint(
        str(variant / "pre"), str(output), data=str(variant / "text.txt"), objective=objective, **HEAL
    )
    saved = json.loads((output / "heal.json").read_text())
    assert saved["teacher"] == str(variant / "bert") and saved["steps"] == 24 and saved["seconds"] > 0
    assert saved["tokens"] == report["tokens"] > 24 * HEAL["batch_size"]  # real tokens, more than one a text
    assert saved["objective"] == objective and len(saved["before"]) == len(saved["after"]) == 3
    before, after = report["before"][-1], report["after"][-1]
    assert after["token_cosine"] > before["token_cosine"] + 0.03, (before, after)
    assert after["mse"] < 0.8 * before["mse"], (before, after)
    assert [entry["step"] for entry in saved["history"]][0] == 0 and saved["history"][-1]["step"] == 24
    assert (output / "heal.png").stat().st_size > 0
    carried = json.loads((output / "conversion.json").read_text())
    assert carried.pop("heal")["after"] == saved["after"][-1]
    assert carried == json.loads((variant / "pre" / "conversion.json").read_text())
    # Trained without dropout (the default), saved with the variant's; the embeddings as converted (the default).
    assert saved["dropout"] is False
    configs = [json.loads((folder / "config.json").read_text()) for folder in (output, variant / "pre")]
    assert [config["hidden_dropout"] for config in configs] == [0.1, 0.1]
    assert saved["freeze_embeddings"] is True
    assert _embeddings_changed(output, variant / "pre") == {}

    # The healed folder is a checkpoint like convert's (code and auto_map: test_remote_code loads such folders without
    # the package), and it computes what was measured.
    assert json.loads((output / "config.json").read_text())["auto_map"] == AUTO_MAP
    for code in REMOTE_CODE_FILES:
        assert (output / code).read_text() == (Path(hf_normswap.__file__).parent / "model" / code).read_text()
    healed = AutoModel.from_pretrained(output, trust_remote_code=True).eval()
    teacher = AutoModel.from_pretrained(variant / "bert").eval()
    batch = AutoTokenizer.from_pretrained(output)(SENTENCES, padding=True, return_tensors="pt")
    with torch.no_grad():
        cosine = torch.nn.functional.cosine_similarity(
            healed(**batch).last_hidden_state, teacher(**batch).last_hidden_state, dim=-1
        )
    assert cosine[batch["attention_mask"].bool()].mean().item() > before["token_cosine"] + 0.03


def test_a_budget_in_tokens_sets_the_steps_of_any_student(variant, tmp_path):
    """An encoder's budget in tokens: as many whole steps of `batch_size` texts as the training split's mean length
    (over its first 1,024 texts) fills."""
    tokenizer = AutoTokenizer.from_pretrained(variant / "pre")
    texts = load_texts(str(variant / "text.txt"), held_out=HEAL["eval_size"])[0]["text"][:1024]
    mean = sum(len(tokenizer(text)["input_ids"]) for text in texts) / len(texts)
    options = dict(HEAL, max_steps=None, max_tokens=1000, batch_size=4, data=str(variant / "text.txt"))
    report = heal_checkpoint(str(variant / "pre"), str(tmp_path / "healed"), **options)
    assert report["steps"] == report["budget"]["steps"] == round(1000 / (4 * mean)) > 1
    assert report["budget"]["tokens"] == 1000


def test_a_file_without_validation_split_holds_out_eval_size_texts(variant, tmp_path):
    """A text file's held-out texts are `eval_size` of its lines (at most a tenth), more than the default 256 too."""
    (tmp_path / "long.txt").write_text("\n".join(f"{SENTENCES[i % len(SENTENCES)]} {i}" for i in range(4000)) + "\n")
    for eval_size, held_out in [(300, 300), (500, 400)]:
        options = dict(HEAL, max_steps=1, eval_size=eval_size, data=str(tmp_path / "long.txt"))
        report = heal_checkpoint(str(variant / "pre"), str(tmp_path / f"healed{eval_size}"), **options)
        assert report["data"]["held_out_rows"] == held_out


@pytest.mark.parametrize("name", ["sample_length", "batch_size", "max_length", "eval_size"])
def test_counts_are_whole_numbers(name):
    with pytest.raises(HealError, match=rf"^{name}=2.5 is invalid: at least 1$"):
        HealOptions(**{name: 2.5})


def test_heal_cli_bad_input(variant, tmp_path, capsys, monkeypatch):
    pre, out = str(variant / "pre"), str(tmp_path / "out")
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "blank.jsonl").write_text(json.dumps({"text": ""}) + "\n" + json.dumps({"text": " "}) + "\n")
    vocab_size = json.loads((variant / "pre" / "config.json").read_text())["vocab_size"]
    BertModel(
        BertConfig(
            vocab_size=vocab_size, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64
        )
    ).save_pretrained(tmp_path / "wide")
    OPTModel(
        OPTConfig(
            vocab_size=vocab_size,
            hidden_size=32,
            num_hidden_layers=2,
            ffn_dim=64,
            num_attention_heads=4,
            word_embed_proj_dim=32,
        )
    ).save_pretrained(tmp_path / "opt")
    no_record = tmp_path / "no-record"
    no_record.mkdir()
    for file in (variant / "pre").iterdir():
        if file.name != "conversion.json":
            (no_record / file.name).write_bytes(file.read_bytes())
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "file").write_text("x")
    cases = [
        ([str(no_record), out], "no conversion.json naming its source; pass --teacher"),
        ([pre, out, "--teacher", str(tmp_path / "wide")], "hidden_size 64 differs from the student's 32"),
        (
            [pre, out, "--teacher", str(tmp_path / "nowhere")],
            f"teacher {tmp_path / 'nowhere'}: no such folder or file",
        ),
        (
            [pre, out, "--teacher", str(tmp_path / "opt")],
            "model_type 'opt' is not supported; supported model types: bert",
        ),
        ([pre, out, "--data", str(tmp_path / "empty.jsonl")], "is empty"),
        ([pre, out, "--data", str(tmp_path / "blank.jsonl")], "holds no tokens"),
        ([pre, out, "--max-steps", "0"], "max_steps=0 is invalid"),
        ([pre, str(tmp_path / "taken")], "exists and is not empty; pass --overwrite"),
        ([pre, out, "--objective", "mlm"], "needs a masked-LM student"),
        ([pre, str(tmp_path / "taken" / "file" / "out")], f"{tmp_path / 'taken' / 'file'} is a file, not a folder"),
        (
            [pre, out, "--checkpoint-dir", str(tmp_path / "taken" / "file" / "ck")],
            f"is invalid: {tmp_path / 'taken' / 'file'} is a file; give a folder",
        ),
        ([pre, out, "--checkpoint-dir", str(tmp_path / "out" / "ck")], "is invalid: inside OUTPUT, which the healing"),
    ]
    capsys.readouterr()
    for arguments, message in cases:
        with monkeypatch.context() as patch:
            if message != "holds no tokens":  # found by the tokenizer, after loading
                patch.setattr(heal_models, "_load_student", lambda *args, **kwargs: pytest.fail("loaded"))
            assert cli(["heal", *arguments, "--eval-size", "8"]) == 1
        error = capsys.readouterr().err.strip()
        assert len(error.splitlines()) == 1 and message in error, error
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))
    assert [path.name for path in (tmp_path / "taken").iterdir()] == ["file"]


def test_a_rerun_resumes_whatever_memory_it_saves_or_path_it_names(variant, monkeypatch):
    """The record of a healing's checkpoints: the same for the same variant and text named by other paths, with
    activation checkpointing and another time budget; not for other training."""
    settings = {name: value for name, value in HEAL.items() if name != "log"}
    first = HealOptions(**settings, data=str(variant / "text.txt"), checkpoint_dir="a")
    record = CheckpointedHealing.of(str(variant / "pre"), first)
    monkeypatch.chdir(variant)
    sharding = ShardingOptions(activation_checkpointing=True)
    again = HealOptions(**settings, data="text.txt", checkpoint_dir="b", max_seconds=60.0, sharding=sharding)
    assert CheckpointedHealing.of("pre", again) == record
    assert CheckpointedHealing.of("pre", replace(again, learning_rate=2e-3)) != record


def test_collapse_flag_in_report():
    def run(start: float, source: float = 0.7) -> dict:
        profile = lambda value: {"first_token": [0.5, value], "mean": [0.5, 0.6]}  # noqa: E731
        return {
            "source_collapse": profile(source),
            "diagnostics": [{"step": 0, "collapse": profile(start)}, {"step": 10, "collapse": profile(0.75)}],
        }

    healthy, collapsed = summarize_runs([run(0.75), run(0.79)]), summarize_runs([run(0.99), run(0.97)])
    assert not healthy["flagged"] and collapsed["flagged"]
    assert collapsed["start"]["first_token"] == pytest.approx(0.98) and collapsed["end"][
        "first_token"
    ] == pytest.approx(0.75)
    lines = report_lines({"post": {"collapse": healthy}, "pre": {"collapse": collapsed}})
    assert any(line.startswith("| pre |") and "**collapsed**" in line for line in lines)
    assert any(line.startswith("| post |") and "**collapsed**" not in line for line in lines)
    assert summarize_runs([{"source_collapse": None, "diagnostics": [{"step": 0}]}]) is None


def test_heal_a_reswapped_normswap_checkpoint(variant):
    """A variant converted from a NormSwap checkpoint heals towards that checkpoint; healing stays in the lineage."""
    convert_checkpoint(str(variant / "bert"), str(variant / "ns-post"), log=lambda line: None)
    convert_checkpoint(
        str(variant / "ns-post"), str(variant / "ns-pre"), norm_placement="pre", calibrate=False, log=lambda line: None
    )
    report = heal_checkpoint(
        str(variant / "ns-pre"), str(variant / "ns-healed"), data=str(variant / "text.txt"), **HEAL
    )
    assert report["teacher"] == str(variant / "ns-post")
    assert report["after"][-1]["token_cosine"] > report["before"][-1]["token_cosine"] + 0.03
    again = convert_checkpoint(str(variant / "ns-healed"), str(variant / "ns-again"), log=lambda line: None)
    assert again["lineage"][-1]["heal"]["steps"] == HEAL["max_steps"]


def test_masked_lm_distillation(tmp_path):
    save_source(tmp_path / "bert", "bert", "ForMaskedLM", initializer_range=0.2)
    convert_checkpoint(
        str(tmp_path / "bert"), str(tmp_path / "pre"), norm_placement="pre", calibrate=False, log=lambda line: None
    )
    (tmp_path / "text.txt").write_text("\n".join(SENTENCES * 8) + "\n")
    report = heal_checkpoint(
        str(tmp_path / "pre"), str(tmp_path / "healed"), data=str(tmp_path / "text.txt"), objective="mlm", **HEAL
    )
    losses = report["masked_lm_loss"]
    assert losses["after"] < losses["before"] and losses["teacher"] > 0, losses
    assert report["after"][-1]["token_cosine"] > report["before"][-1]["token_cosine"]


def _embeddings_changed(healed: Path, converted: Path) -> dict:
    """The embedding tensors that healing changed, with their largest change."""
    before, after = (load_file(folder / "model.safetensors") for folder in (converted, healed))
    changes = {
        name: (after[name] - tensor).abs().max().item() for name, tensor in before.items() if "embeddings." in name
    }
    assert changes, "no embedding tensors"
    return {name: change for name, change in changes.items() if change > 0}


def test_unfrozen_embeddings_are_trained(variant):
    output = variant / "healed-unfrozen"
    assert (
        cli(
            [
                "heal",
                str(variant / "pre"),
                str(output),
                "--data",
                str(variant / "text.txt"),
                "--max-steps",
                "4",
                "--batch-size",
                "8",
                "--eval-size",
                "8",
                "--no-freeze-embeddings",
            ]
        )
        == 0
    )
    assert json.loads((output / "heal.json").read_text())["freeze_embeddings"] is False
    changed = _embeddings_changed(output, variant / "pre")
    assert "embeddings.word_embeddings.weight" in changed and min(changed.values()) > 1e-4, changed


@pytest.mark.parametrize("objective", ["similarity", "mlm"])
def test_packed_healing_is_padded_healing(tmp_path, objective):
    """Healing trains without dropout, so on padding-free batches it computes what it does on padded ones, step by
    step (the source is configured with dropout); with its dropout the two draw different masks."""
    save_source(tmp_path / "bert", "bert", "ForMaskedLM", initializer_range=0.2)
    convert_checkpoint(str(tmp_path / "bert"), str(tmp_path / "pre"), norm_placement="pre", log=lambda line: None)
    (tmp_path / "text.txt").write_text("\n".join(SENTENCES * 8) + "\n")
    reports = {
        (packing, dropout): heal_checkpoint(
            str(tmp_path / "pre"),
            str(tmp_path / f"healed-{packing}-{dropout}"),
            data=str(tmp_path / "text.txt"),
            objective=objective,
            packing=packing,
            dropout=dropout,
            **HEAL,
        )
        for packing in (False, True)
        for dropout in (False, True)
    }
    assert reports[True, False]["packing"] and not reports[False, False]["packing"] and reports[True, True]["dropout"]
    losses = {key: [entry for entry in report["log_history"] if "loss" in entry] for key, report in reports.items()}
    padded, packed = losses[False, False], losses[True, False]
    assert len(padded) == len(packed) == HEAL["max_steps"]
    for a, b in zip(padded, packed):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-4) and a["grad_norm"] == pytest.approx(
            b["grad_norm"], rel=1e-3, abs=1e-4
        )
    assert max(abs(a["loss"] - b["loss"]) for a, b in zip(losses[False, True], losses[True, True])) > 1e-3
    for a, b in zip(reports[False, False]["after"], reports[True, False]["after"]):
        assert a["token_cosine"] == pytest.approx(b["token_cosine"], abs=1e-4) and a["mse"] == pytest.approx(
            b["mse"], abs=1e-4
        )


def test_an_interrupted_healing_resumes_with_its_measurements(variant, tmp_path, monkeypatch):
    """The student is measured as training begins and every step here (5 steps): a healing interrupted after the
    checkpoint of step 3 resumes from it with the figures measured until then (kept beside the checkpoints), and
    reports what an uninterrupted one does (before, history and after) within 1e-5; once OUTPUT is written, what it
    kept there is removed, and nothing else."""
    from hf_normswap.heal import healing

    settings = dict(HEAL, max_steps=5, data=str(variant / "text.txt"), objective="hidden")
    whole = heal_checkpoint(str(variant / "pre"), str(tmp_path / "whole"), **settings)
    resumable = dict(settings, checkpoint_dir=str(tmp_path / "checkpoints"))
    with interrupted(monkeypatch, healing, "HealTrainer", step=0):  # before any checkpoint: nothing stays
        heal_checkpoint(str(variant / "pre"), str(tmp_path / "resumed"), **resumable)
    assert not (tmp_path / "checkpoints").exists()
    with interrupted(monkeypatch, healing, "HealTrainer", step=3):  # after the checkpoints of steps 1 to 3
        heal_checkpoint(str(variant / "pre"), str(tmp_path / "resumed"), **resumable)
    checkpoints = repr(str(tmp_path / "checkpoints"))
    for other, differing in [(dict(max_steps=4), "max_steps"), (dict(learning_rate=2e-3), "learning_rate")]:
        with pytest.raises(
            HealError,
            match=re.escape(
                f"{checkpoints} holds another healing's checkpoints (differing: {differing}); rerun that healing"
            ),
        ):
            heal_checkpoint(str(variant / "pre"), str(tmp_path / "resumed"), **{**resumable, **other})
    with pytest.raises(
        HealError, match=re.escape("checkpoints (differing: the variant); rerun that healing to resume it, or give")
    ):
        heal_checkpoint(str(shutil.copytree(variant / "pre", tmp_path / "pre")), str(tmp_path / "out"), **resumable)
    figures = tmp_path / "checkpoints" / "heal_probe.json"
    kept = figures.read_text()
    refused = (
        "resuming at step 3, but the figures measured until then (heal_probe.json) are missing or of another step"
    )
    figures.unlink()  # as checkpoints of an older version: refused in one line, nothing written
    with pytest.raises(HealError, match=re.escape(refused)):
        heal_checkpoint(str(variant / "pre"), str(tmp_path / "resumed"), **resumable)
    figures.write_text(json.dumps(json.loads(kept) | {"step": 2}))  # as if ended as the Trainer saved step 3
    with pytest.raises(HealError, match=re.escape(refused)):
        heal_checkpoint(str(variant / "pre"), str(tmp_path / "resumed"), **resumable)
    assert not (tmp_path / "resumed").exists()
    figures.write_text(kept)
    record = (tmp_path / "checkpoints" / "healing.json").read_text()
    (tmp_path / "checkpoints" / "healing.json").unlink()
    with pytest.raises(
        HealError,
        match=re.escape("checkpoints (no healing.json says whose: written before hf_normswap kept one); rerun"),
    ):
        heal_checkpoint(str(variant / "pre"), str(tmp_path / "resumed"), **resumable)
    (tmp_path / "checkpoints" / "healing.json").write_text(record)
    (tmp_path / "checkpoints" / "notes.txt").write_text("the user's")
    resumed = heal_checkpoint(str(variant / "pre"), str(tmp_path / "resumed"), **resumable)
    assert [path.name for path in (tmp_path / "checkpoints").iterdir()] == ["notes.txt"]  # what the healing kept, gone
    assert resumed["resumed"] and not whole["resumed"]
    assert " s (this run, resumed): token cosine" in HealReport.from_dict(resumed).summary()
    assert resumed["before"] == whole["before"]  # measured once, before the interruption
    assert resumed["tokens"] == whole["tokens"] > 0  # counted before the interruption too
    steps = [[entry["step"] for entry in report["history"]] for report in (resumed, whole)]
    assert steps == [list(range(6))] * 2
    for ours, theirs in zip(resumed["history"] + resumed["after"], whole["history"] + whole["after"]):
        assert ours == pytest.approx(theirs, abs=1e-5)

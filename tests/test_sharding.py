"""Healing and comparisons sharded across processes with FSDP2 (`hf_normswap.sharding`), on CPU: 2 processes of
torchrun with gloo against 1 process with the whole batch.

Tolerance: 1e-5 on every logged loss, gradient norm, final weight and measurement. Sharding changes only the order
of float32 sums (all-gathers are exact; a reduce-scatter averages 2 partial gradients; token counts are reduced
across processes), which moves results by a few float32 roundings (about 1e-7 here), far below 1e-5."""

import functools
import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from transformers import TrainingArguments

from hf_normswap import heal_checkpoint
from hf_normswap.cli import main as cli
from hf_normswap.heal.options import CAUSAL_SCALING, HealError, HealOptions
from hf_normswap.sharding import ShardingOptions, fsdp, launch_training_arguments, options, trainer_bridge
from hf_normswap.sharding.options import ShardingError, with_sharding_section

from helpers import (
    TOLERANCE,
    assert_same_comparison,
    assert_same_healing,
    comparison_arguments,
    comparison_batch_arguments,
    figures,
    healed_folder,
    sharding_variants,
    tensors,
)
from launches import TESTS, torchrun


ACCELERATE_ON_CPU = TESTS / "accelerate_fsdp_on_cpu.py"
# what `accelerate launch` with the shipped fsdp2_bf16 configuration sets for its processes, in float32
FSDP2 = {
    "ACCELERATE_USE_FSDP": "true",
    "FSDP_VERSION": "2",
    "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
    "FSDP_TRANSFORMER_CLS_TO_WRAP": "NormSwapLayer",
    "FSDP_STATE_DICT_TYPE": "FULL_STATE_DICT",
}


def records_by_rank(script: Path, *arguments, processes: int, folder: Path, env: dict | None = None) -> list[dict]:
    """Runs a tests/ script that writes each process's record to `rank-N.json` in the folder given last (here
    FOLDER/PROCESSES) under `torchrun` with `processes` processes (and `env`), through ACCELERATE_ON_CPU if it is
    the first of `arguments`; the records, by rank."""
    output = folder / str(processes)
    output.mkdir(parents=True)
    torchrun(script, *arguments, output, processes=processes, cwd=folder, env=env)
    return rank_records(output, processes)


def rank_records(folder: Path, processes: int) -> list[dict]:
    """The `rank-N.json` records that each of `processes` processes wrote to `folder`, by rank."""
    return [json.loads((folder / f"rank-{rank}.json").read_text()) for rank in range(processes)]


@pytest.fixture(scope="module")
def variants(tmp_path_factory):
    return sharding_variants(tmp_path_factory.mktemp("sharding"))


@pytest.fixture(scope="module")
def healed(variants):
    """Each variant healed by 2 sharded processes with 4 texts each, and by 1 process with 8 (both with --fsdp)."""
    script = TESTS / "distributed_heal.py"
    torchrun(script, variants, variants / "two.json", 4, processes=2, cwd=variants)
    torchrun(script, variants, variants / "one.json", 8, processes=1, cwd=variants)
    checkpointed = ("--activation-checkpointing",)
    torchrun(script, variants, variants / "checkpointed.json", 4, *checkpointed, processes=2, cwd=variants)
    return variants


@pytest.mark.parametrize("name, suffix", [("tied", ""), ("tied", "-forward"), ("untied", ""), ("bert", "")])
def test_sharded_healing_equals_one_process_step_by_step(healed, name, suffix):
    two, one = healed / name / f"healed-4{suffix}", healed / name / f"healed-8{suffix}"
    assert_same_healing(two, one)
    got, source = tensors(two), tensors(healed / name / "variant")
    assert max((got[k] - source[k]).abs().max().item() for k in got if "layers" in k) > 1e-3  # it trained
    report, reference = (json.loads((folder / "heal.json").read_text()) for folder in (two, one))
    for boundary, expected_boundary in zip(report["after"], reference["after"]):
        assert abs(boundary["mse"] - expected_boundary["mse"]) <= TOLERANCE
        assert abs(boundary["token_cosine"] - expected_boundary["token_cosine"]) <= TOLERANCE


def test_a_sharded_healing_fits_and_heals_as_one_process_with_every_default(healed):
    """A calibrated conversion out of pre-LN healed with every default: 2 processes with --fsdp fit the layers first
    and heal at the fitted learning rate as 1 process without it does (the main process fits, before sharding)."""
    two, one = healed / "fitted" / "healed-4", healed / "fitted" / "healed-8"
    assert_same_healing(two, one)
    reports = [json.loads((folder / "heal.json").read_text()) for folder in (two, one)]
    width = json.loads((two / "config.json").read_text())["hidden_size"]
    fitted_rate = CAUSAL_SCALING.learning_rate(width, fitted=True, steps=reports[0]["budget"]["steps"])
    assert [report["learning_rate"] for report in reports] == [pytest.approx(fitted_rate)] * 2
    assert [report["reconstruction"]["steps"] for report in reports] == [60, 60]
    budgets = [report["budget"] for report in reports]  # the stop on the development texts, alike
    assert budgets[0]["stopped_at"] == budgets[1]["stopped_at"]
    assert figures(budgets[0]["development_kl"]) == pytest.approx(figures(budgets[1]["development_kl"]), abs=TOLERANCE)
    errors = [sum(report["reconstruction"]["layer_errors"], []) for report in reports]  # before, after: by layer
    assert errors[0] == pytest.approx(errors[1], abs=TOLERANCE)
    assert errors[0][1] < errors[0][0] and errors[0][3] < errors[0][2]  # each layer fitted


def test_a_sharded_gradual_swap_into_sandwich_heals_as_one_process(healed):
    """The gates at sandwich's branch norms are hooks on the sharded layers' norms: 2 processes with --fsdp heal as
    1 process without it."""
    two, one = healed / "sandwich" / "healed-4", healed / "sandwich" / "healed-8"
    assert_same_healing(two, one)
    assert json.loads((two / "heal.json").read_text())["swap_schedule"] == "layers"
    got, source = tensors(two), tensors(healed / "sandwich" / "variant")
    assert max((got[k] - source[k]).abs().max().item() for k in got if "layers" in k) > 1e-3  # it trained


def test_a_sharded_healing_that_diverges_ends_in_every_process_at_the_same_step(healed):
    """At a learning rate that overflows the weights, 2 processes raise the error 1 process raises, before the
    optimizer takes the step, and write nothing."""
    errors = [(healed / record).read_text() for record in ("two.diverged", "one.diverged")]
    assert errors[0] == errors[1] and errors[0].startswith("the healing diverged at step 3 of 4: its gradient is not")
    assert not healed_folder(healed, "diverged", 4).exists() and not healed_folder(healed, "diverged", 8).exists()


def test_the_teachers_logits_from_its_forward_change_nothing(healed):
    """The KL with the teacher's logits from its forward (the student's kept for the backward pass), and from its
    head a chunk at a time (both recomputed in the backward pass), heals alike."""
    for per_device in (4, 8):
        forward, chunked = (healed / "tied" / f"healed-{per_device}{suffix}" for suffix in ("-forward", ""))
        assert_same_healing(forward, chunked)


def test_sharded_activation_checkpointing_changes_nothing(healed):
    """Recomputing each layer in the backward pass (its units gathered again) gives the same steps and weights."""
    checkpointed, plain = healed / "tied" / "healed-4-checkpointed", healed / "tied" / "healed-4"
    steps = json.loads((healed / "checkpointed.json").read_text())["tied"]
    assert [step["student_checkpointing"] for step in steps] == [True] * 4
    steps = json.loads((healed / "two.json").read_text())["tied"]
    assert [step["student_checkpointing"] for step in steps] == [False] * 4
    assert_same_healing(checkpointed, plain)


def test_the_teacher_never_trains(healed):
    for run in ("two", "one"):
        record = json.loads((healed / f"{run}.json").read_text())
        for name, steps in record.items():
            assert len(steps) == (3 if name == "fitted" else 4), (run, name)  # the fitted one stopped early
            for step in steps:
                assert step["student_training"] and not step["training"], (run, name, step)
                if run == "two":  # FSDP2 reduces its gradients, not DDP (which wraps one process's model)
                    assert not step["student_wrapped"], (run, name, step)
                assert step["student_sharded"] == step["teacher_sharded"] == (run == "two"), (run, name, step)
                assert step["grads"] == step["requires_grad"] == step["in_optimizer"] == 0, (run, name, step)
                # sharded, its root (embeddings, head) is not kept gathered between steps
                assert step["teacher_gathered"] == (run == "one"), (run, name, step)


def test_an_fsdp_launch_of_one_process_shards(healed):
    """Under `accelerate launch` with an FSDP configuration the Trainer shards the trained model even in one process;
    `fsdp` then shards the student and the teacher alike (here with `fully_shard` over one gloo process), and the
    healing equals the unsharded one."""
    script, launch = TESTS / "distributed_heal.py", {"ACCELERATE_USE_FSDP": "true"}
    torchrun(script, healed, healed / "launched.json", 8, "--tag=-launched", processes=1, cwd=healed, env=launch)
    for name, steps in json.loads((healed / "launched.json").read_text()).items():
        assert [(step["student_sharded"], step["teacher_sharded"]) for step in steps] == [(True, True)] * 4, name
    for name in ("tied", "tied-forward", "untied", "bert"):
        assert_same_healing(healed_folder(healed, name, 8, "-launched"), healed_folder(healed, name, 8))


def test_only_the_main_process_reads_the_weights(variants, tmp_path):
    """Sharded, the main process alone reads the student's and the teacher's weights (and a comparison's fine-tuned
    model's) and samples the training texts from the teacher; the other builds the models empty and takes its shards
    and the texts from the main one. Both then hold what one unsharded process holds, exactly (the weights and texts
    are copied, not computed again)."""
    script, variant = TESTS / "distributed_load.py", variants / "tied" / "variant"
    main, other = records_by_rank(script, variant, processes=2, folder=tmp_path)
    (alone,) = records_by_rank(script, variant, processes=1, folder=tmp_path)
    assert main["loaded"] == alone["loaded"] == {"student": True, "teacher": True, "compared": True}
    assert other["loaded"] == {"student": False, "teacher": False, "compared": False}
    # the student that accelerate's FSDP2 shards (on GPUs) too: it hands the main process's weights out itself
    accelerated = records_by_rank(ACCELERATE_ON_CPU, script, variant, processes=2, folder=tmp_path / "a", env=FSDP2)
    assert [record["loaded"] for record in accelerated] == [main["loaded"], other["loaded"]]
    assert len(alone["texts"]) == 6 and {len(text) for text in alone["texts"]} == {5}
    assert main["texts"] == other["texts"] == alone["texts"]
    assert main["teacher_embeddings"] == other["teacher_embeddings"] == alone["teacher_embeddings"]
    # the group is freed, its gloo workers joined, before the interpreter exits (one left freeing an all-gather's
    # tensors there aborted the process: docs/experiments/scale.md, 2026-11-27)
    assert [record["group_freed"] for record in [main, other, *accelerated, alone]] == [True] * 5


def test_the_command_line_ends_the_launchs_process_group(variants, tmp_path):
    """Once a sharded healing has run, or has failed (its output is there already), `hf-normswap` has freed the
    launch's process group on every process, its gloo workers joined before the interpreter exits (`end_processes`)."""
    healing = ["heal", variants / "tied" / "variant", tmp_path / "healed", "--fsdp", "--data", variants / "text.txt"]
    steps = ["--max-steps", "1", "--batch-size", "2", "--eval-size", "4"]
    for folder, code in ((tmp_path / "healing", 0), (tmp_path / "again", 1)):
        records = records_by_rank(TESTS / "distributed_cli.py", *healing, *steps, processes=2, folder=folder)
        assert records == [{"code": code, "group_freed": True}] * 2


def test_a_batch_the_processes_cannot_share_equally_is_refused_in_one_line(variants, tmp_path):
    """--batch-size is a step's texts, shared equally by the processes: 3 on 2 processes is refused, on each."""
    healing = ["heal", variants / "tied" / "variant", tmp_path / "healed", "--fsdp", "--data", variants / "text.txt"]
    (tmp_path / "ranks").mkdir()
    arguments = [*healing, "--max-steps", "1", "--batch-size", "3", tmp_path / "ranks"]
    run = torchrun(TESTS / "distributed_cli.py", *arguments, processes=2, cwd=tmp_path)
    assert rank_records(tmp_path / "ranks", 2) == [{"code": 1, "group_freed": True}] * 2
    error = "hf-normswap heal: error: batch_size=3: each of the 2 processes takes an equal share: a multiple of 2"
    assert run.stderr.count(error) == 2  # the two processes' lines may interleave on the shared stderr
    assert not (tmp_path / "healed").exists()


@pytest.mark.parametrize("placement", ["post", "pre"])
def test_diagnostics_leave_no_gradient_under_accelerates_units(tmp_path, placement):
    """Sharded as accelerate's FSDP2 does on GPUs, with a tail unit that stays gathered after its forward (post: the
    embeddings, which hold a norm; pre: the final norm), the comparison's diagnostics at the start of training (a
    probe's backward, then the collapse figures with the root gathered) leave every unit resharded and no gradient
    behind: the first training step's gradients equal the plain model's exactly. Before `gathered` resharded every
    unit, the probe's gradients of the tail were added to the first step's (0.08 in the post model's position
    embeddings), the loss curves differing from the second step (docs/experiments/scale.md)."""
    script = TESTS / "distributed_diagnostics.py"
    sharded = records_by_rank(script, placement, "--shard", processes=2, folder=tmp_path)
    (plain,) = records_by_rank(script, placement, processes=1, folder=tmp_path)
    for record in sharded:
        assert (record["units"], record["resharded"], record["cleared"]) == (5, True, True)
        assert record["gradients"].keys() == plain["gradients"].keys()
        for name, gradient in plain["gradients"].items():
            assert record["gradients"][name] == pytest.approx(gradient, abs=TOLERANCE, rel=0), name


def test_sharding_options_are_checked(variants, tmp_path, capsys):
    with pytest.raises(ShardingError, match=r"fsdp_config='fsdp.json' is invalid: it needs fsdp \(pass --fsdp too\)"):
        ShardingOptions(fsdp_config="fsdp.json")
    (tmp_path / "list.json").write_text("[]")
    for name, message in [("missing.json", "not a readable JSON file"), ("list.json", "holds list, not an object")]:
        with pytest.raises(ShardingError, match=f"fsdp_config='{tmp_path / name}': {message}"):
            ShardingOptions(fsdp=True, fsdp_config=str(tmp_path / name))
    (tmp_path / "maybe.json").write_text(json.dumps({"cpu_ram_efficient_loading": "maybe"}))
    with pytest.raises(ShardingError, match="cpu_ram_efficient_loading='maybe' is invalid: true or false"):
        ShardingOptions(fsdp=True, fsdp_config=str(tmp_path / "maybe.json"))
    arguments = ["heal", str(variants / "tied" / "variant"), str(tmp_path / "out"), "--fsdp", "--lora"]
    assert cli(arguments) == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        "hf-normswap heal: error: lora=True is invalid: adapters are not sharded (fsdp=True), with or without a "
        "distributed launch; give one of them"
    ]
    assert not (tmp_path / "out").exists()


def test_checkpoints_of_a_model_sharded_on_a_cpu_are_refused_before_loading(variants, tmp_path, capsys, monkeypatch):
    from hf_normswap.heal import healing
    from hf_normswap.heal import options as heal_options

    monkeypatch.setattr(heal_options, "resumable", lambda options: False)  # as a launch sharding on CPUs finds
    monkeypatch.setattr(healing, "load_models", lambda *args: pytest.fail("the models were loaded"))
    arguments = ["heal", str(variants / "tied" / "variant"), str(tmp_path / "out"), "--fsdp"]
    assert cli([*arguments, "--checkpoint-dir", str(tmp_path / "checkpoints")]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        f"hf-normswap heal: error: checkpoint_dir={str(tmp_path / 'checkpoints')!r} is invalid: not with fsdp=True on "
        "CPU: the Trainer cannot resume a model sharded there"
    ]
    assert not (tmp_path / "out").exists() and not (tmp_path / "checkpoints").exists()


def test_bf16_on_a_cpu_without_bfloat16_arithmetic_warns(monkeypatch):
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: False)
    monkeypatch.setattr(options, "cpu_computes_bfloat16", lambda: False)
    with pytest.warns(UserWarning, match=r"bf16=True on a CPU without bfloat16 arithmetic of its own \(AVX512-BF16"):
        ShardingOptions(bf16=True)
    monkeypatch.setattr(options, "cpu_computes_bfloat16", lambda: True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ShardingOptions(bf16=True)
        ShardingOptions()


def test_the_fsdp_config_decides_who_reads_the_trained_model(tmp_path, monkeypatch):
    """Read as the Trainer reads it (an `fsdp_` prefix dropped, flags as accelerate parses them), the `fsdp_config`
    file decides whether accelerate hands the trained model's weights out (by default it does), and so whether the
    other processes read it; turned off against the launch's configuration, it is refused, and turned off, so is the
    layer fit, which the main process alone runs."""
    cases = [
        ({"version": 2}, True),
        ({"fsdp_cpu_ram_efficient_loading": False}, False),
        ({"cpu_ram_efficient_loading": 1}, True),
    ]
    monkeypatch.setattr(fsdp, "sharded", lambda options: True)
    monkeypatch.setattr(fsdp, "is_main_process", lambda: False)
    monkeypatch.setattr(fsdp, "accelerate_shards", lambda: True)
    monkeypatch.setattr(trainer_bridge, "sharded", lambda options: True)
    monkeypatch.setattr(trainer_bridge, "accelerate_shards", lambda: True)
    for index, (fields, once) in enumerate(cases):
        (tmp_path / f"{index}.json").write_text(json.dumps(fields))
        options = ShardingOptions(fsdp=True, fsdp_config=str(tmp_path / f"{index}.json"))
        assert options.reads_trained_once() is once
        assert fsdp.loads_weights(options, trained=True) is not once
        assert fsdp.loads_weights(options) is False  # a teacher: sharded here, from the main process's copy
        arguments = trainer_bridge.trainer_arguments(options, model=None)
        assert arguments["fsdp_config"]["cpu_ram_efficient_loading"] in (once, int(once))
    monkeypatch.setenv("FSDP_CPU_RAM_EFFICIENT_LOADING", "true")
    with pytest.raises(ShardingError, match="turns cpu_ram_efficient_loading off, the launch's accelerate"):
        fsdp.loads_weights(ShardingOptions(fsdp=True, fsdp_config=str(tmp_path / "1.json")), trained=True)
    off = with_sharding_section(dict(fsdp=True, fsdp_config=str(tmp_path / "1.json")))
    fit = "reconstruct_steps=60 is invalid: the main process alone fits the layers, and fsdp_config turns"
    with pytest.raises(HealError, match=fit):  # the others would read the student the main process had not fitted
        HealOptions(**off).for_head("causal-lm", out_of_pre_ln=True)  # the fit by default
    assert HealOptions(**off, reconstruct_steps=0).for_head("causal-lm", out_of_pre_ln=True).reconstruct_steps == 0


def test_fsdp_in_one_process_heals_unsharded(variants, tmp_path):
    """Without a distributed launch --fsdp has nothing to shard across: the healing is the plain one."""
    settings = dict(data=str(variants / "text.txt"), objective="hidden", max_steps=2, batch_size=4, eval_size=8)
    heal_checkpoint(str(variants / "bert" / "variant"), str(tmp_path / "fsdp"), fsdp=True, log=None, **settings)
    heal_checkpoint(str(variants / "bert" / "variant"), str(tmp_path / "plain"), log=None, **settings)
    got, expected = tensors(tmp_path / "fsdp"), tensors(tmp_path / "plain")
    assert all(torch.equal(got[k], expected[k]) for k in expected)


def test_a_process_that_sees_several_gpus_trains_on_one(variants, tmp_path, monkeypatch):
    """The Trainer gives a process every GPU it sees (`n_gpu`), wrapping the model in DataParallel and multiplying the
    batch by their count: a process that sees two heals as one on one device, the same steps of the same texts."""
    settings = dict(data=str(variants / "text.txt"), objective="hidden", max_steps=2, batch_size=4, eval_size=8)
    heal_checkpoint(str(variants / "bert" / "variant"), str(tmp_path / "one"), log=None, **settings)
    devices = TrainingArguments._setup_devices

    def two_gpus(arguments):
        device = devices.func(arguments)
        arguments._n_gpu = 2
        return device

    seeing_two = functools.cached_property(two_gpus)
    seeing_two.__set_name__(TrainingArguments, "_setup_devices")
    monkeypatch.setattr(TrainingArguments, "_setup_devices", seeing_two)
    assert TrainingArguments(output_dir=str(tmp_path), use_cpu=True).train_batch_size == 16  # 8 a device, doubled
    assert launch_training_arguments(ShardingOptions(), None, output_dir=str(tmp_path), use_cpu=True).n_gpu == 1
    heal_checkpoint(str(variants / "bert" / "variant"), str(tmp_path / "two"), log=None, **settings)
    got, expected = tensors(tmp_path / "two"), tensors(tmp_path / "one")
    assert all(torch.equal(got[k], expected[k]) for k in expected)


def test_sharded_comparison_equals_one_process(tmp_path):
    """`compare --fsdp --batch-size 8` under 2 processes (4 examples each) trains and evaluates as 1 process: sharded
    here, and sharded by the Trainer through accelerate's FSDP2 plugin as on GPUs (its units, clipping and saving).
    Each run prints its report once and ends with its process group freed on every process."""
    compare = [TESTS / "distributed_cli.py", "compare", *comparison_arguments(tmp_path)]
    two = [*comparison_batch_arguments(8), "--fsdp"]
    runs = {  # output: (launch, arguments, processes, environment)
        "two": ([], two, 2, None),
        "accelerate": ([ACCELERATE_ON_CPU], two, 2, FSDP2),
        # the reference under torchrun too: the Trainer shuffles through accelerate's sampler, as with 2 processes
        "one": ([], comparison_batch_arguments(8), 1, None),
    }
    for output, (launch, arguments, processes, env) in runs.items():
        ranks = tmp_path / f"{output}-ranks"
        ranks.mkdir()
        run = torchrun(
            *launch, *compare, *arguments, f"--output={output}", ranks, processes=processes, cwd=tmp_path, env=env
        )
        assert run.stdout.count("report:") == 1, output
        assert rank_records(ranks, processes) == [{"code": 0, "group_freed": True}] * processes, output
    assert_same_comparison(tmp_path / "two", tmp_path / "one")
    assert_same_comparison(tmp_path / "accelerate", tmp_path / "one")


def test_accelerates_fsdp2_heals_as_one_process(healed):
    """Under accelerate's FSDP2 plugin (the GPU path, here on 2 CPU processes) the Trainer shards the student, the
    teacher is sharded beside it, and each healing equals the one unsharded process's."""
    script = TESTS / "distributed_heal.py"
    record = healed / "accelerate.json"
    torchrun(ACCELERATE_ON_CPU, script, healed, record, 4, "--tag=-accelerate", processes=2, cwd=healed, env=FSDP2)
    for name, steps in json.loads(record.read_text()).items():
        for step in steps:
            assert step["student_sharded"] and step["teacher_sharded"] and not step["student_wrapped"], (name, step)
            assert step["grads"] == step["requires_grad"] == step["in_optimizer"] == 0, (name, step)
    for name in ("tied", "tied-forward", "untied", "bert"):
        assert_same_healing(healed_folder(healed, name, 4, "-accelerate"), healed_folder(healed, name, 8))


FRAGMENTED_HEAP = """
import torch
from hf_normswap.memory import release_freed_memory

def resident_mib():
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmRSS")) // 1024

release_freed_memory()
torch.ones(4 << 18)  # 4 MiB, freed at once: by itself glibc would raise its mmap threshold above it
blocks, pins = [], []
for _ in range(64):  # 256 MiB of 4 MiB blocks, each followed by a small block that stays
    blocks.append(torch.ones(4 << 18))
    pins.append(torch.ones(64))
before = resident_mib()
blocks.clear()
print(before - resident_mib())
"""


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or torch.accelerator.is_available(), reason="glibc's allocator, on CPU only"
)
def test_freed_blocks_go_back_to_the_system():
    """Blocks of 1 MiB and more freed between blocks that stay leave the process (glibc's heap would keep them)."""
    done = subprocess.run([sys.executable, "-c", FRAGMENTED_HEAP], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert int(done.stdout) >= 240  # MiB of the 256 freed

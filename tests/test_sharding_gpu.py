"""Healing and comparing under `accelerate launch` with the shipped FSDP2 configuration, on GPUs: accelerate's FSDP2
plugin shards the trained model (through the Trainer), `hf_normswap.sharding` a healing's teacher, over NCCL. CI has
no GPU, so these tests are skipped there; on a machine with one: `python -m pytest tests/test_sharding_gpu.py`.

On one GPU the launch is one process (NCCL refuses two on one GPU), which FSDP2 still wraps, gathers and reshards
unit by unit. In float32 the healing must then equal the unsharded one (1 process under `torchrun`, the same batch)
within `helpers.TOLERANCE`, as on CPU. With bfloat16 mixed precision each logged loss must stay within 2% of
float32's: bfloat16 keeps 8 bits of mantissa (a relative rounding of 2^-9, 0.2%, on every input of the products),
and four steps of AdamW at a learning rate of 1e-3 carry it to the losses."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_normswap import accelerate_config

from helpers import (
    assert_same_comparison,
    assert_same_healing,
    comparison_arguments,
    comparison_batch_arguments,
    healed_folder,
    logged,
    sharding_variants,
    tensors,
)


pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="accelerate's FSDP2 plugin shards on GPUs")

TESTS = Path(__file__).parent
BF16_RELATIVE = 2e-2
HEALINGS = ("tied", "tied-forward", "untied", "bert")
UNSHARDED = ["torch.distributed.run", "--standalone", "--nproc_per_node=1"]  # one process on one GPU


def launch(launcher: list[str], *arguments, cwd: Path) -> str:
    """Runs `arguments` (a tests/ script, or -m and a module) under `launcher`; returns what it printed."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": os.pathsep.join([str(TESTS.parent), str(TESTS)])}
    env.pop("ACCELERATE_USE_FSDP", None)  # an FSDP launch sets it for its processes; the unsharded run has none
    command = [sys.executable, "-m", *launcher, *map(str, arguments)]
    process = subprocess.run(command, capture_output=True, text=True, env=env, cwd=cwd, timeout=900)
    assert process.returncode == 0, process.stderr[-3000:]
    return process.stdout


def accelerate_fsdp2(precision: str, config: str = "fsdp2_bf16") -> tuple[list[str], int]:
    """`accelerate launch` with the shipped FSDP2 configuration `config` on every GPU (2 at most), in `precision`;
    and the number of processes."""
    processes = min(2, torch.cuda.device_count())
    launcher = ["accelerate.commands.launch", "--config_file", accelerate_config(config)]
    return [*launcher, "--num_processes", str(processes), "--mixed_precision", precision], processes


@pytest.fixture(scope="module")
def healed(tmp_path_factory):
    """Each variant healed under accelerate's FSDP2 launch on every GPU (8 texts a step in all), in float32 and in
    bfloat16 mixed precision, and by one unsharded process on one GPU."""
    variants = sharding_variants(tmp_path_factory.mktemp("sharding"))
    script = TESTS / "distributed_heal.py"
    (float32, processes), (bf16, _) = accelerate_fsdp2("no"), accelerate_fsdp2("bf16")
    per_device = 8 // processes
    launch(float32, script, variants, variants / "fsdp.json", per_device, "--tag=-fsdp", cwd=variants)
    launch(bf16, script, variants, variants / "fsdp-bf16.json", per_device, "--bf16", "--tag=-fsdp", cwd=variants)
    launch(UNSHARDED, script, variants, variants / "plain.json", 8, cwd=variants)
    return variants, per_device


@pytest.mark.parametrize("healing", HEALINGS)
def test_accelerate_fsdp2_heals_as_one_unsharded_process(healed, healing):
    variants, per_device = healed
    assert_same_healing(healed_folder(variants, healing, per_device, "-fsdp"), healed_folder(variants, healing, 8))


@pytest.mark.parametrize("healing", HEALINGS)
def test_bf16_under_fsdp2_follows_float32(healed, healing):
    variants, per_device = healed
    bf16, float32 = (healed_folder(variants, healing, per_device, suffix) for suffix in ("-bf16-fsdp", "-fsdp"))
    got, expected = logged(bf16, "loss"), logged(float32, "loss")
    assert len(got) == len(expected) == 4
    assert all(abs(a - b) <= BF16_RELATIVE * abs(b) for a, b in zip(got, expected)), (got, expected)
    weights, source = tensors(bf16), tensors(variants / healing.split("-")[0] / "variant")
    assert all(t.dtype == torch.float32 and t.isfinite().all() for t in weights.values())  # float32 masters saved
    assert max((weights[k] - source[k]).abs().max().item() for k in weights if "layers" in k) > 1e-3  # it trained


@pytest.mark.parametrize("config", ["fsdp2_bf16_checkpointing", "fsdp2_bf16_offload"])
def test_the_other_shipped_configurations_heal_as_one_unsharded_process(healed, config):
    """With activation checkpointing each layer recomputes its forward in the backward; under CPU offload the
    student's shards stay on the CPU between uses and its units run on the GPU: its measurements and its greedy
    generation run where it computes (`NormSwapPreTrainedModel.device`)."""
    variants, per_device = healed
    launcher, _ = accelerate_fsdp2("no", config)
    script = TESTS / "distributed_heal.py"
    launch(launcher, script, variants, variants / f"{config}.json", per_device, f"--tag=-{config}", cwd=variants)
    for healing in HEALINGS:
        assert_same_healing(
            healed_folder(variants, healing, per_device, f"-{config}"), healed_folder(variants, healing, 8)
        )


@pytest.mark.parametrize("record", ["fsdp.json", "fsdp-bf16.json", "plain.json"])
def test_student_and_teacher_are_sharded_and_the_teacher_never_trains(healed, record):
    variants, _ = healed
    launched = record != "plain.json"
    for name, steps in json.loads((variants / record).read_text()).items():
        assert len(steps) == 4, name
        for step in steps:
            assert step["student_training"] and not step["training"], (name, step)
            assert step["student_sharded"] == step["teacher_sharded"] == launched, (name, step)
            assert not step["student_wrapped"], (name, step)
            assert step["grads"] == step["requires_grad"] == step["in_optimizer"] == 0, (name, step)
            assert step["teacher_gathered"] == (not launched), (name, step)


@pytest.mark.parametrize("config", ["fsdp2_bf16", "fsdp2_bf16_checkpointing", "fsdp2_bf16_offload"])
def test_a_comparison_under_accelerate_fsdp2_equals_one_unsharded_process(tmp_path, config):
    """`compare --fsdp` under each shipped FSDP2 configuration trains, heals and evaluates as one unsharded process."""
    arguments = ["-m", "hf_normswap.cli", "compare", *comparison_arguments(tmp_path)]
    launcher, processes = accelerate_fsdp2("no", config)
    sharded = [*comparison_batch_arguments(8), "--fsdp", "--output=fsdp"]
    assert launch(launcher, *arguments, *sharded, cwd=tmp_path).count("report:") == 1
    launch(UNSHARDED, *arguments, *comparison_batch_arguments(8), "--output=plain", cwd=tmp_path)
    assert_same_comparison(tmp_path / "fsdp", tmp_path / "plain")

"""The package itself converts, heals and compares with the oldest supported Transformers release as with the newest:
`.ci/run` builds an environment holding hf_normswap and the declared floor, and names its interpreter in
HF_NORMSWAP_PACKAGE_PYTHONS ("VERSION=PYTHON" pairs, separated by os.pathsep)."""

import json
import os
import subprocess
import sys

import pytest
import transformers

from hf_normswap import convert_checkpoint

from helpers import PACKAGE_PYTHONS, RELEASES, SENTENCES, release, save_source, tensors, tiny_task


def _package(interpreter: str, *arguments: str, launch: tuple = ()) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    command = [interpreter, *launch, "-m", "hf_normswap.cli", *arguments]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)


@pytest.mark.skipif(not PACKAGE_PYTHONS, reason="run through .ci/run, which builds the oldest release's environment")
@pytest.mark.parametrize("python", ["oldest", "newest"])
def test_the_package_converts_heals_and_compares_with_the_oldest_and_newestrelease(tmp_path, python):
    """`hf-normswap convert` (a tiny LLaMA to pre_post, calibrated, verified) gives the same checkpoint whichever
    supported Transformers release runs it; `heal` and `compare` train through that release's Trainer."""
    interpreter = PACKAGE_PYTHONS[RELEASES[0]] if python == "oldest" else sys.executable
    save_source(tmp_path / "source", "llama", "ForCausalLM")
    converted = _package(
        interpreter,
        "convert",
        str(tmp_path / "source"),
        str(tmp_path / python),
        "--norm-placement",
        "pre_post",
        "--attention",
        "bidirectional",
    )
    assert converted.returncode == 0, converted.stderr[-3000:]
    config = json.loads((tmp_path / python / "config.json").read_text())
    assert config["transformers_version"] == (RELEASES[0] if python == "oldest" else transformers.__version__)
    here = dict(norm_placement="pre_post", attention="bidirectional", log=lambda _: None)
    convert_checkpoint(str(tmp_path / "source"), str(tmp_path / "here"), **here)
    written, expected = tensors(tmp_path / python), tensors(tmp_path / "here")
    assert written.keys() == expected.keys()
    assert max((written[name] - expected[name]).abs().max().item() for name in written) <= 1e-6

    (tmp_path / "text.txt").write_text("\n".join(SENTENCES * 8) + "\n")
    budget = ["--max-steps", "2", "--batch-size", "4", "--eval-size", "8"]
    healed = _package(
        interpreter,
        "heal",
        str(tmp_path / python),
        str(tmp_path / "healed"),
        "--data",
        str(tmp_path / "text.txt"),
        *budget,
    )
    assert healed.returncode == 0, healed.stderr[-3000:]
    report = json.loads((tmp_path / "healed" / "heal.json").read_text())
    assert report["steps"] == 2 and 0 < report["after"][-1]["token_cosine"] <= 1 + 1e-6
    task = tiny_task(tmp_path / "task")
    settings = ["--variants", "pre,post+heal", "--seeds", "1", "--epochs", "1", "--batch-size", "16"]
    settings += ["--heal", "{max_steps: 2, batch_size: 4, eval_size: 8}", "--text-columns", "text"]
    compared = _package(
        interpreter,
        "compare",
        "--model",
        str(tmp_path / "source"),
        "--task",
        str(task),
        *settings,
        "--output",
        str(tmp_path / "compared"),
    )
    assert compared.returncode == 0, compared.stderr[-3000:]
    runs = json.loads((tmp_path / "compared" / "results.json").read_text())["runs"]
    assert sorted(run["variant"] for run in runs) == ["post+heal", "pre"]
    assert all(0 <= run["metrics"]["accuracy"] <= 1 for run in runs)


@pytest.mark.skipif(not PACKAGE_PYTHONS, reason="run through .ci/run, which builds the package's oldest environment")
def test_sharding_on_cpu_before_transformers_5_19_stops_with_one_line(tmp_path):
    """Older Trainers wrap a model sharded on CPU in DDP, which fails on its DTensors: `--fsdp` says so at once."""
    interpreter = PACKAGE_PYTHONS[RELEASES[0]]
    if release(RELEASES[0]) >= (5, 19):
        pytest.skip(f"the oldest release, {RELEASES[0]}, shards on CPU")
    save_source(tmp_path / "source", "llama", "ForCausalLM")
    convert_checkpoint(str(tmp_path / "source"), str(tmp_path / "post"), norm_placement="post", log=lambda _: None)
    (tmp_path / "text.txt").write_text("\n".join(SENTENCES) + "\n")
    launch = ("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2")
    arguments = [
        "heal",
        str(tmp_path / "post"),
        str(tmp_path / "healed"),
        "--data",
        str(tmp_path / "text.txt"),
        "--fsdp",
    ]
    process = _package(interpreter, *arguments, launch=launch)
    error = f"hf-normswap heal: error: fsdp on CPU needs transformers>=5.19 (found {RELEASES[0]}): upgrade it"
    # one line from each process; written at the same moment, the two may share a line of the launch's stderr
    assert process.returncode != 0 and process.stderr.count(error) == 2, process.stderr[-3000:]
    assert not (tmp_path / "healed").exists()

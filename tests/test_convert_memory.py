"""Memory-bounded conversion: calibration streams its statistics over batches (the same figures as one forward over
all the data, and memory that does not grow with the data), and conversion.json records each stage's peak memory."""

import functools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from hf_normswap import convert_checkpoint
from hf_normswap.convert import calibration, converter
from hf_normswap.convert.refit import MedianSample

from helpers import save_source


# The figures the single-forward calibration (one batch of all 704 sentences, each refit solved on all the
# activations at once) gave on these tiny models before calibration streamed.
SINGLE_FORWARD = {
    "pre": {
        "write_scales": [0.03632606565952301, 0.03609335795044899, 0.03744082897901535, 0.038626037538051605],
        "refit_errors": [  # before and after, of each write
            *(0.4451107803081427, 0.22446751626887726),
            *(0.5389748987702841, 0.21629947590837417),
            *(0.4995551166043228, 0.3040766097930751),
            *(0.640369614005707, 0.28966304488854433),
        ],
    },
    "sandwich": {
        "write_scales": [0.03632606565952301, 0.03609461709856987, 0.037541791796684265, 0.038983628153800964],
    },
    "post": {
        "write_scales": [53.46190431284387, 42.915704321715275, 43.18476043144629, 37.728471978749475],
        "stream_rms": [
            0.018704907968640327,
            0.023301493376493454,
            0.023156316950917244,
            0.026505181565880775,
            0.026365574449300766,
        ],
    },
}
SOURCES = {"pre": "bert", "sandwich": "bert", "post": "llama"}


def quiet(*args, **kwargs):
    return convert_checkpoint(*args, **kwargs, log=lambda _: None)


def figures(record: dict) -> dict:
    found = record["calibration"]
    return {
        "write_scales": list(found["write_scales"].values()),
        "refit_errors": [error for errors in found["refit_errors"].values() for error in errors],
        "stream_rms": found["stream_rms"] or [],
    }


@pytest.mark.parametrize("placement", sorted(SINGLE_FORWARD))
def test_batchwise_calibration_gives_the_single_forward_figures(tmp_path, monkeypatch, placement):
    """Batches of 64 sentences give what one batch of all 704 gives, and what the single-forward code gave."""
    source = SOURCES[placement]
    save_source(tmp_path / source, source, "Model")
    batched = figures(quiet(str(tmp_path / source), str(tmp_path / "batched"), norm_placement=placement))
    whole = functools.partial(calibration.calibrate_checkpoint, batch_size=calibration.CALIBRATION_SIZE)
    monkeypatch.setattr(converter, "calibrate_checkpoint", whole)
    at_once = figures(quiet(str(tmp_path / source), str(tmp_path / "at_once"), norm_placement=placement))
    for name, values in batched.items():
        assert values == pytest.approx(at_once[name], rel=1e-6, abs=1e-9), name
        assert values == pytest.approx(SINGLE_FORWARD[placement].get(name, []), rel=1e-6, abs=1e-9), name
    assert batched["write_scales"] == at_once["write_scales"]  # medians: the same tokens' figures


def test_a_median_sample_is_exact_up_to_its_bound_then_a_seeded_sample():
    values = torch.randn(10_000, generator=torch.Generator().manual_seed(1))
    exact, sampled, again = MedianSample(bound=10_000), MedianSample(bound=2_000), MedianSample(bound=2_000)
    for chunk in values.split(700):
        for sample in (exact, sampled, again):
            sample.add(chunk)
    assert exact.median() == values.median().item()
    assert len(sampled.values) == 2_000 and sampled.median() == again.median()  # seeded: the same sample
    assert set(sampled.values.tolist()) <= set(values.tolist())
    assert sampled.median() == pytest.approx(values.median().item(), abs=0.1)  # a standard error is about 0.03


def test_conversion_json_records_each_stages_peak_memory(tmp_path):
    save_source(tmp_path / "bert", "bert", "Model")
    calibrated = quiet(str(tmp_path / "bert"), str(tmp_path / "pre"), norm_placement="pre")
    memory = json.loads((tmp_path / "pre" / "conversion.json").read_text())["memory"]
    assert memory == calibrated["memory"]
    assert memory["measured_by"] in ("VmHWM", "ru_maxrss")
    assert all(isinstance(memory[stage], float) and memory[stage] >= 0 for stage in ("write_mib", "calibrate_mib"))
    assert isinstance(memory["verify_mib"], float)
    plain = quiet(str(tmp_path / "bert"), str(tmp_path / "plain"), verify=False)  # exact: nothing to calibrate
    assert plain["memory"]["calibrate_mib"] is None and plain["memory"]["verify_mib"] is None


PEAK_ACROSS_RESETS = """
import json, torch
from hf_normswap.memory import peak_memory, process_peak
start = process_peak()
block = torch.ones(64 * 2**20)  # 256 MiB, touched
del block
with peak_memory() as peak:
    pass
figures = {"start": start, "after": process_peak(), "block_mib": peak.mib, "method": peak.method}
print(json.dumps(figures))
"""


def test_the_process_peak_survives_the_stages_resets():
    """`process_peak` keeps the high-water mark that a stage's reset discarded."""
    done = subprocess.run([sys.executable, "-c", PEAK_ACROSS_RESETS], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    figures = json.loads(done.stdout.splitlines()[-1])
    assert figures["after"] - figures["start"] >= 250 * 2**20, figures
    if figures["method"] == "VmHWM":  # the mark was reset: the empty block shows none of the earlier 256 MiB
        assert figures["block_mib"] < 50, figures


def test_a_failed_calibration_leaves_nothing_on_disk(tmp_path, monkeypatch):
    """Neither the output, its staging folder, the folder made for it, nor the stream's temporary files."""
    save_source(tmp_path / "bert", "bert", "Model")
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    fit_point = calibration._fit_point

    def failing(written, name, *args):
        if name == "layers.1.attention_norms":  # after a layer's stream went to disk
            assert list((tmp_path / "tmp").iterdir())
            raise RuntimeError("interrupted")
        return fit_point(written, name, *args)

    monkeypatch.setattr(calibration, "_fit_point", failing)
    with pytest.raises(RuntimeError, match="interrupted"):
        quiet(str(tmp_path / "bert"), str(tmp_path / "out" / "pre"), norm_placement="pre")
    assert not (tmp_path / "out").exists() and list((tmp_path / "tmp").iterdir()) == []  # the folder made for it too


# Calibrates an uncalibrated conversion (argv: source, converted, sentences) and prints the peak RSS above the start.
CALIBRATE = """
import json, shutil, sys, tempfile
from pathlib import Path
from hf_normswap.convert.calibration import calibrate_checkpoint, calibrated_sublayers
from hf_normswap.convert.norm_mapping import norm_slots
from hf_normswap.convert.verification import load_unswapped
from hf_normswap.memory import peak_memory
from hf_normswap.model.configuration_normswap import NormSwapConfig
source, converted, size = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
folder = Path(tempfile.mkdtemp()) / "model"
shutil.copytree(converted, folder)
norm_sources = json.loads((folder / "conversion.json").read_text())["norm_sources"]
plain = load_unswapped(source)
target = NormSwapConfig.from_pretrained(folder)
sublayers = calibrated_sublayers(target, norm_sources, norm_slots(plain.config))
with peak_memory() as peak:
    calibrate_checkpoint(folder=folder, head="base", source_model=plain, target=target, norm_sources=norm_sources,
                         sublayers=sublayers, log=lambda _: None, size=size)
print(peak.mib)
"""


def calibration_peak(source: Path, converted: Path, size: int) -> float:
    """Calibration's peak memory in a fresh process, in MiB."""
    env = {
        **os.environ,
        "PYTHONPATH": str(Path(__file__).parents[1]),
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    done = subprocess.run(
        [sys.executable, "-c", CALIBRATE, str(source), str(converted), str(size)],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    return float(done.stdout.split()[-1])


def test_calibration_memory_does_not_grow_with_its_data(tmp_path):
    """4 times the data (the training sample repeated) within 16 MiB of the peak at 1 time (measured 2 to 3 MiB
    apart); holding the source's sums at every refitted point (2 x 2 layers x 64 floats a token) would add 27.5 MB
    for the 26,856 tokens added."""
    save_source(tmp_path / "bert", "bert", "Model", hidden_size=64, intermediate_size=128)
    quiet(str(tmp_path / "bert"), str(tmp_path / "pre"), norm_placement="pre", calibrate=False, verify=False)
    size = calibration.CALIBRATION_SIZE
    once, four = (calibration_peak(tmp_path / "bert", tmp_path / "pre", size * k) for k in (1, 4))
    assert four - once < 16, (once, four)

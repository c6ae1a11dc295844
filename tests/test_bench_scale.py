"""scripts/bench_scale.py's conversion part runs on tiny sizes, prints its figures and leaves nothing behind."""

import os
import re
import subprocess
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
ROW = re.compile(r"^(.+?)\s+(\d+\.\d{3})\s+(\d+\.\d{3})\s+(\d+\.\d+)\s+(\d+)\s+(-?\d+\.\d+)$")


def test_conversion_quick(tmp_path):
    environment = {**os.environ, "TMPDIR": str(tmp_path), "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_scale.py"), "--part", "conversion", "--quick"],
        capture_output=True,
        text=True,
        env=environment,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert re.match(r"checkpoint: \d+\.\d MB in 10 shards, largest \d+\.\d MB", lines[0]), lines[0]
    rows = {match[1].strip(): match for match in map(ROW.match, lines) if match}
    expected = [
        "plain safetensors load + save",
        "convert --norm-placement pre",
        "... --no-calibrate",
        "... --no-calibrate --no-verify",
        "... --low-memory",
    ]
    assert list(rows) == expected
    # the quick source's down projection: 173 inputs (with the ones column), 64 outputs, float64
    assert lines[1].startswith(f"calibration statistics: {8 * (173 * 173 + 3 * 173 * 64) / 1e6:.1f} MB"), lines[1]
    for match in rows.values():
        seconds, plain, ratio, peak_mb = float(match[2]), float(match[3]), float(match[4]), int(match[5])
        assert seconds > 0 and plain > 0 and ratio > 0 and 100 < peak_mb < 8000
        assert float(match[6]) >= 0  # peak at the end >= peak after the imports
    assert "targets: peak <= 2x largest shard + calibration statistics; time <= 1.5x plain load-and-save" in lines
    assert list(tmp_path.glob("bench-scale-*")) == []  # the temporary checkpoints are removed

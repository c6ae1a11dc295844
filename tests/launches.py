"""Distributed launches for the tests: `torchrun --standalone` on CPU (gloo), reported by the process that failed
first."""

import os
import re
import subprocess
import sys
import warnings
from pathlib import Path


TESTS = Path(__file__).parent
ROOT_CAUSE = re.compile(
    r"Root Cause \(first observed failure\):.*?rank\s*:\s*(?P<rank>\d+).*?exitcode\s*:\s*(?P<exitcode>-?\d+)", re.S
)


def torchrun(*arguments, processes: int, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    """Runs `arguments` (a tests/ script, or -m and a module) under `torchrun --standalone` on CPU, importing this
    checkout's hf_normswap, with `env` added to the environment. A process ended by a signal prints its Python stacks
    (faulthandler). A launch whose first failed process was ended by a signal, not by an error of its own, is run
    once more, with a warning that shows that process's output: gloo on a loaded CPU machine has aborted a process now
    and then (docs/experiments/scale.md, 2026-11-29)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}"]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "CUDA_VISIBLE_DEVICES": "",
        "PYTHONFAULTHANDLER": "1",
        "PYTHONPATH": os.pathsep.join([str(TESTS.parent), str(TESTS)]),
        **(env or {}),
    }
    for attempt in range(2):
        process = subprocess.run(
            [*command, *map(str, arguments)], capture_output=True, text=True, env=env, cwd=cwd, timeout=600
        )
        root = ROOT_CAUSE.search(process.stderr)
        signalled = process.returncode != 0 and root is not None and int(root["exitcode"]) < 0
        if attempt or not signalled:
            break
        report = first_failure(process.stderr)
        warnings.warn(f"torchrun: rank {root['rank']} ended by a signal, launched again:\n{report}")
    assert process.returncode == 0, first_failure(process.stderr)
    return process


def first_failure(stderr: str) -> str:
    """What a failed launch printed, less the lines that the processes which failed after the first one prefixed
    with their rank (their tracebacks follow from its end), the last 6000 characters."""
    root = ROOT_CAUSE.search(stderr)
    if root is None:
        return stderr[-6000:]
    others = re.compile(rf"\[rank(?!{root['rank']}\])\d+\]:")
    return "\n".join(line for line in stderr.splitlines() if not others.match(line))[-6000:]

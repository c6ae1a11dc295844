"""The tests' torchrun launches (`launches.torchrun`): a process ended by a signal is launched again once, with a
warning; a process's own error fails the test at once, reported by that process's output."""

import pytest

from launches import ROOT_CAUSE, first_failure, torchrun


SCRIPT = """
import os, sys
from pathlib import Path
import torch.distributed as dist

dist.init_process_group("gloo")
rank, marker = dist.get_rank(), Path(sys.argv[2])
dist.barrier()
if rank == int(sys.argv[3]) and (sys.argv[1] == "error" or not marker.exists()):
    marker.touch()
    print(f"rank {rank} gives up", file=sys.stderr, flush=True)
    os.abort() if sys.argv[1] == "abort" else sys.exit(f"rank {rank} fails")
dist.barrier()
dist.destroy_process_group()
"""


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "launched.py"
    path.write_text(SCRIPT)
    return path


def test_a_process_ended_by_a_signal_is_launched_again(script, tmp_path):
    """Rank 1 aborts in the first launch only: the second launch passes, and the warning names rank 1 and shows
    what it printed."""
    with pytest.warns(UserWarning, match=r"rank 1 ended by a signal, launched again:(.|\n)*rank 1 gives up"):
        torchrun(script, "abort", tmp_path / "aborted", 1, processes=2, cwd=tmp_path)


def test_a_process_that_fails_fails_the_test(script, tmp_path):
    """A process that exits with an error of its own is not launched again: the assertion shows its output."""
    with pytest.raises(AssertionError, match="rank 0 fails") as failure:
        torchrun(script, "error", tmp_path / "failed", 0, processes=2, cwd=tmp_path)
    assert "rank 0 gives up" in str(failure.value)


def test_the_report_keeps_the_first_failed_process_only():
    """Of a launch's output, the report drops the lines the other ranks prefixed, and keeps torchrun's summary."""
    stderr = "\n".join(
        [
            "[rank0]: Traceback (most recent call last):",
            "[rank0]: ValueError: first",
            "[rank1]: RuntimeError: Connection reset by peer",
            "Fatal Python error: Aborted",
            "Root Cause (first observed failure):",
            "[0]:",
            "  rank      : 0 (local_rank: 0)",
            "  exitcode  : -6 (pid: 7)",
        ]
    )
    assert ROOT_CAUSE.search(stderr).groupdict() == {"rank": "0", "exitcode": "-6"}
    report = first_failure(stderr)
    assert "[rank0]: ValueError: first" in report and "Fatal Python error" in report and "exitcode" in report
    assert "[rank1]" not in report

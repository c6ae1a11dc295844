import os

import pytest
import torch


if "PYTEST_XDIST_WORKER" in os.environ:
    # Each worker computes with its share of the cores, and so do the processes its tests start (they inherit the
    # variable): with more threads than cores, torch's threads wait on each other (a healing test ran 15× slower).
    share = max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    os.environ.setdefault("OMP_NUM_THREADS", str(share))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)

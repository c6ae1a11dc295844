"""Runs the `hf-normswap` command line given on the command line (FOLDER last) under `torchrun`, then writes to
`FOLDER/rank-N.json` its exit code and whether the launch's process group was freed once it returned.

Run by `tests/test_sharding.py`."""

import json
import sys
import weakref
from pathlib import Path

import torch.distributed as dist

from hf_normswap.cli import main
from hf_normswap.sharding import processes


if __name__ == "__main__":
    argv, folder = sys.argv[1:-1], Path(sys.argv[-1])
    rank = processes().process_index  # the group started here, as the command starts it
    group = weakref.ref(dist.group.WORLD)
    code = main(argv)
    (folder / f"rank-{rank}.json").write_text(json.dumps({"code": code, "group_freed": group() is None}))

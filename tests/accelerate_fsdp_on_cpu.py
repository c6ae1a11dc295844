"""Runs a script, or `-m module`, with its arguments from the command line, with accelerate's FSDP2 plugin in effect
on CPU, where accelerate sets it aside: the Trainer's accelerator takes the plugin that an FSDP launch's variables
describe, and `hf_normswap.sharding` leaves the trained model to it, as on accelerators. Used by
`tests/test_sharding.py` under `torchrun` (gloo) to run the GPU path's Trainer, wrapping, clipping and saving where
CI runs."""

import runpy
import sys

import accelerate.state
from accelerate.utils import DistributedType

import hf_normswap.sharding.fsdp
import hf_normswap.sharding.trainer_bridge


def take_fsdp_plugin(init):
    def patched(self, *args, fsdp_plugin=None, **kwargs):
        init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)  # each call copies the processes' state (MULTI_CPU)
        fsdp_plugin = fsdp_plugin or getattr(self, "fsdp_plugin", None)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type, self.fsdp_plugin = DistributedType.FSDP, fsdp_plugin

    return patched


if __name__ == "__main__":
    accelerate.state.AcceleratorState.__init__ = take_fsdp_plugin(accelerate.state.AcceleratorState.__init__)
    hf_normswap.sharding.fsdp.accelerate_shards = lambda: True
    hf_normswap.sharding.trainer_bridge.accelerate_shards = lambda: True  # where it is read as a name too
    if sys.argv[1] == "-m":
        sys.argv = sys.argv[2:]
        runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
    else:
        sys.argv = sys.argv[1:]
        runpy.run_path(sys.argv[0], run_name="__main__")

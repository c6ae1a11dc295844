"""The shipped Accelerate configurations load with Accelerate's own reader, and `accelerate launch` turns them into an
FSDP2 plugin that wraps each NormSwapLayer."""

import os
from unittest import mock

import pytest
from accelerate.commands.config.config_args import ClusterConfig, load_config_from_file
from accelerate.commands.launch import _validate_launch_command, launch_command_parser
from accelerate.utils import FullyShardedDataParallelPlugin
from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy
from accelerate.utils.launch import prepare_multi_gpu_env

from hf_normswap import NormSwapForCausalLM, accelerate_config
from hf_normswap.model.layers_normswap import NormSwapLayer
from hf_normswap.sharding.accelerate_configs import accelerate_config_names

from helpers import tiny_config


# name: (offload, activation checkpointing)
SHIPPED = {
    "fsdp2_bf16": (False, False),
    "fsdp2_bf16_checkpointing": (False, True),
    "fsdp2_bf16_offload": (True, True),
}


def test_shipped_names():
    assert accelerate_config_names() == sorted(SHIPPED)
    with pytest.raises(ValueError, match="accelerate config 'fsdp3': not shipped; shipped are"):
        accelerate_config("fsdp3")


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_loads_with_accelerate(name):
    config = load_config_from_file(str(accelerate_config(name)))
    assert isinstance(config, ClusterConfig)
    assert (config.distributed_type.value, config.mixed_precision) == ("FSDP", "bf16")
    assert (config.num_machines, config.use_cpu) == (1, False)
    offload, checkpointing = SHIPPED[name]
    assert config.fsdp_config == {
        "fsdp_version": 2,
        "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "fsdp_transformer_layer_cls_to_wrap": "NormSwapLayer",
        "fsdp_reshard_after_forward": True,
        "fsdp_state_dict_type": "FULL_STATE_DICT",
        "fsdp_offload_params": offload,
        "fsdp_cpu_ram_efficient_loading": False,
        "fsdp_activation_checkpointing": checkpointing,
    }


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_launch_builds_an_fsdp2_plugin_wrapping_normswap_layers(name):
    command = ["--config_file", str(accelerate_config(name)), "--num_processes", "2", "-m", "hf_normswap.cli"]
    args, _, _ = _validate_launch_command(launch_command_parser().parse_args(command))
    environment = prepare_multi_gpu_env(args)
    assert (args.num_processes, environment["ACCELERATE_MIXED_PRECISION"]) == (2, "bf16")
    with mock.patch.dict(os.environ, environment):
        plugin = FullyShardedDataParallelPlugin()
    offload, checkpointing = SHIPPED[name]
    assert (plugin.fsdp_version, plugin.reshard_after_forward, plugin.state_dict_type.name) == (
        2,
        True,
        "FULL_STATE_DICT",
    )
    assert (plugin.cpu_offload is not None and type(plugin.cpu_offload).__name__ == "CPUOffloadPolicy") == offload
    assert plugin.activation_checkpointing == checkpointing
    model = NormSwapForCausalLM(tiny_config(is_causal=True, architectures=["NormSwapForCausalLM"]))
    policy = fsdp2_prepare_auto_wrap_policy(plugin, model)
    wrapped = [module for module in model.modules() if policy(module)]
    assert wrapped == list(model.model.layers) and all(isinstance(layer, NormSwapLayer) for layer in wrapped)

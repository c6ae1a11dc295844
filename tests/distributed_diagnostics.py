"""Shards a tiny NormSwap classifier as accelerate's FSDP2 does on GPUs (`fsdp2_prepare_model`: each NormSwapLayer a
unit, the untied input embeddings one, and a tail unit that stays gathered after its forward), runs the comparison's
diagnostics at the start of training (a probe's backward, its collapse figures, the gradients cleared), then one
training backward, and writes each parameter's gradient, gathered whole, to `FOLDER/rank-N.json`. Without `--shard`
the same runs on the plain model.

Run by `tests/test_sharding.py` under `torchrun` on CPU (gloo): every process takes the same batch, so the sharded
gradients must equal the plain ones."""

import argparse
import json
from pathlib import Path
from types import SimpleNamespace

import torch
from accelerate.utils import FullyShardedDataParallelPlugin
from accelerate.utils.fsdp_utils import fsdp2_prepare_model
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from hf_normswap import NormSwapForSequenceClassification
from hf_normswap.compare.training_diagnostics import DiagnosticsCallback
from hf_normswap.sharding import end_processes, processes

from helpers import padded_batch, tiny_config


def accelerate_sharded(model: torch.nn.Module) -> torch.nn.Module:
    """`model` sharded by accelerate's own FSDP2 preparation, which the Trainer runs on GPUs."""
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["NormSwapLayer"]
    )
    accelerator = SimpleNamespace(
        state=SimpleNamespace(fsdp_plugin=plugin), mixed_precision="no", is_main_process=True, device="cpu"
    )
    return fsdp2_prepare_model(accelerator, model)


def gradients(model: torch.nn.Module) -> dict[str, list]:
    whole = {}
    for name, parameter in model.named_parameters():
        gradient = parameter.grad
        whole[name] = (gradient.full_tensor() if hasattr(gradient, "full_tensor") else gradient).flatten().tolist()
    return whole


def diagnose(placement: str, shard: bool) -> dict:
    torch.manual_seed(0)
    model = NormSwapForSequenceClassification(tiny_config(norm_placement=placement, num_labels=2))
    if shard:
        model = accelerate_sharded(model)
    input_ids, attention_mask = padded_batch()
    batch = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": torch.tensor([0, 1])}
    probe = {"input_ids": input_ids[:1].tolist(), "attention_mask": attention_mask[:1].tolist(), "labels": [1]}
    DiagnosticsCallback(probe, num_layers=2).on_train_begin(None, None, None, model=model)
    units = sum(isinstance(module, FSDPModule) for module in model.modules())
    resharded = all(isinstance(parameter, DTensor) for parameter in model.parameters())  # no unit left gathered
    cleared = all(parameter.grad is None for parameter in model.parameters())
    model.train()
    model(**batch).loss.backward()
    return {"units": units, "resharded": resharded, "cleared": cleared, "gradients": gradients(model)}


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("placement")
    parser.add_argument("folder", type=Path)
    parser.add_argument("--shard", action="store_true")
    arguments = parser.parse_args()
    rank = processes().process_index
    record = diagnose(arguments.placement, arguments.shard)
    end_processes()
    (arguments.folder / f"rank-{rank}.json").write_text(json.dumps(record))

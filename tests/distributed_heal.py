"""Heals the tiny variants named on the command line, under `torchrun` on CPU with any number of processes, with
`fsdp`; rank 0 writes, per healing, what the teacher was at every step (training mode, gradients, optimizer membership,
its embeddings gathered whole) to the JSON file named on the command line.

Run by `tests/test_sharding.py`: 2 sharded processes with PER_DEVICE texts each must heal as 1 process with 2 *
PER_DEVICE does (no dropout, the same texts making up every step); the tied variant heals twice, with the KL's logits
from the heads a chunk at a time (recomputed in the backward pass) and the teacher's from its forward (`-forward`, the
student's kept for the backward pass); with --activation-checkpointing, the tied variant heals (its head a chunk at a
time) with its layers recomputed in the backward pass. The calibrated variant (`fitted`) heals with every default (its
layers fitted first, on text the teacher samples), with --fsdp where more than one process runs, in the plain runs
alone (no option, no tag), as does the sandwich variant by a gradual swap (`layers`); the tied variant then heals at a
learning rate that diverges, which every process must end alike (rank 0 writes the error to the record's name with the
suffix `.diverged`). `tests/test_sharding_gpu.py` runs it under `accelerate launch` on a GPU, also with --bf16
(bfloat16 mixed precision; the outputs' suffix `-bf16`)."""

import argparse
import json
import os
from pathlib import Path

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from hf_normswap import heal_checkpoint
from hf_normswap.heal import HealError, losses
from hf_normswap.heal import trainer as trainer_module
from hf_normswap.heal.trainer import HealTrainer
from hf_normswap.sharding import end_processes

from helpers import healed_folder


STEPS = 4
teacher_record = []


def training_step(self, model, inputs, num_items_in_batch=None):
    loss = original_step(self, model, inputs, num_items_in_batch)
    in_optimizer = {id(p) for group in self.optimizer.param_groups for p in group["params"]}
    teacher = list(self.teacher.parameters())
    teacher_record.append(
        {
            "training": self.teacher.training,
            "grads": sum(p.grad is not None for p in teacher),
            "requires_grad": sum(p.requires_grad for p in teacher),
            "in_optimizer": sum(id(p) in in_optimizer for p in teacher),
            "student_training": model.training,
            "student_wrapped": isinstance(model, DistributedDataParallel),
            "student_sharded": isinstance(model, FSDPModule),
            "teacher_sharded": isinstance(self.teacher, FSDPModule),
            "student_checkpointing": getattr(model, "module", model).is_gradient_checkpointing,
            "teacher_gathered": not isinstance(self.teacher.get_input_embeddings().weight, DTensor),
        }
    )
    return loss


original_step = HealTrainer.training_step
HealTrainer.training_step = training_step


def teacher_logits(forward: bool):
    """The KL's teacher logits from the teacher's forward and the student's kept for the backward pass (`forward`),
    or else both from their heads a chunk at a time, recomputed in the backward pass, whatever the rows."""
    trainer_module.teacher_logits_from_forward = lambda rows, teacher, device: forward
    losses.KEPT_FOR_BACKWARD_BYTES = KEPT_FOR_BACKWARD_BYTES if forward else 0


KEPT_FOR_BACKWARD_BYTES = losses.KEPT_FOR_BACKWARD_BYTES


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("folder", type=Path)
    parser.add_argument("record", type=Path)
    parser.add_argument("per_device", type=int)
    parser.add_argument("--activation-checkpointing", action="store_true", help="the tied variant alone")
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--tag", default="", help="appended to the outputs' names")
    arguments = parser.parse_args()
    folder, record, per_device = arguments.folder, arguments.record, arguments.per_device
    batch = per_device * int(os.environ.get("WORLD_SIZE", "1"))  # a step's texts, shared by the processes
    checkpointing = arguments.activation_checkpointing
    suffix = ("-checkpointed" if checkpointing else "") + ("-bf16" if arguments.bf16 else "") + arguments.tag
    # (name, objective, the teacher's logits from its forward)
    healings = [("tied", "kl", False)]
    if not checkpointing:
        healings += [("tied", "kl", True), ("untied", "kl", False), ("bert", "hidden", False)]
    results = {}
    if not (checkpointing or arguments.bf16 or arguments.tag):  # a fitted healing's defaults; --fsdp where it shards
        teacher_record.clear()
        heal_checkpoint(
            str(folder / "fitted" / "variant"),
            str(healed_folder(folder, "fitted", per_device, suffix)),
            max_steps=STEPS,
            batch_size=batch,
            reconstruct_sequences=16,
            eval_size=8,
            fsdp=int(os.environ.get("WORLD_SIZE", "1")) > 1,
            log=None,
        )
        results["fitted"] = list(teacher_record)
        heal_checkpoint(
            str(folder / "sandwich" / "variant"),
            str(healed_folder(folder, "sandwich", per_device, suffix)),
            data=str(folder / "text.txt"),
            swap_schedule="layers",
            max_steps=STEPS,
            learning_rate=1e-3,
            batch_size=batch,
            eval_size=8,
            fsdp=int(os.environ.get("WORLD_SIZE", "1")) > 1,
            log=None,
        )
    for name, objective, forward in healings:
        healing = name + ("-forward" if forward else "")
        teacher_record.clear()
        teacher_logits(forward)
        heal_checkpoint(
            str(folder / name / "variant"),
            str(healed_folder(folder, healing, per_device, suffix)),
            data=str(folder / "text.txt"),
            objective=objective,
            max_steps=STEPS,
            learning_rate=1e-3,
            batch_size=batch,
            eval_size=8,
            fsdp=True,
            activation_checkpointing=checkpointing,
            bf16=arguments.bf16,
            log=None,
        )
        results[healing] = list(teacher_record)
    diverged = None
    if not (checkpointing or arguments.bf16 or arguments.tag):  # a learning rate that diverges: every process stops
        try:
            heal_checkpoint(
                str(folder / "tied" / "variant"),
                str(healed_folder(folder, "diverged", per_device)),
                data=str(folder / "text.txt"),
                max_steps=STEPS,
                learning_rate=1e30,
                batch_size=batch,
                eval_size=8,
                fsdp=True,
                log=None,
            )
        except HealError as error:
            diverged = error
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        record.write_text(json.dumps(results, indent=1))
        if diverged:
            record.with_suffix(".diverged").write_text(str(diverged))
    end_processes()

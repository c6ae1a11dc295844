"""Loads the tied variant's healing models, and the variant as a comparison's fine-tuned model, under `torchrun` on
CPU with `fsdp`, samples its training texts from the teacher, and shards both healing models; each process writes to
`FOLDER/rank-N.json` whether each model held its weights before sharding (parameters off the meta device), the
sampled token ids, its teacher's embeddings gathered whole after sharding, and whether `end_processes` then freed the
process group (None without one).

Run by `tests/test_sharding.py`: with 2 processes only the main one reads the weights and samples, and the other
trains on the same texts and weights; with 1 process (no sharding) it reads and samples as any unsharded healing."""

import argparse
import json
import weakref
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoTokenizer

from hf_normswap.compare.variants import Start, build_model
from hf_normswap.heal.data import heal_texts, read_texts
from hf_normswap.heal.models import for_student, load_models
from hf_normswap.heal.options import HealOptions
from hf_normswap.sharding import (
    ShardingOptions,
    end_processes,
    gathered,
    loads_weights,
    prepare_frozen,
    prepare_trained,
    processes,
)


def holds_weights(model: torch.nn.Module) -> bool:
    return not any(parameter.is_meta for parameter in model.parameters())


def load_and_shard(variant: Path) -> dict:
    options = HealOptions(
        objective="kl",
        data="teacher",
        sample_count=6,
        sample_length=5,
        batch_size=2,
        max_steps=1,
        sharding=ShardingOptions(fsdp=True),
    )
    options, pair = for_student(str(variant), options)
    models = load_models(pair, options)
    loaded = {"student": holds_weights(models.student), "teacher": holds_weights(models.teacher)}
    tokenizer = AutoTokenizer.from_pretrained(variant)
    texts = heal_texts(read_texts(options), options=options, tokenizer=tokenizer, teacher=models.teacher)
    start, empty = Start(kind="converted", path=str(variant)), not loads_weights(options.sharding, trained=True)
    loaded["compared"] = holds_weights(build_model(start, seed=0, num_labels=2, causal=True, empty=empty))
    prepare_trained(models.student, options.sharding)
    prepare_frozen(models.teacher, options.sharding)
    with gathered(models.teacher):
        embeddings = models.teacher.get_input_embeddings().weight.tolist()
    return {"loaded": loaded, "texts": list(texts.train["input_ids"]), "teacher_embeddings": embeddings}


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("variant", type=Path)
    parser.add_argument("folder", type=Path)
    arguments = parser.parse_args()
    rank = processes().process_index
    group = weakref.ref(dist.group.WORLD) if dist.is_initialized() else None
    record = load_and_shard(arguments.variant)
    end_processes()
    record["group_freed"] = None if group is None else group() is None
    (arguments.folder / f"rank-{rank}.json").write_text(json.dumps(record))

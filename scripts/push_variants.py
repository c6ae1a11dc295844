"""Push every variant of a comparison output folder to the Hub, each with a card showing the comparison.

    python scripts/push_variants.py normswap-comparison --namespace my-user \
        --base-model sentence-transformers/all-MiniLM-L6-v2
    python scripts/push_variants.py normswap-comparison --namespace my-user --dry-run ./to-upload

Each variant in OUTPUT/variants/NAME goes to NAMESPACE/PREFIX-NAME (with --dry-run: into DRY_RUN/NAME).
"""

import argparse
import sys
from pathlib import Path

from hf_normswap.cli import main as cli


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("comparison", type=Path, help="output folder of `hf-normswap compare`")
    parser.add_argument("--namespace", required=True, help="Hub user or organisation")
    parser.add_argument("--prefix", default="normswap", help="repo name prefix (default: normswap)")
    parser.add_argument("--dry-run", type=Path, metavar="DIR")
    args, passed_on = parser.parse_known_args()
    variants = sorted(path for path in (args.comparison / "variants").glob("*") if (path / "config.json").exists())
    if not variants:
        print(f"push_variants: error: {args.comparison}/variants holds no NormSwap checkpoint", file=sys.stderr)
        return 1
    for variant in variants:
        command = ["push", str(variant), "--repo-id", f"{args.namespace}/{args.prefix}-{variant.name}", *passed_on]
        if args.dry_run:
            command += ["--dry-run", str(args.dry_run / variant.name)]
        if cli(command) != 0:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Writes the shipped SST-2 sample's evaluation split (hf_normswap/data/sst2/validation.jsonl) from GLUE SST-2 files.

The split is all of GLUE's validation sentences, then sentences drawn (with --seed) from GLUE's train split that are
neither rows of the sample's training split nor the same text as one, up to --size. The training split is kept as
shipped, so that the healings that read it stay the same.

    python scripts/make_sst2_sample.py ../shared/data/glue/sst2 --size 3000
"""

import argparse
import json
import random
from pathlib import Path


SAMPLE = Path(__file__).resolve().parents[1] / "hf_normswap" / "data" / "sst2"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("glue", type=Path, help="folder holding GLUE SST-2's train.jsonl and validation.jsonl")
    parser.add_argument("--size", type=int, default=3000, help="sentences in the evaluation split")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    train = _rows(SAMPLE / "train.jsonl")
    validation = _rows(args.glue / "validation.jsonl")
    if args.size < len(validation):
        parser.error(f"--size {args.size} is below GLUE's {len(validation)} validation sentences")
    taken = {row["idx"] for row in train}
    texts = {row["sentence"].strip() for row in train + validation}
    candidates = {}  # one row a text
    for row in _rows(args.glue / "train.jsonl"):
        if row["idx"] not in taken and row["sentence"].strip() not in texts:
            candidates.setdefault(row["sentence"].strip(), row)
    candidates = list(candidates.values())
    drawn = random.Random(args.seed).sample(candidates, args.size - len(validation))
    rows = validation + drawn  # GLUE's validation first, then the train split's sentences
    (SAMPLE / "validation.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    print(f"{SAMPLE / 'validation.jsonl'}: {len(validation)} validation and {len(drawn)} train-split sentences")


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line]


if __name__ == "__main__":
    main()

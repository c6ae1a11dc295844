"""Fine-tune NormSwap variants and report (HF-style entry point of `hf-normswap compare`).

python scripts/run_comparison.py                                   # the offline default: MiniLM, SST-2 sample
python scripts/run_comparison.py --config experiment.yaml
torchrun --nproc_per_node 2 scripts/run_comparison.py --model bert-base-uncased --task rte --seeds 5
"""

import sys

from hf_normswap.cli import main


if __name__ == "__main__":
    sys.exit(main(["compare", *sys.argv[1:]]))

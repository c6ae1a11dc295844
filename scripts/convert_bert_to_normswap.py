"""Convert a BERT, RoBERTa or XLM-RoBERTa checkpoint to NormSwap (HF-style entry point of `hf-normswap convert`).

python scripts/convert_bert_to_normswap.py bert-base-uncased ./bert-pre --norm-placement pre
"""

import sys

from hf_normswap.cli import main


if __name__ == "__main__":
    sys.exit(main(["convert", *sys.argv[1:], "--family", "bert"]))

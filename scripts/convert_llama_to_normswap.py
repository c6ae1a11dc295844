"""Convert a Llama, Mistral, Qwen2 or Qwen3 checkpoint to NormSwap (HF-style entry point of `hf-normswap convert`).

python scripts/convert_llama_to_normswap.py meta-llama/Llama-3.2-1B ./llama-encoder
"""

import sys

from hf_normswap.cli import main


if __name__ == "__main__":
    sys.exit(main(["convert", *sys.argv[1:], "--family", "llama"]))

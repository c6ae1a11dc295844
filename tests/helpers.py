"""Shared test helpers: tiny NormSwap configs and batches, tiny random source checkpoints built from Transformers'
own configs and saved to temporary folders, a tiny task, reading tensors back."""

import contextlib
import json
import os
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
from transformers import BertTokenizer, PreTrainedTokenizerFast

from hf_normswap import NormSwapConfig, convert_checkpoint
from hf_normswap.probes.probe_data import SENTENCES


WORDS = sorted({word.strip(".,").lower() for sentence in SENTENCES for word in sentence.split()} | {".", ","})
BERT_SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
LLAMA_SPECIALS = ["<unk>", "<s>", "</s>", "<|endoftext|>"]
SHAPE = dict(
    hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, max_position_embeddings=64
)


def bert_tokenizer(folder: Path) -> int:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.txt").write_text("\n".join(BERT_SPECIALS + WORDS) + "\n")
    BertTokenizer(str(folder / "vocab.txt")).save_pretrained(folder)
    return len(BERT_SPECIALS) + len(WORDS)


def llama_tokenizer(folder: Path) -> int:
    """A word-level tokenizer with no pad token, as LLaMA's."""
    vocab = {token: index for index, token in enumerate(LLAMA_SPECIALS + WORDS)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.normalizer = normalizers.Lowercase()
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    tokenizer.save_pretrained(folder)
    return len(vocab)


BERT_FAMILY = {
    "bert": ("BertConfig", {}),
    "roberta": ("RobertaConfig", {"pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2}),
    "xlm-roberta": ("XLMRobertaConfig", {"pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2}),
    "distilbert": ("DistilBertConfig", {"hidden_dim": 64}),
    "electra": ("ElectraConfig", {"embedding_size": 16}),
    # three layers: global, local, local; a window of 4 tokens each side (local_attention 8)
    "modernbert": (
        "ModernBertConfig",
        {
            "num_hidden_layers": 3,
            "local_attention": 8,
            "pad_token_id": 0,
            "bos_token_id": 2,
            "eos_token_id": 3,
            "cls_token_id": 2,
            "sep_token_id": 3,
        },
    ),
}
LLAMA_FAMILY = {
    "llama": ("LlamaConfig", {}),
    "mistral": ("MistralConfig", {"sliding_window": None}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {"head_dim": 8}),
}
# Causal families beyond LLaMA, with the features they convert exactly: the special tokens are the tokenizer's,
# windows (4) shorter than the test sequences (16), a query scale that is not head_dim's.
SPECIAL_IDS = {"pad_token_id": None, "bos_token_id": 1, "eos_token_id": 2}
GEMMA = {
    "num_key_value_heads": 2,
    "head_dim": 8,
    "query_pre_attn_scalar": 16,
    "sliding_window": 4,
    "layer_types": ["sliding_attention", "full_attention"],
    **SPECIAL_IDS,
}
CAUSAL_FAMILY = {
    "gpt2": ("GPT2Config", {"n_inner": 64, **SPECIAL_IDS}),
    "gemma2": ("Gemma2Config", {**GEMMA, "attn_logit_softcapping": 3.0, "final_logit_softcapping": 5.0}),
    "gemma3_text": (
        "Gemma3TextConfig",
        {
            **GEMMA,
            "rope_parameters": {
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
        },
    ),
    "olmo2": ("Olmo2Config", {"num_key_value_heads": 2, **SPECIAL_IDS}),
}
ARCHITECTURE_PREFIX = {
    "bert": "Bert",
    "roberta": "Roberta",
    "xlm-roberta": "XLMRoberta",
    "llama": "Llama",
    "mistral": "Mistral",
    "qwen2": "Qwen2",
    "qwen3": "Qwen3",
    "gpt2": "GPT2",
    "gemma2": "Gemma2",
    "gemma3_text": "Gemma3",
    "olmo2": "Olmo2",
    "distilbert": "DistilBert",
    "electra": "Electra",
    "modernbert": "ModernBert",
}


def interpreters(variable: str) -> dict[str, str]:
    """The "VERSION=PYTHON" pairs (separated by os.pathsep) that `.ci/run` names in `variable`."""
    return dict(pair.split("=", 1) for pair in os.environ.get(variable, "").split(os.pathsep) if pair)


def release(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


CLEAN_PYTHONS = interpreters("HF_NORMSWAP_CLEAN_PYTHONS")  # environments of torch and one Transformers release each
PACKAGE_PYTHONS = interpreters("HF_NORMSWAP_PACKAGE_PYTHONS")  # hf_normswap with the oldest release
RELEASES = sorted(CLEAN_PYTHONS, key=release)


def save_source(folder: Path, model_type: str, head_suffix: str, seed: int = 0, tokenizer: bool = True, **overrides):
    """Saves a tiny `<Prefix><head_suffix>` model (e.g. BertForMaskedLM) with a tokenizer; returns the model."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    llama = model_type not in BERT_FAMILY
    config_name, fields = {**BERT_FAMILY, **LLAMA_FAMILY, **CAUSAL_FAMILY}[model_type]
    vocab_size = 64
    if tokenizer:
        vocab_size = (llama_tokenizer if llama else bert_tokenizer)(folder)
    extra = {"num_key_value_heads": 2} if model_type in LLAMA_FAMILY else {}
    shape = {k: v for k, v in SHAPE.items() if k not in {**fields, **overrides}}
    if model_type == "distilbert":  # its feed-forward width is hidden_dim
        shape.pop("intermediate_size")
    config = getattr(transformers, config_name)(vocab_size=vocab_size, **shape, **extra, **{**fields, **overrides})
    if model_type in ("roberta", "xlm-roberta"):
        config.max_position_embeddings = 64 + config.pad_token_id + 1
    torch.manual_seed(seed)
    model = getattr(transformers, ARCHITECTURE_PREFIX[model_type] + head_suffix)(config).eval()
    with torch.no_grad():  # non-trivial norms, so that misplaced norm weights show
        for name, parameter in model.named_parameters():
            if "norm" in name.lower() or ".ln_" in name:
                parameter.add_(0.1 * torch.randn_like(parameter))
    model.save_pretrained(folder)
    return model


MAX_SEQ_LENGTH = 24  # the tiny sources' model takes 64 positions


def sentence_source(folder: Path, model_type: str, pooling: str) -> Path:
    """A tiny sentence-transformers model (Transformer, Pooling, Normalize) saved by sentence-transformers itself."""
    from sentence_transformers import SentenceTransformer, models

    save_source(folder / "model", model_type, "Model")
    transformer = models.Transformer(str(folder / "model"), max_seq_length=MAX_SEQ_LENGTH)
    if transformer.tokenizer.pad_token is None:  # LLaMA-style: pad with EOS, as the converter would
        transformer.tokenizer.pad_token = transformer.tokenizer.eos_token
    dimension = transformer.auto_model.config.hidden_size
    pipeline = SentenceTransformer(modules=[transformer, models.Pooling(dimension, pooling), models.Normalize()])
    pipeline.save(str(folder / "source"))
    return folder / "source"


def tiny_config(**overrides) -> NormSwapConfig:
    """A NormSwap config small enough for fast CPU tests; dropout off so outputs are deterministic."""
    fields = dict(
        vocab_size=99,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    fields.update(overrides)
    return NormSwapConfig(**fields)


def padded_batch(vocab_size: int = 99, lengths=(9, 6), seed: int = 0):
    """Random token ids, right-padded with id 0, and the matching attention mask."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(1, vocab_size, (len(lengths), max(lengths)), generator=generator)
    attention_mask = torch.zeros_like(input_ids)
    for row, length in enumerate(lengths):
        attention_mask[row, :length] = 1
    return input_ids.masked_fill(attention_mask == 0, 0), attention_mask


def tensors(folder):
    """All tensors of a checkpoint folder, by name."""
    state = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            state.update(load_file(folder / name))
    return state


def tiny_task(folder, rows=48):
    """A learnable two-class task: the label says whether the text mentions the fox."""
    folder.mkdir(parents=True, exist_ok=True)
    words = ["the quick brown fox", "a small dog barked", "the lazy dog slept", "she read the letter"]
    for split, count in (("train", rows), ("validation", 16)):
        with open(folder / f"{split}.jsonl", "w") as file:
            for index in range(count):
                text = words[index % 4] + (" again" if index % 3 else "")
                file.write(json.dumps({"text": text, "label": int("fox" in text)}) + "\n")
    return folder


NEW_TOKENS = 32


def greedy(model, input_ids, attention_mask):
    return model.generate(
        input_ids,
        attention_mask=attention_mask,
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS,
        do_sample=False,
        pad_token_id=0,
    )


def left_padded_prompts(vocab_size, lengths=(7, 4)):
    input_ids, attention_mask = padded_batch(vocab_size=vocab_size, lengths=lengths)
    return input_ids.flip(1), attention_mask.flip(1)  # generation pads on the left


# The fields that make a NormSwap config LLaMA-like (pre-LN, RMSNorm, RoPE, SwiGLU, GQA, no biases).
LLAMA_LIKE = dict(
    norm_placement="pre",
    norm_type="rmsnorm",
    position_embedding_type="rope",
    mlp_type="glu",
    hidden_act="silu",
    num_key_value_heads=2,
    attention_bias=False,
    mlp_bias=False,
)


# Sharded healing (tests/test_sharding.py, tests/test_sharding_gpu.py): the tolerance of float32 sums reordered
TOLERANCE = 1e-5
# A key bias shifts every score of a query alike, which softmax ignores: its gradient is zero but for rounding,
# which Adam scales up to steps of the learning rate's size in either run. Its weights are not compared.
ZERO_GRADIENT = "k_proj.bias"


def sharding_variants(folder: Path) -> Path:
    """Tiny LLaMAs with a tied and an untied head converted to post-LN (causal), the tied one calibrated too
    (`fitted`: its healing fits the layers first) and calibrated into sandwich (`sandwich`: healed by a gradual
    swap), a BERT converted to pre-LN, and a text file to heal them on."""
    sources = {
        "tied": ("llama", "ForCausalLM", {"tie_word_embeddings": True}),
        "untied": ("llama", "ForCausalLM", {"tie_word_embeddings": False}),
        "fitted": ("llama", "ForCausalLM", {"tie_word_embeddings": True}),
        "sandwich": ("llama", "ForCausalLM", {"tie_word_embeddings": True}),
        "bert": ("bert", "Model", {}),
    }
    for name, (family, head, fields) in sources.items():
        save_source(folder / name / "source", family, head, initializer_range=0.2, **fields)
        causal = {"attention": "causal"} if family == "llama" else {}
        convert_checkpoint(
            str(folder / name / "source"),
            str(folder / name / "variant"),
            norm_placement={"llama": "post", "bert": "pre"}[family] if name != "sandwich" else "sandwich",
            calibrate=name in ("fitted", "sandwich"),
            log=lambda line: None,
            **causal,
        )
    (folder / "text.txt").write_text("\n".join(SENTENCES * 8) + "\n")
    return folder


def healed_folder(variants: Path, healing: str, per_device: int, suffix: str = "") -> Path:
    """Where tests/distributed_heal.py wrote `healing` ("tied", "tied-forward", "untied", "bert", ...) of `variants`,
    healed with `per_device` texts a process (its options' `suffix` added)."""
    name, _, forward = healing.partition("-")
    return variants / name / f"healed-{per_device}{'-forward' if forward else ''}{suffix}"


def logged(folder, key: str) -> list[float]:
    """The values of `key` that the healing in `folder` logged at each step."""
    history = json.loads((folder / "heal.json").read_text())["log_history"]
    return [entry[key] for entry in history if key in entry and "train_loss" not in entry]


def figures(entry, path: str = "") -> dict:
    """The values of a nested heal.json entry (dicts and lists), by their path: what `pytest.approx` compares."""
    if isinstance(entry, dict | list):
        items = entry.items() if isinstance(entry, dict) else enumerate(entry)
        return {name: value for key, item in items for name, value in figures(item, f"{path}/{key}").items()}
    return {path: entry}


def assert_same_healing(healed: Path, reference: Path) -> None:
    """The two healings took the same steps (at least 3 of their 4: the development texts may stop them), logged the
    same losses and gradient norms at each, measured the same student before and after, and saved the same tensors
    (the key bias aside: ZERO_GRADIENT), within TOLERANCE."""
    got, expected = (json.loads((folder / "heal.json").read_text()) for folder in (healed, reference))
    assert got["steps"] == expected["steps"] >= 3
    for key in ("loss", "grad_norm"):
        logs = logged(healed, key), logged(reference, key)
        assert len(logs[0]) == len(logs[1]) == got["steps"]
        assert max(abs(a - b) for a, b in zip(*logs)) <= TOLERANCE, (key, *logs)
    for key in ("before", "after", "next_token"):
        assert figures(got[key]) == pytest.approx(figures(expected[key]), abs=TOLERANCE), key
    got, expected = tensors(healed), tensors(reference)
    assert got.keys() == expected.keys()  # the full model: a tied head saved once, as unsharded
    assert max((got[k] - expected[k]).abs().max().item() for k in got if ZERO_GRADIENT not in k) <= TOLERANCE


def comparison_arguments(folder: Path) -> list[str]:
    """`compare`'s arguments for the sharded-comparison tests: a tiny BERT without dropout and a tiny task (written to
    `folder`), `post` and `pre+heal` fine-tuned one epoch of 32 examples with one seed, every step logged, the
    learning rates relative to the source's (measured on the sharded weights)."""
    no_dropout = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, classifier_dropout=0.0)
    save_source(folder / "bert", "bert", "Model", initializer_range=0.2, **no_dropout)
    task = tiny_task(folder / "task", rows=36)  # 32 training rows beside the development split: whole batches
    options = dict(model=str(folder / "bert"), task=str(task), text_columns=["text"], variants=["post", "pre+heal"])
    options.update(seeds=1, epochs=1, learning_rate=1e-3, logging_steps=1)
    arguments = [
        f"--{name.replace('_', '-')}={','.join(v) if isinstance(v, list) else v}" for name, v in options.items()
    ]
    return [*arguments, "--relative-learning-rates"]


def comparison_batch_arguments(batch: int) -> list[str]:
    """`compare`'s batch size (shared by the processes), for fine-tuning and for 2 steps of healing on `hidden` (no
    batch-level terms: see docs/healing.md)."""
    heal = {"max_steps": 2, "eval_size": 8, "objective": "hidden", "batch_size": batch}
    return [f"--batch-size={batch}", "--heal", json.dumps(heal)]


def assert_same_comparison(output: Path, reference: Path) -> None:
    """The two comparisons' runs logged the same losses at every step, and ended with the same metrics and healing
    figures, within TOLERANCE."""
    got, expected = (json.loads((folder / "results.json").read_text())["runs"] for folder in (output, reference))
    assert [run["variant"] for run in got] == [run["variant"] for run in expected] == ["post", "pre+heal"]
    for run, reference_run in zip(got, expected):
        losses = [[entry["loss"] for entry in r["log_history"] if "loss" in entry] for r in (run, reference_run)]
        assert len(losses[0]) == len(losses[1]) == 4
        assert max(abs(a - b) for a, b in zip(*losses)) <= TOLERANCE, losses
        assert run["metrics"].keys() == reference_run["metrics"].keys()
        for key in ("loss", "accuracy"):
            assert abs(run["metrics"][key] - reference_run["metrics"][key]) <= TOLERANCE, (key, run, reference_run)
    assert got[1]["heal"]["after"] == pytest.approx(expected[1]["heal"]["after"], abs=TOLERANCE)
    assert max(abs(scale - 1) for scale in got[0]["learning_rate_scales"].values()) < 1e-5  # post: the source
    assert got[1]["learning_rate_scales"] == pytest.approx(expected[1]["learning_rate_scales"], rel=1e-5)
    assert max(abs(scale - 1) for scale in got[1]["learning_rate_scales"].values()) > 0.01  # pre+heal: calibrated


@contextlib.contextmanager
def interrupted(monkeypatch, module, trainer: str, step: int):
    """Within it, the Trainer class `module.<trainer>` stops training (KeyboardInterrupt, expected) once `step` steps
    are done, as an interrupted run would; after it, the class is the original again."""
    original = getattr(module, trainer)

    class Interrupted(original):
        def training_step(self, *args, **kwargs):
            if self.state.global_step == step:
                raise KeyboardInterrupt
            return super().training_step(*args, **kwargs)

    monkeypatch.setattr(module, trainer, Interrupted)
    with pytest.raises(KeyboardInterrupt):
        yield
    monkeypatch.setattr(module, trainer, original)

"""Tiny random source checkpoints built from Transformers' own configs, saved to temporary folders."""

from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
from transformers import BertTokenizer, PreTrainedTokenizerFast

from hf_normswap.swap_effect import SENTENCES


WORDS = sorted({word.strip(".,").lower() for sentence in SENTENCES for word in sentence.split()} | {".", ","})
BERT_SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
LLAMA_SPECIALS = ["<unk>", "<s>", "</s>", "<|endoftext|>"]
SHAPE = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, max_position_embeddings=64)


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
    "modernbert": ("ModernBertConfig", {"num_hidden_layers": 3, "local_attention": 8, "pad_token_id": 0,
                                        "bos_token_id": 2, "eos_token_id": 3, "cls_token_id": 2, "sep_token_id": 3}),
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
GEMMA = {"num_key_value_heads": 2, "head_dim": 8, "query_pre_attn_scalar": 16, "sliding_window": 4,
         "layer_types": ["sliding_attention", "full_attention"], **SPECIAL_IDS}
CAUSAL_FAMILY = {
    "gpt2": ("GPT2Config", {"n_inner": 64, **SPECIAL_IDS}),
    "gemma2": ("Gemma2Config", {**GEMMA, "attn_logit_softcapping": 3.0, "final_logit_softcapping": 5.0}),
    "gemma3_text": ("Gemma3TextConfig", {**GEMMA, "rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}),
    "olmo2": ("Olmo2Config", {"num_key_value_heads": 2, **SPECIAL_IDS}),
}
ARCHITECTURE_PREFIX = {"bert": "Bert", "roberta": "Roberta", "xlm-roberta": "XLMRoberta", "llama": "Llama",
                       "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3", "gpt2": "GPT2",
                       "gemma2": "Gemma2", "gemma3_text": "Gemma3", "olmo2": "Olmo2", "distilbert": "DistilBert",
                       "electra": "Electra", "modernbert": "ModernBert"}


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

"""A saved variant works with the rest of the ecosystem: pipelines, sentence-transformers, PEFT."""

import pytest
import torch
from datasets import Dataset
from transformers import AutoTokenizer, Trainer, TrainingArguments, pipeline

from hf_normswap import (
    NormSwapForMaskedLM,
    NormSwapForSequenceClassification,
    NormSwapForTokenClassification,
    NormSwapModel,
    convert_checkpoint,
)
from hf_normswap.probes.probe_data import SENTENCES

from helpers import save_source


@pytest.fixture(scope="module")
def variants(tmp_path_factory):
    """Tiny BERT checkpoints (masked-LM, sequence and token classification) converted to a pre-LN RoPE variant."""
    root = tmp_path_factory.mktemp("ecosystem")
    folders = {}
    for suffix, head in (
        ("ForMaskedLM", "masked-lm"),
        ("ForSequenceClassification", "sequence-classification"),
        ("ForTokenClassification", "token-classification"),
    ):
        save_source(root / suffix, "bert", suffix, initializer_range=0.2)  # inputs told apart, unlike at 0.02
        convert_checkpoint(
            str(root / suffix),
            str(root / head),
            norm_placement="pre",
            position_embedding_type="rope",
            log=lambda _: None,
        )
        folders[head] = root / head
    return folders


def test_fill_mask_pipeline(variants):
    fill = pipeline("fill-mask", model=str(variants["masked-lm"]), top_k=3)
    results = fill("the quick brown [MASK] jumps")
    model = NormSwapForMaskedLM.from_pretrained(variants["masked-lm"]).eval()
    tokenizer = AutoTokenizer.from_pretrained(variants["masked-lm"])
    batch = tokenizer("the quick brown [MASK] jumps", return_tensors="pt")
    with torch.no_grad():
        probabilities = model(**batch).logits[0, 4].softmax(-1)
    expected = probabilities.topk(3)
    assert [r["token"] for r in results] == expected.indices.tolist()
    assert [r["score"] for r in results] == pytest.approx(expected.values.tolist(), abs=1e-6)


def test_text_and_token_classification_pipelines(variants):
    classify = pipeline("text-classification", model=str(variants["sequence-classification"]))
    model = NormSwapForSequenceClassification.from_pretrained(variants["sequence-classification"]).eval()
    tokenizer = AutoTokenizer.from_pretrained(variants["sequence-classification"])
    with torch.no_grad():
        probabilities = model(**tokenizer(SENTENCES[0], return_tensors="pt")).logits.softmax(-1)[0]
    result = classify(SENTENCES[0])[0]
    assert result["label"] == model.config.id2label[int(probabilities.argmax())]
    assert result["score"] == pytest.approx(probabilities.max().item(), abs=1e-6)

    tag = pipeline("token-classification", model=str(variants["token-classification"]))
    entities = tag(SENTENCES[2])
    token_model = NormSwapForTokenClassification.from_pretrained(variants["token-classification"]).eval()
    with torch.no_grad():
        labels = token_model(**tokenizer(SENTENCES[2], return_tensors="pt")).logits.argmax(-1)[0, 1:-1]
    named = [token_model.config.id2label[int(label)] for label in labels]
    assert [entity["entity"] for entity in entities] == [label for label in named if label != "O"]


def test_feature_extraction_pipeline(variants):
    extract = pipeline("feature-extraction", model=str(variants["masked-lm"]))
    features = torch.tensor(extract(SENTENCES[1]))
    model = NormSwapModel.from_pretrained(variants["masked-lm"]).eval()
    tokenizer = AutoTokenizer.from_pretrained(variants["masked-lm"])
    with torch.no_grad():
        expected = model(**tokenizer(SENTENCES[1], return_tensors="pt")).last_hidden_state
    assert features.shape == expected.shape and (features - expected).abs().max().item() <= 1e-5


def test_sentence_transformers_loads_a_variant(variants):
    sentence_transformers = pytest.importorskip("sentence_transformers", reason="needs the dev extra")
    encoder = sentence_transformers.SentenceTransformer(str(variants["masked-lm"]), device="cpu")
    embeddings = encoder.encode(SENTENCES[:3], convert_to_tensor=True)
    model = NormSwapModel.from_pretrained(variants["masked-lm"]).eval()
    tokenizer = AutoTokenizer.from_pretrained(variants["masked-lm"])
    batch = tokenizer(SENTENCES[:3], padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).float()
    expected = (hidden * mask).sum(1) / mask.sum(1)
    assert embeddings.shape == (3, 32) and (embeddings.cpu() - expected).abs().max().item() <= 1e-5


def test_lora_on_q_and_v_trains_and_merges(variants, tmp_path):
    peft = pytest.importorskip("peft", reason="needs the dev extra")
    model = NormSwapForSequenceClassification.from_pretrained(variants["sequence-classification"])
    lora = peft.get_peft_model(
        model, peft.LoraConfig(task_type="SEQ_CLS", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    )
    trainable = [name for name, p in lora.named_parameters() if p.requires_grad]
    assert any("q_proj.lora_A" in name for name in trainable) and any("v_proj.lora_B" in name for name in trainable)
    assert not any("k_proj" in name for name in trainable)
    tokenizer = AutoTokenizer.from_pretrained(variants["sequence-classification"])
    texts = [SENTENCES[i % 2] for i in range(32)]
    data = Dataset.from_dict({**tokenizer(texts, padding=True), "labels": [i % 2 for i in range(32)]})
    args = TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=8,
        learning_rate=1e-2,
        num_train_epochs=15,
        logging_steps=4,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
    )
    trainer = Trainer(model=lora, args=args, train_dataset=data)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert losses[-1] < 0.5 * losses[0], losses
    lora.eval()
    batch = tokenizer(SENTENCES[:2], padding=True, return_tensors="pt")
    with torch.no_grad():
        adapted = lora(**batch).logits
        merged = lora.merge_and_unload()
        assert type(merged) is NormSwapForSequenceClassification
        assert (merged(**batch).logits - adapted).abs().max().item() <= 1e-5

"""Packed (padding-free) batches give what padded batches give, for every head, position scheme and backend."""

import pytest
import torch
from transformers import DataCollatorWithFlattening
from transformers import modeling_flash_attention_utils as flash_utils

from hf_normswap import (
    DataCollatorWithPacking,
    NormSwapForCausalLM,
    NormSwapForMaskedLM,
    NormSwapForQuestionAnswering,
    NormSwapForSequenceClassification,
    NormSwapForTokenClassification,
    NormSwapModel,
)
from hf_normswap.model.configuration_normswap import POSITION_EMBEDDING_TYPES
from hf_normswap.model.packing import first_fit_decreasing

from helpers import tiny_config


LENGTHS = (9, 4, 6, 3, 7)
POSITIONS = [*POSITION_EMBEDDING_TYPES, "roberta"]  # roberta: absolute positions after an offset of 2


def examples(lengths=LENGTHS, seed=0, head="base", vocab_size=99):
    """Tokenized examples (no padding) with token types and the labels `head` takes."""
    generator = torch.Generator().manual_seed(seed)
    features = []
    for index, length in enumerate(lengths):
        input_ids = torch.randint(1, 99, (length,), generator=generator).tolist()
        feature = {"input_ids": input_ids, "token_type_ids": [0] * (length // 2) + [1] * (length - length // 2)}
        if head in ("cls", "mean", "last"):
            feature["label"] = index % 3
        elif head == "question-answering":
            feature.update(start_positions=index % length, end_positions=length - 1)
        elif head != "base":
            feature["labels"] = [(t * 7 + i) % vocab_size if (t + i) % 3 else -100 for i, t in enumerate(input_ids)]
        features.append(feature)
    return features


def padded(features):
    """The same examples as a right-padded batch (labels -100 at the padding)."""
    lengths = [len(f["input_ids"]) for f in features]
    batch = {"attention_mask": torch.zeros(len(features), max(lengths), dtype=torch.long)}
    for row, length in enumerate(lengths):
        batch["attention_mask"][row, :length] = 1
    for key in features[0]:
        name = "labels" if key == "label" else key
        if isinstance(features[0][key], list):
            batch[name] = torch.full(batch["attention_mask"].shape, -100 if key == "labels" else 0)
            for row, feature in enumerate(features):
                batch[name][row, : lengths[row]] = torch.tensor(feature[key])
        else:
            batch[name] = torch.tensor([feature[key] for feature in features])
    return batch


def position_config(position, **overrides):
    if position == "roberta":
        return tiny_config(position_embedding_type="absolute", position_offset=2, **overrides)
    return tiny_config(position_embedding_type=position, **overrides)


HEADS = {
    "base": (NormSwapModel, {}),
    "masked-lm": (NormSwapForMaskedLM, {}),
    "cls": (NormSwapForSequenceClassification, {"num_labels": 3, "classifier_pooling": "cls"}),
    "mean": (NormSwapForSequenceClassification, {"num_labels": 3, "classifier_pooling": "mean"}),
    "last": (NormSwapForSequenceClassification, {"num_labels": 3, "classifier_pooling": "last"}),
    "token-classification": (NormSwapForTokenClassification, {"num_labels": 5}),
    "question-answering": (NormSwapForQuestionAnswering, {}),
    "causal-lm": (NormSwapForCausalLM, {}),
}


def tokens_of(packed_output, packed_batch, padded_output):
    """Packed per-token outputs rearranged to the padded layout, real tokens only, and the padded ones."""
    seq_idx, position_ids = packed_batch["seq_idx"], packed_batch["position_ids"]
    real = seq_idx >= 0
    return packed_output[real], padded_output[seq_idx[real], position_ids[real]]


@pytest.mark.parametrize(
    "head, is_causal",
    [(head, is_causal) for head in HEADS for is_causal in (False, True) if is_causal or head != "causal-lm"],
)
@pytest.mark.parametrize("position", POSITIONS)
def test_packed_equals_padded(head, position, is_causal):
    model_class, overrides = HEADS[head]
    for attn_implementation in ("eager", "sdpa"):
        config = position_config(position, is_causal=is_causal, **overrides)
        model = model_class._from_config(config, attn_implementation=attn_implementation).eval()
        vocab_size = config.num_labels if head == "token-classification" else config.vocab_size
        features = examples(head=head, vocab_size=vocab_size)
        packed_batch = DataCollatorWithPacking()(features)
        with torch.no_grad():
            padded_out, packed_out = model(**padded(features)), model(**packed_batch)
        if head in ("cls", "mean", "last"):
            assert packed_out.logits.shape == padded_out.logits.shape == (5, 3)
            pairs = [(packed_out.logits, padded_out.logits)]
        elif head == "question-answering":
            real = padded(features)["attention_mask"].bool()
            assert packed_out.start_logits.shape == padded_out.start_logits.shape
            assert (packed_out.start_logits[~real] == torch.finfo(torch.float32).min).all()
            pairs = [
                (packed_out.start_logits[real], padded_out.start_logits[real]),
                (packed_out.end_logits[real], padded_out.end_logits[real]),
            ]
        else:
            name = "last_hidden_state" if head == "base" else "logits"
            pairs = [tokens_of(getattr(packed_out, name), packed_batch, getattr(padded_out, name))]
        if head != "base":
            pairs.append((packed_out.loss, padded_out.loss))
        for packed_value, padded_value in pairs:
            assert (packed_value - padded_value).abs().max().item() <= 1e-5, attn_implementation


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa", "flex_attention"])
@pytest.mark.parametrize("is_causal", [False, True])
def test_no_attention_across_sequences(attn_implementation, is_causal):
    position = "alibi" if attn_implementation != "flex_attention" else "rope"
    model = NormSwapModel._from_config(
        position_config(position, is_causal=is_causal), attn_implementation=attn_implementation
    ).eval()
    features = examples()
    changed = [dict(f) for f in features]
    changed[2]["input_ids"] = [(t + 5) % 98 + 1 for t in changed[2]["input_ids"]]
    collate = DataCollatorWithPacking()
    with torch.no_grad():
        batch, other = collate(features), collate(changed)
        assert torch.equal(batch["seq_idx"], other["seq_idx"])
        before = model(
            input_ids=batch["input_ids"], seq_idx=batch["seq_idx"], position_ids=batch["position_ids"]
        ).last_hidden_state
        after = model(
            input_ids=other["input_ids"], seq_idx=other["seq_idx"], position_ids=other["position_ids"]
        ).last_hidden_state
    sequence = batch["seq_idx"]
    assert (
        before[(sequence != 2) & (sequence >= 0)] - after[(sequence != 2) & (sequence >= 0)]
    ).abs().max().item() <= 1e-6
    assert (before[sequence == 2] - after[sequence == 2]).abs().max().item() > 1e-3


def test_transformers_flattening_collator():
    """DataCollatorWithFlattening's one-row batches: boundaries from its position ids, or from its seq_idx."""
    features = examples()
    model = NormSwapForCausalLM._from_config(
        tiny_config(is_causal=True, position_embedding_type="rope"), attn_implementation="sdpa"
    ).eval()
    reference = padded(features)
    del reference["token_type_ids"]  # the flattening collator keeps input ids only
    reference["labels"] = reference["input_ids"].masked_fill(reference["attention_mask"] == 0, -100)
    with torch.no_grad():
        expected = model(**reference)
        for collator in (
            DataCollatorWithFlattening(),
            DataCollatorWithFlattening(return_seq_idx=True, return_position_ids=False),
        ):
            batch = collator([{"input_ids": f["input_ids"]} for f in features])
            assert batch["input_ids"].shape == (1, sum(LENGTHS))
            output = model(**batch)
            start = 0
            for row, length in enumerate(LENGTHS):
                got = output.logits[0, start : start + length]
                assert (got - expected.logits[row, :length]).abs().max().item() <= 1e-5
                start += length
            assert abs(output.loss.item() - expected.loss.item()) <= 1e-5


def test_flash_varlen_path_with_a_reference_kernel(monkeypatch):
    """The flash-attention path (not installed here) gets the sequence boundaries as varlen kwargs; a per-sequence
    reference kernel in place of flash-attn's gives the padded result."""

    def varlen_reference(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p=0.0,
        softmax_scale=None,
        causal=False,
    ):
        out = torch.empty_like(q)
        for start, end in zip(cu_seqlens_q[:-1].tolist(), cu_seqlens_q[1:].tolist()):
            attend = lambda x: x[start:end].transpose(0, 1)  # noqa: E731
            out[start:end] = torch.nn.functional.scaled_dot_product_attention(
                attend(q), attend(k), attend(v), is_causal=causal, scale=softmax_scale
            ).transpose(0, 1)
        return out

    kernels = (None, varlen_reference, None, flash_utils._pad_input, flash_utils._unpad_input)
    process = flash_utils._lazy_define_process_function(varlen_reference)
    monkeypatch.setattr(flash_utils, "lazy_import_flash_attention", lambda *args, **kwargs: (kernels, (process, dict)))
    for is_causal in (False, True):
        model = NormSwapModel._from_config(
            tiny_config(position_embedding_type="rope", is_causal=is_causal), attn_implementation="eager"
        ).eval()
        batch = DataCollatorWithPacking()(examples())
        with torch.no_grad():
            expected = model(
                input_ids=batch["input_ids"], seq_idx=batch["seq_idx"], position_ids=batch["position_ids"]
            ).last_hidden_state
            model.config._attn_implementation = "flash_attention_2"
            got = model(
                input_ids=batch["input_ids"], seq_idx=batch["seq_idx"], position_ids=batch["position_ids"]
            ).last_hidden_state
        real = batch["seq_idx"] >= 0
        assert (got[real] - expected[real]).abs().max().item() <= 1e-5


def test_collator_layout():
    features = examples(head="cls")
    batch = DataCollatorWithPacking(pad_token_id=0)(features)
    assert batch["input_ids"].shape == (4, 9)  # 9 | 7 | 6 + 3 | 4
    assert batch["labels"].tolist() == [0, 1, 2, 0, 1]  # per example, in the examples' order
    answers = DataCollatorWithPacking()(examples(head="question-answering"))
    assert answers["start_positions"].tolist() == [0, 1, 2, 0, 4] and answers["end_positions"].tolist() == [
        8,
        3,
        5,
        2,
        6,
    ]
    token_labels = DataCollatorWithPacking()(examples(head="masked-lm"))
    assert (
        token_labels["labels"].shape == (4, 9) and (token_labels["labels"][token_labels["seq_idx"] < 0] == -100).all()
    )
    for index, feature in enumerate(features):
        tokens = batch["seq_idx"] == index
        assert batch["input_ids"][tokens].tolist() == feature["input_ids"]
        assert batch["token_type_ids"][tokens].tolist() == feature["token_type_ids"]
        assert batch["position_ids"][tokens].tolist() == list(range(len(feature["input_ids"])))
    assert (batch["input_ids"][batch["seq_idx"] < 0] == 0).all()
    assert first_fit_decreasing([5, 5, 2, 8, 3], 8) == [[3], [0, 4], [1, 2]]
    with pytest.raises(ValueError, match="example 1 is padded"):
        DataCollatorWithPacking()(
            [{"input_ids": [1, 2], "attention_mask": [1, 1]}, {"input_ids": [1, 0], "attention_mask": [1, 0]}]
        )

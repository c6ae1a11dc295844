"""Norm-free variants (`none`): the placement, the conversion out of pre-LN, the export as the family's own class with
norms that divide by a constant, and norm gains folded into the layers reading them (`--fold-norm-weights`)."""

import json
import math
import re
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_normswap import convert_checkpoint, heal_checkpoint
from hf_normswap.cli import main as cli
from hf_normswap.convert import load_unswapped
from hf_normswap.convert.calibration import _finite_on
from hf_normswap.convert.constant_norms import CONSTANT_NORM_EPS, query_key_scale, with_constant_norms
from hf_normswap.convert.converter import ConversionRecord
from hf_normswap.convert.export import export_native
from hf_normswap.convert.options import ConversionError
from hf_normswap.heal import models as heal_models
from hf_normswap.heal import trainer
from hf_normswap.heal.norm_removal import NormRemoval
from hf_normswap.heal.options import HealError
from hf_normswap.hub.card import build_card
from hf_normswap.model.heads import HEAD_CLASSES
from hf_normswap.model.modeling_normswap import NormSwapForCausalLM

from helpers import interrupted, save_source, tiny_config


QUIET = dict(log=lambda line: None)
HEADS = {"llama": "ForCausalLM", "gpt2": "LMHeadModel"}


@pytest.fixture(scope="module")
def norm_free(tmp_path_factory):
    """Tiny pre-LN LLaMA (untied head) and GPT-2 (tied, LayerNorm with biases) sources, their norm-free conversions,
    and those without the first position's divisors."""
    folder = tmp_path_factory.mktemp("norm-free")
    for family, head in HEADS.items():
        save_source(folder / family, family, head, initializer_range=0.2)
        convert_checkpoint(str(folder / family), str(folder / f"{family}-none"), norm_placement="none", **QUIET)
        model = HEAD_CLASSES["causal-lm"].from_pretrained(folder / f"{family}-none")
        model.config.first_position_scales = None  # as a staged healing leaves it: the native export's input
        shutil.copytree(folder / f"{family}-none", folder / f"{family}-exportable")  # the tokenizer with it
        model.save_pretrained(folder / f"{family}-exportable")
    return folder


def _logits(model, input_ids):
    with torch.no_grad():
        return model(input_ids).logits


def test_none_placement_has_no_norm_and_a_fixed_final_scale():
    config = tiny_config(norm_placement="none", is_causal=True)
    assert (config.embedding_norm, config.final_norm, config.final_scale) == (False, False, True)
    model = NormSwapForCausalLM(config).eval()
    names = [name for name, _ in model.named_parameters() if "norm" in name]
    assert names == ["model.norm.weight", "model.norm.bias"]  # the fixed scale (LayerNorm models: and its shift)
    x = torch.randn(2, 3, 32)
    with torch.no_grad():
        model.model.norm.weight.uniform_(0.5, 2.0)
        expected = (x - x.mean(-1, keepdim=True)) * model.model.norm.weight + model.model.norm.bias
        assert torch.allclose(model.model.norm(x), expected, atol=1e-6)
    with pytest.raises(ValueError, match=r"NormSwapConfig.final_scale=True is invalid: it replaces the final norm"):
        tiny_config(norm_placement="pre", final_norm=True, final_scale=True)


@pytest.mark.parametrize("family", HEADS)
def test_norm_free_conversion_records_what_it_removed(norm_free, family):
    """The final norm becomes a fixed scale before LLaMA's untied head and GPT-2's tied one alike."""
    folder = norm_free / f"{family}-none"
    config = json.loads((folder / "config.json").read_text())
    assert (config["norm_placement"], config["final_norm"], config["final_scale"]) == ("none", False, True)
    removed = config["removed_norm_rms"]
    assert len(removed) == 5 and all(value > 0 for value in removed)
    record = ConversionRecord.read(folder)
    assert record.calibration.removed_norm_rms == removed
    input_norms = ("ln_1", "ln_2") if family == "gpt2" else ("input_layernorm", "post_attention_layernorm")
    pattern = r"(?:model\.layers|transformer\.h)\.(\d)\.(\w+)\.(?:weight|bias)"
    folded = {re.fullmatch(pattern, name).groups() for name in record.weights.folded}
    assert folded == {(str(layer), norm) for layer in range(2) for norm in input_norms}
    assert record.weights.dropped == []  # folded into the layers reading the stream, not dropped
    assert record.calibration.data == "16 texts of 64 tokens sampled from the source"  # the tiny sources' 64 positions
    source = load_unswapped(str(norm_free / family), head="causal-lm")
    model = HEAD_CLASSES["causal-lm"].from_pretrained(folder)
    gain = source.model.norm.weight / removed[-1]
    torch.testing.assert_close(model.model.norm.weight, gain, rtol=1e-6, atol=0)
    assert not any(".input_norm." in name for name in model.state_dict())


@pytest.mark.parametrize("family", HEADS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_free_export_is_the_familys_own_class(norm_free, tmp_path, family, dtype):
    folder = norm_free / f"{family}-exportable"
    if dtype != torch.float32:
        HEAD_CLASSES["causal-lm"].from_pretrained(folder, dtype=dtype).save_pretrained(tmp_path / "variant")
        folder = tmp_path / "variant"
    export_native(str(folder), str(tmp_path / "native"), **QUIET)
    config = json.loads((tmp_path / "native" / "config.json").read_text())
    assert config["model_type"] == family and "auto_map" not in config
    native = AutoModelForCausalLM.from_pretrained(tmp_path / "native", dtype=torch.float32)  # no remote code
    assert type(native).__name__ == f"{family.capitalize() if family == 'llama' else 'GPT2'}{HEADS[family]}"
    eps = config["rms_norm_eps" if family == "llama" else "layer_norm_epsilon"]
    assert eps == CONSTANT_NORM_EPS
    variant = HEAD_CLASSES["causal-lm"].from_pretrained(folder, dtype=torch.float32).eval()
    input_ids = torch.randint(0, variant.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    expected = _logits(variant, input_ids)
    # LayerNorm centres what the readers read, which the variant's readers do by their weights' zero means over the
    # inputs: exact in float32, to bfloat16's rounding (2^-8) once those weights are rounded
    tolerance = 2**-8 if family == "gpt2" and dtype == torch.bfloat16 else 1e-5
    assert (_logits(native.eval(), input_ids) - expected).abs().max() <= tolerance * expected.abs().max()


@pytest.mark.parametrize(
    "model_type, fields",
    [
        ("mistral", {"sliding_window": 4}),
        ("qwen2", {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1}),
        ("qwen3", {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1}),
    ],
)
def test_norm_free_mistral_and_qwen_export_as_their_own_classes_which_transformer_lens_reads(
    tmp_path, model_type, fields
):
    """Qwen3's query/key norms stay norms: its queries and keys are scaled so that the export's epsilon of 2^40 acts
    as one within a factor of 2 of their own."""
    save_source(tmp_path / "source", model_type, "ForCausalLM", initializer_range=0.2, **fields)
    convert_checkpoint(str(tmp_path / "source"), str(tmp_path / "none"), norm_placement="none", **QUIET)
    variant = HEAD_CLASSES["causal-lm"].from_pretrained(tmp_path / "none").eval()
    variant.config.first_position_scales = None
    variant.save_pretrained(tmp_path / "none")
    classes = {"mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
    exported = export_native(str(tmp_path / "none"), str(tmp_path / "native"), **QUIET)
    assert exported["architecture"] == classes[model_type]
    native = AutoModelForCausalLM.from_pretrained(tmp_path / "native").eval()
    assert native.config.sliding_window == 4 and native.config.rms_norm_eps == CONSTANT_NORM_EPS
    if model_type == "qwen3":
        attention = native.model.layers[0].self_attn
        assert variant.config.qk_norm and attention.q_norm.variance_epsilon == CONSTANT_NORM_EPS
        scale = query_key_scale(variant.config.norm_eps)
        assert 0.5 <= CONSTANT_NORM_EPS / scale**2 / variant.config.norm_eps <= 2
        assert torch.equal(attention.k_proj.weight, variant.model.layers[0].self_attn.k_proj.weight * scale)
        card, _ = build_card(tmp_path / "none", "me/qwen3-none", base_model="me/qwen3", license="mit")
        assert "Its query/key norms (each attention's `q_norm` and `k_norm`) stay norms." in str(card)
    input_ids = torch.randint(0, variant.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    expected = _logits(variant, input_ids)
    assert (_logits(native, input_ids) - expected).abs().max() <= 1e-5 * expected.abs().max()

    from transformer_lens.model_bridge import TransformerBridge

    bridge = TransformerBridge.boot_transformers(str(tmp_path / "native"), device="cpu")
    logits, cache = bridge.run_with_cache(input_ids)
    assert (logits - expected).abs().max() <= 1e-5 * expected.abs().max()
    with torch.no_grad():
        stream = variant(input_ids, output_hidden_states=True).hidden_states[1]
    assert (cache["blocks.1.hook_resid_pre"] - stream).abs().max() <= 1e-5 * stream.abs().max()
    if model_type == "qwen3":  # the queries' and keys' scale is a power of two: bfloat16 exports as closely
        half = variant.to(torch.bfloat16)
        expected = _logits(half, input_ids)
        assert (_logits(with_constant_norms(half), input_ids) - expected).abs().max() <= 1e-5 * expected.abs().max()


def test_norm_free_export_refuses_first_positions_and_float16(norm_free, tmp_path):
    with pytest.raises(ConversionError, match=r"^first_position_scales: the native classes have no scale for a seq"):
        export_native(str(norm_free / "llama-none"), str(tmp_path / "out"), **QUIET)
    HEAD_CLASSES["causal-lm"].from_pretrained(norm_free / "llama-exportable", dtype=torch.float16).save_pretrained(
        tmp_path / "half"
    )
    with pytest.raises(ConversionError, match=r"^dtype float16: a norm-free export's norm gains are 1048576"):
        export_native(str(tmp_path / "half"), str(tmp_path / "out"), **QUIET)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("fields", "refused"),
    [
        ({"norm_type": "dyt"}, r"^norm_type='dyt': a tanh cannot divide by a constant; export needs layernorm or rms"),
        ({"embedding_norm": True}, r"^embedding_norm=True: the native classes have one norm epsilon, and the embed"),
    ],
)
def test_norm_free_export_refuses_norms_the_native_classes_cannot_hold(tmp_path, capsys, fields, refused):
    config = tiny_config(norm_placement="none", is_causal=True, architectures=["NormSwapForCausalLM"], **fields)
    NormSwapForCausalLM(config).save_pretrained(tmp_path / "variant")
    capsys.readouterr()
    assert cli(["export-native", str(tmp_path / "variant"), str(tmp_path / "out")]) == 1
    error = capsys.readouterr().err.strip().removeprefix("hf-normswap export-native: error: ")
    assert re.match(refused, error) and len(error.splitlines()) == 1
    assert sorted(path.name for path in tmp_path.iterdir()) == ["variant"]  # nothing else on disk


def test_a_constant_norm_is_exact_until_a_token_rms_of_about_4700():
    """LLaMA's own RMSNorm at the export's epsilon 2^40 and gain 2^20, in float32: a mean square below 2^15 vanishes
    against the epsilon (the input comes back bit for bit); the relative error ms / 2^41 reaches 1e-5 at RMS 4,700."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(64, eps=CONSTANT_NORM_EPS)
    norm.weight.data.fill_(2.0**20)
    direction = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    direction = direction / direction.pow(2).mean(-1, keepdim=True).sqrt()
    with torch.no_grad():
        assert torch.equal(norm(direction * 100), direction * 100)
        for rms, error in [(1000, 4.5e-7), (4700, 1.0e-5)]:
            x = direction * rms
            assert ((x - norm(x)).abs().max() / x.abs().max()).item() == pytest.approx(error, rel=0.15, abs=1e-7)


def test_norm_free_export_refuses_a_model_with_norms_in_some_layers(norm_free, tmp_path):
    convert_checkpoint(str(norm_free / "llama"), str(tmp_path / "mixed"), norm_placement=["none", "pre"], **QUIET)
    with pytest.raises(ConversionError, match=r"^cannot be written as a native llama model .*norm_placement="):
        export_native(str(tmp_path / "mixed"), str(tmp_path / "out"), **QUIET)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["mixed"]


@pytest.mark.parametrize("family", ["llama", "gpt2", "mistral", "qwen2"])
def test_fold_norm_weights_computes_the_same(tmp_path, family):
    save_source(tmp_path / "source", family, HEADS.get(family, "ForCausalLM"), initializer_range=0.2)
    record = convert_checkpoint(str(tmp_path / "source"), str(tmp_path / "folded"), fold_norm_weights=True, **QUIET)
    model = HEAD_CLASSES["causal-lm"].from_pretrained(tmp_path / "folded").eval()
    for name, tensor in model.state_dict().items():
        if "norm" in name and not (name.startswith("model.norm.") and model.config.tie_word_embeddings):
            torch.testing.assert_close(tensor, torch.full_like(tensor, float(name.endswith("weight"))))
    source = load_unswapped(str(tmp_path / "source"), head="causal-lm")
    input_ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    expected = _logits(source, input_ids)
    assert (_logits(model, input_ids) - expected).abs().max() <= 1e-5 * expected.abs().max()
    assert record["exact"]
    kept = "model.norm keeps its gain" in record["notes"][-1]
    assert kept == model.config.tie_word_embeddings


@pytest.mark.parametrize(
    ("options", "refused"),
    [
        (dict(family="qwen3"), "model.layers.0.self_attn.q_norm cannot fold, its gain scales queries and keys"),
        (dict(norm_placement="post", calibrate=False), "model.embeddings.norm cannot fold, it writes the residual"),
        (dict(norm_placement="sandwich", calibrate=False), "model.layers.0.attention_norms.output_norm cannot fold"),
    ],
)
def test_fold_norm_weights_refuses_norms_that_cannot_fold(tmp_path, monkeypatch, options, refused):
    """Refused as the conversion is planned, before any weight is written."""
    from hf_normswap.convert import converter

    family = options.pop("family", "llama")
    save_source(tmp_path / "source", family, "ForCausalLM")
    monkeypatch.setattr(converter, "_write", lambda *args: pytest.fail("the weights were written"))
    with pytest.raises(ConversionError, match=rf"^fold_norm_weights: {refused}"):
        convert_checkpoint(str(tmp_path / "source"), str(tmp_path / "out"), fold_norm_weights=True, **options, **QUIET)
    assert not (tmp_path / "out").exists()


def test_fold_norm_weights_refuses_a_layernorm_bias_no_reader_takes(tmp_path, monkeypatch):
    from hf_normswap.convert import converter

    fields = dict(norm_type="layernorm", norm_bias=True, attention_bias=False, mlp_bias=False)
    config = tiny_config(is_causal=True, norm_placement="pre", architectures=["NormSwapForCausalLM"], **fields)
    NormSwapForCausalLM(config).save_pretrained(tmp_path / "source")
    monkeypatch.setattr(converter, "_write", lambda *args: pytest.fail("the weights were written"))
    refused = r"^fold_norm_weights: model.layers.0.attention_norms.input_norm cannot fold, its bias has no bias of"
    with pytest.raises(ConversionError, match=refused):
        convert_checkpoint(str(tmp_path / "source"), str(tmp_path / "out"), fold_norm_weights=True, **QUIET)
    assert not (tmp_path / "out").exists()


def test_norm_free_card_says_what_was_removed_and_how_to_load_it_natively(norm_free):
    card, _ = build_card(norm_free / "llama-none", "me/llama-none", base_model="me/llama", license="mit")
    removed = json.loads((norm_free / "llama-none" / "config.json").read_text())["removed_norm_rms"]
    assert (
        "**Norm-free.** No norm reads or writes the residual stream: the input norms of its 4 sublayers and the final "
        f"norm were removed, each dividing by the source's median stream RMS there ({min(removed):.3g} to "
        f"{max(removed):.3g})"
    ) in str(card)
    assert "`hf-normswap export-native` writes it as its family's own class" in str(card)
    assert "Not carried over" not in str(card)  # its folded norms were not dropped


def test_a_healed_norm_free_export_uploads_with_a_card_of_its_own(norm_free, tmp_path):
    """`push` takes a norm-free model `export-native` wrote: its card says it is a plain LlamaForCausalLM loaded
    without remote code, what was removed, where the constant norms stay exact and what the healing reached; the
    upload holds no NormSwap code."""
    from hf_normswap.hub.push import prepare_upload

    options = dict(max_steps=2, learning_rate=1e-3, stop_patience=1, dev_size=8, eval_size=16, log=None)
    heal_checkpoint(str(norm_free / "llama-none"), str(tmp_path / "healed"), **options)
    export_native(str(tmp_path / "healed"), str(tmp_path / "native"), **QUIET)
    assert ConversionRecord.read(tmp_path / "native").heal["steps"] == 2  # what made it, healing included
    upload = tmp_path / "upload"
    upload.mkdir()
    files = prepare_upload(tmp_path / "native", "me/llama-none", upload, base_model="me/llama", license="mit")
    assert not any(name.endswith("_normswap.py") for name in files) and "conversion.json" in files
    assert "heal.json" not in files and "tokenizer.json" in files
    card = (upload / "README.md").read_text()
    assert "written as Transformers' own `LlamaForCausalLM`: it loads without remote code" in card
    assert (
        'model = AutoModelForCausalLM.from_pretrained("me/llama-none")\n' in card and "trust_remote_code" not in card
    )
    assert "input norms of its 4 sublayers and the final norm were removed" in card
    assert "Written as a plain `LlamaForCausalLM`, each removed norm is a norm of epsilon 2^40" in card
    assert "Then healed (`hf-normswap heal`, objective kl, 2 steps, 1,024 tokens of text sampled" in card
    assert "on 16 held-out texts of sst2-sample, KL" in card and "`heal.json`" not in card
    sampled = ConversionRecord.read(tmp_path / "native").heal["sampled_next_token"]["after"]
    assert (
        f"on texts of 64 tokens sampled from the source and held out from training, KL {sampled['kl']:.3f}, "
        f"cross-entropy {sampled['cross_entropy_gap']:+.3f}"
    ) in card
    assert "export-native`: `conversion.json` records what made it" in card and "Remote code" not in card
    loaded = AutoModelForCausalLM.from_pretrained(upload)
    assert type(loaded).__name__ == "LlamaForCausalLM"


@pytest.mark.parametrize(
    ("family", "head"), [("bert", "ForMaskedLM"), ("gemma2", "ForCausalLM"), ("olmo2", "ForCausalLM")]
)
def test_norm_free_refused_from_a_source_whose_norms_write_the_stream(tmp_path, family, head):
    save_source(tmp_path / "source", family, head)
    refused = r"^norm_placement: none needs a pre-LN source, .* this one's is '(post|sandwich|output)'"
    with pytest.raises(ConversionError, match=refused):
        convert_checkpoint(str(tmp_path / "source"), str(tmp_path / "out"), norm_placement="none", **QUIET)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("source", "options", "refused"),
    [
        ("llama", {"norm_type": "layernorm"}, r"^norm_placement: none .*: needs the source's norm_type 'rmsnorm'"),
        ("bias-free", {}, r"^norm_placement: none cannot .*: needs linear biases to take the source's LayerNorm bias"),
        ("dyt", {}, r"^norm_placement: none cannot fold the source's norms into their readers: needs norms that div"),
    ],
)
def test_norm_free_refused_where_the_norms_cannot_fold(norm_free, tmp_path, source, options, refused):
    folder = norm_free / source
    sources = {  # pre-LN: LayerNorm biases and no linear layer with a bias to take them; DyT, which divides by nothing
        "bias-free": dict(norm_type="layernorm", norm_bias=True, attention_bias=False, mlp_bias=False),
        "dyt": dict(norm_type="dyt"),
    }
    if source in sources:
        fields = dict(is_causal=True, norm_placement="pre", architectures=["NormSwapForCausalLM"], **sources[source])
        config = tiny_config(**fields)
        NormSwapForCausalLM(config).save_pretrained(folder := tmp_path / source)
    with pytest.raises(ConversionError, match=refused):
        convert_checkpoint(str(folder), str(tmp_path / "out"), norm_placement="none", **options, **QUIET)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("family", HEADS)
def test_transformer_lens_reads_the_exported_norm_free_stream(norm_free, tmp_path, family):
    from transformer_lens.model_bridge import TransformerBridge

    export_native(str(norm_free / f"{family}-exportable"), str(tmp_path / "native"), **QUIET)
    bridge = TransformerBridge.boot_transformers(str(tmp_path / "native"), device="cpu")
    variant = HEAD_CLASSES["causal-lm"].from_pretrained(
        norm_free / f"{family}-exportable", attn_implementation="eager"
    )
    input_ids = torch.randint(0, variant.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    logits, cache = bridge.run_with_cache(input_ids)
    with torch.no_grad():
        expected = variant.eval()(input_ids, output_hidden_states=True)
    assert (logits - expected.logits).abs().max() <= 1e-5 * expected.logits.abs().max()
    for layer in range(variant.config.num_hidden_layers):  # the stream itself: no norm between the hooks and it
        stream = expected.hidden_states[layer]
        assert (cache[f"blocks.{layer}.hook_resid_pre"] - stream).abs().max() <= 1e-5 * stream.abs().max()
    writes = cache["hook_embed"] + (cache["hook_pos_embed"] if family == "gpt2" else 0)
    for layer in range(variant.config.num_hidden_layers):  # the stream is the sum of the sublayers' writes
        writes = writes + cache[f"blocks.{layer}.hook_attn_out"] + cache[f"blocks.{layer}.hook_mlp_out"]
        stream = cache[f"blocks.{layer}.hook_resid_post"]
        assert (writes - stream).abs().max() <= 1e-5 * stream.abs().max()
        for norm in ("ln1", "ln2"):  # the norms divide by a constant: 2^20 = sqrt(2^40), to float32
            assert torch.equal(
                cache[f"blocks.{layer}.{norm}.hook_scale"],
                torch.full_like(cache[f"blocks.{layer}.{norm}.hook_scale"], 2.0**20),
            )


def test_norm_removal_with_every_norm_kept_is_the_source(norm_free):
    for family in HEADS:
        source = load_unswapped(str(norm_free / family), head="causal-lm")
        model = HEAD_CLASSES["causal-lm"].from_pretrained(norm_free / f"{family}-none").eval()
        input_ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
        expected, alone = _logits(source, input_ids), _logits(model, input_ids)
        removal = NormRemoval(model, model.config.removed_norm_rms, "stages", max_steps=12)
        torch.testing.assert_close(_logits(model, input_ids), alone)  # before the first step: the student
        removal.set_step(0)
        assert (_logits(model, input_ids) - expected).abs().max() <= 1e-4 * expected.abs().max()
        removal.set_step(6)
        torch.testing.assert_close(_logits(model, input_ids), alone)
        removal.remove()


def test_norm_removal_mixes_the_divisors(norm_free):
    """A share k of a removed norm kept divides by k rms(x) + (1 - k) r: a stream far above the median r (a sink) comes
    out at most r / k, never (1 - k) times its own size, and every share leaves the direction alone."""
    model = HEAD_CLASSES["causal-lm"].from_pretrained(norm_free / "llama-none")
    removal = NormRemoval(model, model.config.removed_norm_rms, "gate", max_steps=12)
    removed = removal.removed_rms[0]
    sink = torch.randn(1, 3, model.config.hidden_size, generator=torch.Generator().manual_seed(0)) * 1000 * removed
    for kept in (0.94, 0.5, 0.1):
        removal.kept.fill_(kept)
        out = removal._mixed(sink, 0)
        rms, out_rms = sink.pow(2).mean(-1).sqrt(), out.pow(2).mean(-1).sqrt()
        torch.testing.assert_close(out_rms, removed * rms / (kept * rms + (1 - kept) * removed), rtol=1e-5, atol=0)
        assert (out_rms <= removed / kept * (1 + 1e-5)).all()
        torch.testing.assert_close(torch.cosine_similarity(out, sink, dim=-1), torch.ones(1, 3))
    removal.remove()


@pytest.mark.parametrize(
    ("schedule", "step", "kept"),
    [
        ("stages", 1, [1, 0.5] * 2 + [1]),  # the MLPs' norms first
        ("stages", 3, [0.5, 0] * 2 + [1]),  # then attention's
        ("stages", 5, [0, 0] * 2 + [0.5]),  # then the final norm
        ("layers", 1, [0.5] * 2 + [1, 1, 1]),  # layer 0 first, the final norm last
        ("gate", 3, [0.5] * 5),
    ],
)
def test_norm_removal_schedules(norm_free, schedule, step, kept):
    model = HEAD_CLASSES["causal-lm"].from_pretrained(norm_free / "llama-none")
    removal = NormRemoval(model, model.config.removed_norm_rms, schedule, max_steps=12)
    removal.set_step(step)
    torch.testing.assert_close(removal.kept, torch.tensor(kept))


def test_heal_removes_the_norms_in_stages(norm_free, tmp_path):
    options = dict(swap_schedule="stages", max_steps=16, learning_rate=3e-4, stop_patience=0, log=None)
    report = heal_checkpoint(str(norm_free / "gpt2-none"), str(tmp_path / "healed"), **options)
    assert report["swap_schedule"] == "stages" and report["steps"] == 16
    before, after = report["next_token"]["before"]["kl"], report["next_token"]["after"]["kl"]
    assert after < before
    healed = HEAD_CLASSES["causal-lm"].from_pretrained(tmp_path / "healed")
    assert set(healed.config.layer_norm_placements) == {"none"} and healed.config.final_scale
    assert healed.config.first_position_scales is None  # removed last


@pytest.mark.parametrize("variant", ["gpt2-exportable", "llama-none"])
def test_the_development_stop_waits_for_the_stages_to_end(norm_free, tmp_path, variant, monkeypatch):
    """The KL rises while the norms go: the stop measures only from where every norm (and the first position's
    divisors, over the second half) is gone. At a rate that moves nothing it then stops at its second measurement.
    Where the last group goes at the stop's first step, stage and stop share one measurement of the settled student."""
    measurements = []
    measure = trainer.agreement
    monkeypatch.setattr(trainer, "agreement", lambda *args: measurements.append(args) or measure(*args))
    options = dict(swap_schedule="stages", max_steps=20, learning_rate=1e-12, stop_patience=1, dev_size=32, log=None)
    report = heal_checkpoint(str(norm_free / variant), str(tmp_path / "healed"), **options)
    first_scales = HEAD_CLASSES["causal-lm"].from_pretrained(norm_free / variant).config.first_position_scales
    measured = [step for step in range(10 if first_scales is None else 20, 20, 2)][:2]
    budget = report["budget"]
    assert [entry["step"] for entry in budget["development_kl"] or []] == measured
    assert budget["stopped_at"] == (measured[-1] if measured else None)
    assert report["steps"] == (measured[-1] if measured else 20)
    curve = [entry["step"] for entry in report["history"]]  # the stop starts late: the curve is kept, each step once
    assert curve == [*range(0, report["steps"], 4), report["steps"]]
    stages = report["norm_removal"]  # on the development texts, as each group of norms goes (of 10 opening steps)
    removed = [["MLP norms"], ["attention norms"], ["final norm"]] + [["first position's divisors"]] * bool(
        first_scales
    )
    assert [stage["removed"] for stage in stages] == removed
    assert [stage["step"] for stage in stages] == [4, 7, 10, 20][: len(removed)]
    assert all(stage["kl"] >= 0 and math.isfinite(stage["cross_entropy_gap"]) for stage in stages)
    assert set(stages[0]["kl_by_position"]) == {"0", "1", "2-3", "4-15", "16-63"}  # 64 tokens a text
    stage_kl = {stage["step"]: stage["kl"] for stage in stages}
    shared = [entry for entry in budget["development_kl"] or [] if entry["step"] in stage_kl]
    assert [entry["step"] for entry in shared] == ([10] if first_scales is None else [])
    assert all(entry["kl"] == stage_kl[entry["step"]] for entry in shared)
    assert len(measurements) == 2 + len(stages) + len(measured) - len(shared)  # as it starts and ends, once a step


def test_a_staged_healing_resumes_with_the_stages_measured_before(norm_free, tmp_path, monkeypatch):
    """Interrupted in step 10 after the checkpoint of step 8, a staged healing resumes with the figures of the stages
    gone by then (steps 4 and 7) read back from beside the checkpoint, and reports every stage as the whole one
    does."""
    from hf_normswap.heal import healing

    options = dict(swap_schedule="stages", max_steps=20, learning_rate=3e-4, stop_patience=0, dev_size=16, log=None)
    whole = heal_checkpoint(str(norm_free / "llama-none"), str(tmp_path / "whole"), **options)
    resumable = dict(options, checkpoint_dir=str(tmp_path / "checkpoints"))
    with interrupted(monkeypatch, healing, "HealTrainer", step=9):  # after the checkpoint of step 8
        heal_checkpoint(str(norm_free / "llama-none"), str(tmp_path / "resumed"), **resumable)
    resumed = heal_checkpoint(str(norm_free / "llama-none"), str(tmp_path / "resumed"), **resumable)
    assert resumed["resumed"] and [stage["step"] for stage in resumed["norm_removal"]] == [4, 7, 10, 20]
    for ours, theirs in zip(resumed["norm_removal"], whole["norm_removal"], strict=True):
        assert ours["removed"] == theirs["removed"]
        assert ours["kl"] == pytest.approx(theirs["kl"], abs=1e-5)
        assert ours["cross_entropy_gap"] == pytest.approx(theirs["cross_entropy_gap"], abs=1e-5)


def test_a_direct_healing_leaves_a_model_the_native_class_holds(norm_free, tmp_path):
    assert HEAD_CLASSES["causal-lm"].from_pretrained(norm_free / "llama-none").config.first_position_scales
    heal_checkpoint(str(norm_free / "llama-none"), str(tmp_path / "healed"), max_steps=2, log=None)
    assert HEAD_CLASSES["causal-lm"].from_pretrained(tmp_path / "healed").config.first_position_scales is None
    assert export_native(str(tmp_path / "healed"), str(tmp_path / "native"), **QUIET)["family"] == "llama"


def test_stage_schedules_refused_where_they_do_not_apply(norm_free, tmp_path, monkeypatch):
    monkeypatch.setattr(heal_models, "_load_student", lambda *args, **kwargs: pytest.fail("refused after loading"))
    with pytest.raises(HealError, match=r"^swap_schedule='taper' is invalid for a norm-free student: allowed are"):
        heal_checkpoint(str(norm_free / "gpt2-none"), str(tmp_path / "a"), swap_schedule="taper", log=None)
    assert not (tmp_path / "a").exists()
    convert_checkpoint(str(norm_free / "llama"), str(tmp_path / "post"), norm_placement="post", **QUIET)
    with pytest.raises(HealError, match=r"^swap_schedule='stages' is for norm-free students"):
        heal_checkpoint(str(tmp_path / "post"), str(tmp_path / "b"), swap_schedule="stages", max_steps=2, log=None)
    assert not (tmp_path / "b").exists()
    shutil.copytree(norm_free / "llama-none", tmp_path / "unrecorded")
    config = json.loads((tmp_path / "unrecorded" / "config.json").read_text())
    (tmp_path / "unrecorded" / "config.json").write_text(json.dumps({**config, "removed_norm_rms": None}))
    with pytest.raises(HealError, match=r"^swap_schedule='gate' needs the removed_norm_rms a conversion records"):
        heal_checkpoint(str(tmp_path / "unrecorded"), str(tmp_path / "c"), swap_schedule="gate", log=None)
    assert not (tmp_path / "c").exists()


def test_an_overflowing_norm_free_model_is_noticed():
    model = NormSwapForCausalLM(tiny_config(norm_placement="none", is_causal=True))
    batch = {"input_ids": torch.randint(0, 99, (2, 8)), "attention_mask": torch.ones(2, 8, dtype=torch.long)}
    assert _finite_on(model, batch)
    with torch.no_grad():  # a first position's stream grown past float32's range
        model.model.layers[1].mlp.down_proj.weight.mul_(1e38)
        model.model.layers[1].mlp.up_proj.weight.mul_(1e38)
    assert not _finite_on(model, batch)


@pytest.mark.parametrize("family", HEADS)
def test_first_position_keeps_its_own_divisors(norm_free, family):
    # The calibration texts start with BOS, so a text's first position holds BOS's stream, which its own divisors
    # (the source's RMS there) give back exactly: the first position's logits are the source's.
    source = load_unswapped(str(norm_free / family), head="causal-lm")
    model = HEAD_CLASSES["causal-lm"].from_pretrained(norm_free / f"{family}-none").eval()
    scales = model.config.first_position_scales
    assert len(scales) == 5 and any(abs(scale - 1) > 0.01 for scale in scales)
    input_ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    input_ids[:, 0] = model.config.bos_token_id
    expected = _logits(source, input_ids)[:, 0]
    assert (_logits(model, input_ids)[:, 0] - expected).abs().max() <= 1e-4 * expected.abs().max()
    model.config.first_position_scales = None
    assert (_logits(model, input_ids)[:, 0] - expected).abs().max() > 1e-3 * expected.abs().max()

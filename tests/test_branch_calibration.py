"""Out of pre-LN into norms on the branch (sandwich, output): calibrated conversions, and the block-wise fit and the
gradual swap that heal from them."""

import re

import pytest
import torch

from hf_normswap import convert_checkpoint, heal_checkpoint
from hf_normswap.convert import load_unswapped
from hf_normswap.convert.branch_calibration import calibrate_branches, calibrates_branches
from hf_normswap.convert.converter import ConversionRecord
from hf_normswap.heal import HealError
from hf_normswap.heal import models as heal_models
from hf_normswap.heal.gradual_swap import GradualSwap, conversion_layer_gates
from hf_normswap.heal.options import FITTED_DEFAULTS
from hf_normswap.heal.reconstruction import reconstruct_layers
from hf_normswap.model.configuration_normswap import NormSwapConfig
from hf_normswap.model.heads import HEAD_CLASSES
from hf_normswap.probes.next_token import next_token_agreement
from hf_normswap.probes.probe_data import probe_batches, probe_tokenizer
from hf_normswap.probes.stream_mix import LayerGates, kl_by_layer
from hf_normswap.probes.swap_effect import swap_batch

from helpers import save_source


QUIET = dict(log=lambda line: None)
BRANCH_PLACEMENTS = ("sandwich", "output")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tiny pre-LN LLaMA with a tokenizer, its sandwich and output conversions, calibrated and not."""
    folder = tmp_path_factory.mktemp("branch")
    save_source(folder / "llama", "llama", "ForCausalLM", initializer_range=0.2)
    for placement in BRANCH_PLACEMENTS:
        for calibrate in (True, False):
            convert_checkpoint(
                str(folder / "llama"),
                str(folder / f"{placement}-{'calibrated' if calibrate else 'shifted'}"),
                norm_placement=placement,
                attention="causal",
                calibrate=calibrate,
                **QUIET,
            )
    return folder


def _logits(model, input_ids):
    with torch.no_grad():
        return model(input_ids).logits


@pytest.mark.parametrize("placement", [*BRANCH_PLACEMENTS, "none"])
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_branch_calibration_exact_when_every_token_writes_alike(tmp_path, family, placement):
    # One token per sequence, all the same: every write has one size and every stream point one RMS, so the fitted
    # gains and the folded readers (GPT-2: LayerNorm's centring and biases too), and norm-free's fixed final scale,
    # give the source's function exactly.
    head = "ForCausalLM" if family == "llama" else "LMHeadModel"
    save_source(tmp_path / "source", family, head, initializer_range=0.2)
    convert_checkpoint(
        str(tmp_path / "source"),
        str(tmp_path / "shifted"),
        norm_placement=placement,
        attention="causal",
        calibrate=False,
        **QUIET,
    )
    source = load_unswapped(str(tmp_path / "source"), head="causal-lm")
    model = HEAD_CLASSES["causal-lm"].from_pretrained(tmp_path / "shifted").eval()
    batch = {"input_ids": torch.full((3, 1), 11), "attention_mask": torch.ones(3, 1, dtype=torch.long)}
    expected = _logits(source, batch["input_ids"])
    assert (_logits(model, batch["input_ids"]) - expected).abs().max() > 0.01 * expected.abs().max()
    record = calibrate_branches(model, source, [batch])
    branches = [f"layers.{i}.{s}" for i in range(2) for s in ("attention_norms", "mlp_norms")]
    branches = [] if placement == "none" else branches
    assert sorted(record.branch_gains) == branches
    assert len(record.stream_rms or []) == (0 if placement == "sandwich" else 2 * 2 + 1)
    assert (_logits(model, batch["input_ids"]) - expected).abs().max() <= 1e-4 * expected.abs().max()


@pytest.mark.parametrize("placement", BRANCH_PLACEMENTS)
def test_calibrated_branch_conversion_recorded_and_closer_than_shifted_norms(llama, placement):
    calibrated = ConversionRecord.read(llama / f"{placement}-calibrated")
    shifted = ConversionRecord.read(llama / f"{placement}-shifted")
    record = calibrated.calibration
    assert shifted.calibration is None
    assert record.out_of_pre_ln and record.stream_rms is None and record.refit_errors == {}
    assert len(record.write_scales) == 4 and all(gain > 0 for gain in record.write_scales.values())
    branch_norms = [f"layers.{i}.{s}.output_norm" for i in range(2) for s in ("attention_norms", "mlp_norms")]
    readers = [f"layers.{i}.{m}" for i in range(2) for m in ("self_attn.q_proj", "mlp.gate_proj")]
    assert set(branch_norms) <= set(record.modules)
    assert set(readers) <= set(record.modules) if placement == "output" else not set(readers) & set(record.modules)
    source = load_unswapped(str(llama / "llama"), head="causal-lm")
    held_out = probe_batches(
        tokenizer=probe_tokenizer(llama / f"{placement}-calibrated"),
        vocab_size=source.config.vocab_size,
        size=256,
        split="validation",
    )
    kl = {
        name: next_token_agreement(source, HEAD_CLASSES["causal-lm"].from_pretrained(llama / name), held_out)["kl"]
        for name in (f"{placement}-calibrated", f"{placement}-shifted")
    }
    # measured on 256 SST-2 validation sentences: KL 0.132 -> 0.033 (sandwich), 0.286 -> 0.049 (output)
    assert kl[f"{placement}-calibrated"] < 0.4 * kl[f"{placement}-shifted"], kl


def test_only_pre_ln_sources_into_branch_norms_of_one_norm_type_are_calibrated():
    pre = NormSwapConfig(norm_placement="pre", norm_type="rmsnorm")
    assert calibrates_branches(pre, NormSwapConfig(norm_placement="sandwich", norm_type="rmsnorm"))
    assert calibrates_branches(
        pre, NormSwapConfig(num_hidden_layers=2, norm_placement=["pre", "output"], norm_type="rmsnorm")
    )
    assert not calibrates_branches(pre, NormSwapConfig(norm_placement="post", norm_type="rmsnorm"))  # the stream's
    assert not calibrates_branches(pre, NormSwapConfig(norm_placement="pre", norm_type="rmsnorm"))  # an exact swap
    assert not calibrates_branches(pre, NormSwapConfig(norm_placement="sandwich", norm_type="layernorm"))
    post = NormSwapConfig(norm_placement="post", norm_type="rmsnorm")
    assert not calibrates_branches(post, NormSwapConfig(norm_placement="sandwich", norm_type="rmsnorm"))


@pytest.mark.parametrize("placement", BRANCH_PLACEMENTS)
def test_the_fit_targets_the_unnormalised_stream_where_the_conversion_is_exact(llama, placement):
    # As exact as calibration makes it (one token, all the same): each layer already gives the teacher's stream, so
    # the fit, aimed at that stream as it is (not normalised), has nothing to move.
    source = load_unswapped(str(llama / "llama"), head="causal-lm")
    model = HEAD_CLASSES["causal-lm"].from_pretrained(llama / f"{placement}-shifted").eval()
    batch = {"input_ids": torch.full((4, 1), 7), "attention_mask": torch.ones(4, 1, dtype=torch.long)}
    calibrate_branches(model, source, [batch])
    errors = reconstruct_layers(model, source, [batch], steps=0, learning_rate=1e-3)
    assert len(errors) == 2 and all(before == after <= 1e-8 for before, after in errors)


def test_a_sandwich_conversion_is_fitted_and_healed_with_the_causal_defaults(llama, tmp_path):
    report = heal_checkpoint(
        str(llama / "sandwich-calibrated"),
        str(tmp_path / "healed"),
        max_steps=4,
        batch_size=8,
        eval_size=16,
        reconstruct_sequences=16,
        stop_patience=0,
        log=None,
    )
    reconstruction = report["reconstruction"]
    assert reconstruction["steps"] == FITTED_DEFAULTS["reconstruct_steps"]
    assert all(after < before for before, after in reconstruction["layer_errors"]), reconstruction["layer_errors"]
    teacher = load_unswapped(str(llama / "llama"), head="causal-lm")
    held_out = {
        "input_ids": torch.randint(3, teacher.config.vocab_size, (8, 12), generator=torch.Generator().manual_seed(0))
    }
    held_out["attention_mask"] = torch.ones_like(held_out["input_ids"])
    calibrated = HEAD_CLASSES["causal-lm"].from_pretrained(llama / "sandwich-calibrated")
    healed = HEAD_CLASSES["causal-lm"].from_pretrained(tmp_path / "healed")
    before = next_token_agreement(teacher, calibrated, [held_out])["kl"]
    assert next_token_agreement(teacher, healed, [held_out])["kl"] < before


def test_a_gradual_swap_into_sandwich_starts_at_the_source_and_ends_at_the_target(llama):
    """Its gates mix each branch norm with the write it normalises: shut, the conversion computes its source (the
    stream and input norms are the source's); layer by layer they open to the calibrated sandwich."""
    source = load_unswapped(str(llama / "llama"), head="causal-lm")
    model = HEAD_CLASSES["causal-lm"].from_pretrained(llama / "sandwich-calibrated").eval()
    input_ids = torch.randint(4, 60, (3, 12), generator=torch.Generator().manual_seed(0))
    target, expected = _logits(model, input_ids), _logits(source, input_ids)
    assert (target - expected).abs().max() > 1e-2 * expected.abs().max()  # the swap changes the function
    gates = conversion_layer_gates(ConversionRecord.read(llama / "sandwich-calibrated"), model.config)
    swap = GradualSwap(model, gates, "layers", max_steps=8)
    swap.set_step(0)
    assert gates == LayerGates() and swap.mix.gates.tolist() == [0.0] * 4
    assert (_logits(model, input_ids) - expected).abs().max() <= 1e-5 * expected.abs().max()
    swap.set_step(1)  # half of layer 0 open, layer 1 shut
    assert swap.mix.gates.tolist() == [0.5, 0.5, 0.0, 0.0]
    swap.set_step(4)
    assert torch.equal(_logits(model, input_ids), target)
    swap.remove()


def test_kl_by_layer_of_a_sandwich_conversion_swaps_each_layer_alone(llama):
    """conversion.json's swap effect gives, for sandwich too, the KL with each layer's branch norms alone in place:
    what the branch mix computes with that layer's two gates open; an output conversion, whose readers are folded,
    gives none."""
    effect = ConversionRecord.read(llama / "sandwich-calibrated").verification.swap_effect
    source = load_unswapped(str(llama / "llama"), head="causal-lm")
    model = HEAD_CLASSES["causal-lm"].from_pretrained(llama / "sandwich-calibrated").eval()
    batch = swap_batch(llama / "sandwich-calibrated", model.config.vocab_size)
    per_layer = kl_by_layer(source, model, LayerGates(), [batch])
    assert effect["kl_by_layer"] == pytest.approx(per_layer, rel=1e-4, abs=1e-7)
    assert len(per_layer) == 2 and min(per_layer) > 1e-4
    swap = GradualSwap(model, LayerGates(), "gate", max_steps=2)
    swap.mix.gates[2:] = 0  # layer 0 alone swapped
    assert next_token_agreement(source, model, [batch])["kl"] == pytest.approx(per_layer[0], rel=1e-4)
    swap.remove()
    assert "kl_by_layer" not in ConversionRecord.read(llama / "output-calibrated").verification.swap_effect


def test_a_sandwich_conversion_heals_gradually(llama, tmp_path):
    options = dict(max_steps=8, learning_rate=1e-3, batch_size=8, eval_size=16, stop_patience=0, log=None)
    report = heal_checkpoint(
        str(llama / "sandwich-calibrated"), str(tmp_path / "layers"), **options, swap_schedule="layers"
    )
    assert report["swap_schedule"] == "layers" and report["reconstruction"] is None  # no fit before a gradual swap
    assert report["next_token"]["after"]["kl"] < report["next_token"]["before"]["kl"]
    assert len(report["next_token"]["before"]["kl_by_layer"]) == 2  # the conversion, each layer alone


@pytest.mark.parametrize(
    ("variant", "schedule", "error"),
    [
        ("sandwich-calibrated", "taper", "swap_schedule='taper' is for a stream its norms write"),
        ("output-calibrated", "gate", "swap_schedule='gate' needs a calibrated conversion out of pre-LN into post, "),
        ("sandwich-shifted", "layers", "swap_schedule='layers' needs a calibrated conversion out of pre-LN into "),
    ],
)
def test_gradual_swaps_that_cannot_start_at_the_source_are_refused(
    llama, tmp_path, monkeypatch, variant, schedule, error
):
    monkeypatch.setattr(heal_models, "_load_student", lambda *args, **kwargs: pytest.fail("refused after loading"))
    with pytest.raises(HealError, match=f"^{re.escape(error)}"):
        heal_checkpoint(str(llama / variant), str(tmp_path / "healed"), swap_schedule=schedule, max_steps=2, log=None)
    assert not (tmp_path / "healed").exists()

"""Out of pre-LN: calibrated conversions into post, pre_post and DeepNorm, and healing a causal LM by its next-token
distribution (KL objective, text sampled from the teacher, gradual swaps)."""

import itertools
import json
import math
import re
import shutil
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoTokenizer, GenerationMixin, LogitsProcessorList, TrainingArguments

from hf_normswap import convert_checkpoint, heal_checkpoint
from hf_normswap.cli import main as cli
from hf_normswap.convert import load_unswapped
from hf_normswap.convert.converter import ConversionRecord
from hf_normswap.convert.stream_calibration import calibrate_stream
from hf_normswap.heal import HealError, HealOptions, losses
from hf_normswap.heal import data as data_module
from hf_normswap.heal import models as heal_models
from hf_normswap.heal import trainer as trainer_module
from hf_normswap.heal.data import (
    TEACHER_STATES,
    TeacherSamples,
    heal_texts,
    read_texts,
    sampled_ahead,
    sampled_together,
    teacher_samples,
)
from hf_normswap.heal.gradual_swap import GradualSwap, conversion_layer_gates
from hf_normswap.heal.plan import heal_plan
from hf_normswap.heal.reconstruction import reconstruct_layers, reconstruction_batches
from hf_normswap.heal.trainer import HealTrainer
from hf_normswap.hub.card import build_card
from hf_normswap.hub.push import prepare_upload
from hf_normswap.model.heads import HEAD_CLASSES
from hf_normswap.probes.collapse import boundary_states
from hf_normswap.probes.next_token import (
    POSITION_BINS,
    agreement,
    final_state_log_probs,
    greedy_agreement,
    greedy_continuation,
    greedy_prompts,
    next_token_agreement,
    token_log_probs,
)
from hf_normswap.probes.probe_data import sampled_batches
from hf_normswap.probes.sampling import InverseCdfSampling, start_token, uniform_draws
from hf_normswap.probes.stream_mix import kl_by_layer
from hf_normswap.probes.swap_effect import swap_batch

from helpers import interrupted, save_source


QUIET = dict(log=lambda line: None)
HEAL = dict(max_steps=16, learning_rate=1e-3, batch_size=8, eval_size=16, stop_patience=0, log=None)
PLACEMENTS = ("post", "pre_post", "deepnorm", "admin")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tiny pre-LN LLaMA with a tokenizer, its calibrated and uncalibrated post-LN conversions."""
    folder = tmp_path_factory.mktemp("causal")
    save_source(folder / "llama", "llama", "ForCausalLM", initializer_range=0.2)
    for placement in PLACEMENTS:
        convert_checkpoint(
            str(folder / "llama"), str(folder / placement), norm_placement=placement, attention="causal", **QUIET
        )
    convert_checkpoint(
        str(folder / "llama"),
        str(folder / "post-shifted"),
        norm_placement="post",
        attention="causal",
        calibrate=False,
        **QUIET,
    )
    return folder


def _logits(model, input_ids):
    with torch.no_grad():
        return model(input_ids).logits


def _uncalibrated_on_one_token(llama, placement, tmp_path):
    """The source, its conversion to `placement` without calibration, and a batch whose every token's stream RMS is
    the median (one token per sequence, all the same)."""
    source = load_unswapped(str(llama / "llama"), head="causal-lm")
    convert_checkpoint(
        str(llama / "llama"), str(tmp_path / "shifted"), norm_placement=placement, attention="causal", calibrate=False
    )
    model = HEAD_CLASSES["causal-lm"].from_pretrained(tmp_path / "shifted").eval()
    batch = {"input_ids": torch.full((4, 1), 7), "attention_mask": torch.ones(4, 1, dtype=torch.long)}
    return source, model, batch


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_stream_calibration_exact_when_every_token_has_the_calibrated_rms(llama, placement, tmp_path):
    # One token per sequence, all the same: every token's stream RMS is the median the scales are fitted to.
    source, model, batch = _uncalibrated_on_one_token(llama, placement, tmp_path)
    record = calibrate_stream(model, source, [batch])
    assert len(record.stream_rms) == 2 * 2 + 1 and len(record.write_scales) == 4
    expected = _logits(source, batch["input_ids"])
    assert (_logits(model, batch["input_ids"]) - expected).abs().max() <= 1e-4 * expected.abs().max()


@pytest.mark.parametrize("placement", ["post", "pre_post"])
def test_stream_calibration_folds_layernorm_biases_exactly(tmp_path, placement):
    # GPT-2: LayerNorm with biases, folded into q/k/v and the feed-forward's first layer (post), or kept (pre_post).
    save_source(tmp_path / "gpt2", "gpt2", "LMHeadModel", initializer_range=0.2)  # norms eps far below the variance
    convert_checkpoint(
        str(tmp_path / "gpt2"),
        str(tmp_path / "shifted"),
        norm_placement=placement,
        attention="causal",
        calibrate=False,
    )
    source = load_unswapped(str(tmp_path / "gpt2"), head="causal-lm")
    model = HEAD_CLASSES["causal-lm"].from_pretrained(tmp_path / "shifted").eval()
    batch = {"input_ids": torch.full((3, 1), 11), "attention_mask": torch.ones(3, 1, dtype=torch.long)}
    calibrate_stream(model, source, [batch])
    expected = _logits(source, batch["input_ids"])
    assert (_logits(model, batch["input_ids"]) - expected).abs().max() <= 1e-4 * expected.abs().max()


def test_calibrated_conversion_recorded_and_closer_than_shifted_norms(llama):
    calibrated = json.loads((llama / "post" / "conversion.json").read_text())
    shifted = json.loads((llama / "post-shifted" / "conversion.json").read_text())
    assert shifted["calibration"] is None
    assert len(calibrated["calibration"]["stream_rms"]) == 5
    assert all(scale > 0 for scale in calibrated["calibration"]["write_scales"].values())
    effect, before = calibrated["swap_effect"], shifted["swap_effect"]
    assert effect["metric"] == "perplexity" and 0 <= effect["top1_agreement"] <= 1
    assert effect["kl"] < 0.5 * before["kl"] and effect["top1_agreement"] > before["top1_agreement"]


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_gradual_swap_starts_at_the_source_and_ends_at_the_target(llama, placement):
    source = load_unswapped(str(llama / "llama"), head="causal-lm")
    model = HEAD_CLASSES["causal-lm"].from_pretrained(llama / placement).eval()
    input_ids = torch.randint(4, 60, (3, 12), generator=torch.Generator().manual_seed(0))
    target = _logits(model, input_ids)
    swap = GradualSwap(
        model, conversion_layer_gates(ConversionRecord.read(llama / placement), model.config), "layers", max_steps=8
    )
    swap.set_step(0)
    expected = _logits(source, input_ids)
    assert (_logits(model, input_ids) - expected).abs().max() <= 1e-4 * expected.abs().max()
    swap.set_step(1)  # layers: half of layer 0 open, layer 1 closed
    assert swap.mix.gates.tolist() == [0.5, 0.5, 0.0, 0.0]
    swap.on_step_end(None, SimpleNamespace(global_step=4), None)  # the step that settles it: what measures after sees
    assert torch.allclose(_logits(model, input_ids), target)
    swap.remove()


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_the_taper_starts_at_the_exact_per_token_rewrite(llama, placement):
    """`taper` starts from the post-LN rewrite that divides each write by the token's own stream RMS (the source,
    whatever each token's RMS), and ends at the target; halfway, layer 0 is open and layer 1 still exact."""
    source = load_unswapped(str(llama / "llama"), head="causal-lm")
    model = HEAD_CLASSES["causal-lm"].from_pretrained(llama / placement).eval()
    input_ids = torch.randint(4, 60, (3, 12), generator=torch.Generator().manual_seed(0))
    target, expected = _logits(model, input_ids), _logits(source, input_ids)
    swap = GradualSwap(
        model, conversion_layer_gates(ConversionRecord.read(llama / placement), model.config), "taper", max_steps=8
    )
    swap.set_step(0)
    assert swap.mix.gates.tolist() == [0.0] * 4 and swap.mix.per_token.tolist() == [1.0] * 4
    assert (_logits(model, input_ids) - expected).abs().max() <= 1e-4 * expected.abs().max()
    swap.mix.per_token.zero_()  # every write divided by the median: the calibrated target's function
    assert (_logits(model, input_ids) - target).abs().max() <= 1e-4 * target.abs().max()
    swap.set_step(2)
    assert swap.mix.gates.tolist() == [1.0, 1.0, 0.0, 0.0] and swap.mix.per_token.tolist() == [0.0, 0.0, 1.0, 1.0]
    swap.set_step(4)
    assert torch.allclose(_logits(model, input_ids), target)
    swap.remove()


@pytest.mark.parametrize("placement", ["post", "deepnorm"])
def test_kl_by_layer_swaps_each_layer_alone(llama, placement):
    """conversion.json's swap effect gives, for each layer, the KL with that layer alone in the target placement:
    what the stream mix computes with that layer's two gates open and every other closed (the source's function)."""
    effect = ConversionRecord.read(llama / placement).verification.swap_effect
    source = load_unswapped(str(llama / "llama"), head="causal-lm")
    model = HEAD_CLASSES["causal-lm"].from_pretrained(llama / placement).eval()
    batch = swap_batch(llama / placement, model.config.vocab_size)
    gates = conversion_layer_gates(ConversionRecord.read(llama / placement), model.config)
    per_layer = kl_by_layer(source, model, gates, [batch])
    assert effect["kl_by_layer"] == pytest.approx(per_layer, rel=1e-4, abs=1e-7)
    assert len(per_layer) == model.config.num_hidden_layers and min(per_layer) > 1e-4
    mix = gates.mix(model)
    mix.gates.zero_()  # every layer computes the source's function
    assert next_token_agreement(source, model, [batch])["kl"] <= 1e-6
    mix.gates[:2] = 1  # layer 0 alone swapped
    assert next_token_agreement(source, model, [batch])["kl"] == pytest.approx(per_layer[0], rel=1e-4)
    mix.remove()
    assert next_token_agreement(source, model, [batch])["kl"] == pytest.approx(effect["kl"], rel=1e-4)  # unhooked


@pytest.mark.parametrize("placement", ["post", "deepnorm"])
def test_reconstruction_targets_are_the_students_stream_where_the_conversion_is_exact(llama, placement, tmp_path):
    # One token per sequence, all the same: the calibrated conversion computes the source's function exactly, so
    # each layer already gives the teacher's stream as the student's norms hold it, and a fit has nothing to move.
    source, model, batch = _uncalibrated_on_one_token(llama, placement, tmp_path)
    calibrate_stream(model, source, [batch])
    errors = reconstruct_layers(model, source, [batch], steps=0, learning_rate=1e-3)
    assert len(errors) == 2 and all(before == after <= 1e-10 for before, after in errors)


def test_reconstruction_brings_each_layer_and_the_next_token_closer(llama):
    teacher = load_unswapped(str(llama / "llama"), head="causal-lm")
    student = HEAD_CLASSES["causal-lm"].from_pretrained(llama / "post")
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, teacher.config.vocab_size, (48, 12), generator=generator)
    mask = torch.ones_like(ids)
    mask[::3, 8:] = 0  # padded texts: only real tokens count
    batches = [{"input_ids": ids[i : i + 16], "attention_mask": mask[i : i + 16]} for i in range(0, 48, 16)]
    held_out = {"input_ids": torch.randint(3, teacher.config.vocab_size, (8, 12), generator=generator)}
    held_out["attention_mask"] = torch.ones_like(held_out["input_ids"])
    before = next_token_agreement(teacher, student, [held_out])["kl"]
    # 576 tokens: above 1e-3 the fit overfits them (measured KL / before: 0.91 at 3e-5, 0.78 at 3e-4, 1.22 at 1e-2)
    errors = reconstruct_layers(student, teacher, batches, steps=60, learning_rate=3e-4)
    assert len(errors) == 2 and all(after < 0.6 * before for before, after in errors)  # measured: 0.46, 0.47
    assert next_token_agreement(teacher, student, [held_out])["kl"] < 0.85 * before  # measured: 0.78
    assert not any(parameter.grad is not None for parameter in student.parameters())


def test_the_fit_shows_the_layers_the_first_position_in_texts_of_one_token(llama):
    teacher = load_unswapped(str(llama / "llama"), head="causal-lm")
    tokenizer = AutoTokenizer.from_pretrained(llama / "post")
    ids = torch.randint(3, teacher.config.vocab_size, (32, 12), generator=torch.Generator().manual_seed(0))
    rows = [{"input_ids": row, "attention_mask": [1] * len(row)} for row in ids.tolist()]
    options = HealOptions(reconstruct_steps=40, reconstruct_sequences=32)
    batches = reconstruction_batches(rows, tokenizer, options)
    first = batches[-1]
    assert len(batches) == 3 and first["input_ids"].shape == (len(ids.unique()), 1)  # fewer than 1024 distinct
    assert first["input_ids"].unique().tolist() == ids.unique().tolist() and first["attention_mask"].all()
    assert torch.equal(reconstruction_batches(rows, tokenizer, options)[-1]["input_ids"], first["input_ids"])
    # held-out texts that begin with tokens no training text begins with: the KL at their first position
    starts = torch.tensor([token for token in ids.unique().tolist() if token not in ids[:, 0]][:16])
    held_out = {"input_ids": torch.cat([starts[:, None], ids[:16, :3]], 1)}
    held_out["attention_mask"] = torch.ones_like(held_out["input_ids"])
    converted = HEAD_CLASSES["causal-lm"].from_pretrained(llama / "post")
    first_position = {"conversion": next_token_agreement(teacher, converted, [held_out])["kl_by_position"]["0"]}
    for name, fitted_on in (("texts", batches[:-1]), ("with one-token texts", batches)):
        student = HEAD_CLASSES["causal-lm"].from_pretrained(llama / "post")
        reconstruct_layers(student, teacher, fitted_on, steps=options.reconstruct_steps, learning_rate=1e-3)
        first_position[name] = next_token_agreement(teacher, student, [held_out])["kl_by_position"]["0"]
    # measured: 0.0215 converted, 0.0489 fitted on the texts alone (overfitted), 0.0073 with one-token texts
    assert first_position["texts"] > 1.5 * first_position["conversion"]
    assert first_position["with one-token texts"] < 0.5 * first_position["conversion"]


SMOLLM2 = dict(width=576, parameters=106_203_456, tokens_per_text=64)  # its layers' parameters


def test_the_layers_are_fitted_by_default_out_of_pre_ln_with_the_direct_swap():
    fitted = HealOptions().for_head("causal-lm", out_of_pre_ln=True).scaled(**SMOLLM2)
    assert fitted.reconstruct_steps == 60 and fitted.learning_rate == pytest.approx(1e-5) and fitted.max_steps == 100
    assert fitted.reconstruct_learning_rate == 3e-5
    for options, recorded in (
        (HealOptions(), False),  # no calibrated conversion out of pre-LN
        (HealOptions(swap_schedule="taper"), True),
        (HealOptions(lora=True), True),
        (HealOptions(reconstruct_steps=0), True),
    ):
        unfitted = options.for_head("causal-lm", out_of_pre_ln=recorded).scaled(**SMOLLM2)
        assert unfitted.reconstruct_steps == 0 and unfitted.learning_rate == pytest.approx(1e-4)
    assert HealOptions().for_head("other", out_of_pre_ln=True).reconstruct_steps == 0
    given = HealOptions(reconstruct_steps=5, learning_rate=3e-4).for_head("causal-lm", True).scaled(**SMOLLM2)
    assert given.learning_rate == 3e-4


def test_a_causal_lm_s_learning_rate_and_tokens_scale_with_it():
    """The learning rate goes as 1 / width squared up to 2e-3 (after a fit, times the steps / 1,000 up to 1), the
    tokens as 1 / the layers' parameters (at most 2**21), the steps those tokens take; --max-tokens and --max-steps
    replace the budget."""
    small = HealOptions().for_head("causal-lm", out_of_pre_ln=True).scaled(64, 250_000, 64)
    assert small.learning_rate == pytest.approx(2e-3) and small.max_steps == 2**21 // (8 * 64)  # 8.1e-3, capped
    for steps, share in ((4, 0.004), (500, 0.5), (1000, 1.0)):
        fitted = HealOptions(max_steps=steps).for_head("causal-lm", out_of_pre_ln=True).scaled(192, 250_000, 64)
        assert fitted.learning_rate == pytest.approx(9.0e-4 * share, rel=1e-3)  # 33.18 / 192**2
    assert HealOptions(batch_size=32).for_head("causal-lm").scaled(64, 250_000, 64).learning_rate == pytest.approx(
        2e-3
    )
    assert HealOptions(batch_size=32).for_head("causal-lm").scaled(64, 250_000, 64).max_steps == 2**21 // (32 * 64)
    assert HealOptions(max_tokens=5120).for_head("causal-lm").scaled(**SMOLLM2).max_steps == 10
    assert HealOptions(max_tokens=5120).for_head("causal-lm").scaled(576, 10**8, 11.0).max_steps == 58
    assert HealOptions(max_steps=7).for_head("causal-lm").scaled(**SMOLLM2).max_steps == 7
    other = HealOptions().for_head("other")
    assert other.max_steps == 700 and other.learning_rate == 5e-4


@pytest.mark.parametrize("data", ["teacher", "sst2-sample"])  # the default, and the task's text as --config llama
def test_a_healing_reconstructs_the_layers_first(llama, data):
    output = llama / f"reconstructed-{data}"
    report = heal_checkpoint(
        str(llama / "post"),
        str(output),
        **HEAL,
        data=data,
        reconstruct_steps=20,
        reconstruct_sequences=32,
        reconstruct_learning_rate=1e-4,
    )
    reconstruction = report["reconstruction"]
    assert report["data"]["name"] == data and (report["data"]["sampling"] is None) == (data != "teacher")
    assert reconstruction["sequences"] == 32 and reconstruction["steps"] == 20 and reconstruction["seconds"] > 0
    assert reconstruction["learning_rate"] == 1e-4
    assert len(reconstruction["layer_errors"]) == 2
    assert all(after < before for before, after in reconstruction["layer_errors"])
    conversion, start = reconstruction["conversion"], report["next_token"]["before"]
    assert len(conversion["kl_by_layer"]) == 2 and "kl_by_layer" not in start  # measured on the conversion only
    assert start["kl"] < 0.97 * conversion["kl"]  # healing starts from the fitted layers (measured: 0.943, 0.845)
    assert json.loads((output / "heal.json").read_text())["reconstruction"] == reconstruction


@pytest.mark.parametrize("kept", [True, False])
def test_chunked_kl_equals_the_whole(llama, monkeypatch, kept):
    """A chunk at a time, the logits kept for the backward pass or recomputed there, the KL and its gradient are the
    whole's."""
    source = load_unswapped(str(llama / "llama"), head="causal-lm")
    student = HEAD_CLASSES["causal-lm"].from_pretrained(llama / "post")
    states = torch.randn(10, 32, requires_grad=True)
    teacher_states = torch.randn(10, 32)
    whole = F.kl_div(
        token_log_probs(student, states),
        token_log_probs(source, teacher_states).detach(),
        log_target=True,
        reduction="batchmean",
    )
    (expected,) = torch.autograd.grad(whole, states)
    monkeypatch.setattr(losses, "TOKENS_PER_CHUNK", 3)
    if not kept:
        monkeypatch.setattr(losses, "KEPT_FOR_BACKWARD_BYTES", 0)
    calls = []
    student.get_output_embeddings().register_forward_hook(lambda *_: calls.append(1))
    chunked = losses.next_token_kl(student, source, states, teacher_states)
    (gradient,) = torch.autograd.grad(chunked, states)
    assert len(calls) == (4 if kept else 8)  # 10 rows in chunks of 3, each run again in the backward pass if not kept
    assert chunked.item() == pytest.approx(whole.item(), rel=1e-5)
    assert torch.allclose(gradient, expected, atol=1e-7)


def test_kl_takes_the_teachers_log_probabilities_from_its_forward(llama):
    source = load_unswapped(str(llama / "llama"), head="causal-lm")
    student = HEAD_CLASSES["causal-lm"].from_pretrained(llama / "post")
    input_ids = torch.randint(4, 60, (2, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        outputs = source(input_ids, output_hidden_states=True)
    teacher_states = outputs.hidden_states[-1].flatten(0, 1)
    states = torch.randn(10, 32, requires_grad=True)
    from_forward = losses.next_token_kl(
        student, source, states, teacher_states, F.log_softmax(outputs.logits.flatten(0, 1), -1)
    )
    from_head = losses.next_token_kl(student, source, states, teacher_states)
    assert from_forward.item() == pytest.approx(from_head.item(), rel=1e-5)
    hidden = source.config.hidden_size  # 32: the forward's logits while the rows are no more
    assert losses.teacher_logits_from_forward(hidden, source, torch.device("cpu"))
    assert not losses.teacher_logits_from_forward(hidden + 1, source, torch.device("cpu"))


def test_teacher_samples_are_distinct(llama):
    teacher = load_unswapped(str(llama / "llama"), head="causal-lm")
    tokenizer = AutoTokenizer.from_pretrained(llama / "post")
    options = HealOptions(data="teacher", sample_count=12, sample_length=10, batch_size=5)
    rows = teacher_samples(teacher, tokenizer, options)
    sequences = {tuple(row["input_ids"]) for row in rows}
    assert len(rows) == 12 and len(sequences) == 12
    assert all(len(row["input_ids"]) == 10 for row in rows)
    draws = uniform_draws(0, 12, 11)  # the first group's: every second text without BOS, from a token drawn after it

    def sampled(starts, draws):  # never EOS
        sampling = LogitsProcessorList([InverseCdfSampling(1.0, draws)])
        steps = dict(max_new_tokens=draws.shape[1], min_new_tokens=draws.shape[1])
        return teacher.generate(
            starts, attention_mask=torch.ones_like(starts), do_sample=False, logits_processor=sampling, **steps
        )

    starts = torch.full((12, 1), tokenizer.bos_token_id)  # one group of the 12 texts
    starts[1::2] = sampled(starts[1::2], draws[1::2, :1])[:, 1:]
    sampled = sampled(starts, draws[:, 1:]).tolist()
    texts = rows["input_ids"]
    assert texts == [text[:-1] for text in sampled]
    assert {text[0] == tokenizer.bos_token_id for text in texts[::2]} == {True}
    assert len({text[0] for text in texts[1::2]}) > 1
    stream = iter(teacher_samples(teacher, tokenizer, HealOptions(data="teacher", sample_length=10, batch_size=5)))
    count = sampled_together(teacher) + 8  # past the first seeded group
    streamed = [tuple(next(stream)["input_ids"]) for _ in range(count)]
    assert len(set(streamed)) == count
    as_read = HealOptions(data="teacher", sample_length=10, max_steps=1, batch_size=6)  # reads 12: one group of 12
    streamed = itertools.islice(teacher_samples(teacher, tokenizer, as_read), 12)
    assert [row["input_ids"] for row in streamed] == texts


def test_texts_sampled_ahead_are_those_the_stream_reads_in_its_order(llama):
    """What a sharded healing trains on (`sampled_ahead`, sampled before the teacher is sharded): the stream's first
    texts in the order it reads them (each read twice here: two groups, then the first again), and the first
    readings the fit reads."""
    teacher = load_unswapped(str(llama / "llama"), head="causal-lm")
    options = HealOptions(
        data="teacher", sample_length=6, sample_reads=2, reconstruct_steps=1, reconstruct_sequences=16
    )
    stream = TeacherSamples(teacher, start=1, pad=0, options=options, states=False)
    count = 2 * sampled_together(teacher) + 8
    ahead = sampled_ahead(stream, count, options)
    fresh = TeacherSamples(teacher, start=1, pad=0, options=options, states=False)
    assert [row["input_ids"] for row in ahead] == [row["input_ids"] for row in itertools.islice(fresh, count)]
    first = [row["input_ids"] for row in itertools.islice(fresh.first_readings(), 16)]
    assert [row["input_ids"] for row in ahead.first_readings()] == first
    distinct = {tuple(row) for row in ahead.rows.tolist()}
    assert len(distinct) == count - 8  # the first group's second reading after the second's


def test_sampled_texts_start_from_bos_else_eos_else_the_configs(llama):
    teacher = load_unswapped(str(llama / "llama"), head="causal-lm")
    tokenizer = AutoTokenizer.from_pretrained(llama / "post")
    assert start_token(tokenizer, teacher.config) == tokenizer.bos_token_id
    tokenizer.bos_token = None
    assert start_token(tokenizer, teacher.config) == tokenizer.eos_token_id
    tokenizer.eos_token = None
    assert start_token(tokenizer, teacher.config) == teacher.config.bos_token_id
    assert start_token(None, teacher.config) == teacher.config.bos_token_id
    teacher.config.bos_token_id = teacher.config.eos_token_id = None
    with pytest.raises(HealError, match=r"^--data teacher needs a BOS or EOS token .* to start from$"):
        teacher_samples(teacher, tokenizer, HealOptions(data="teacher", sample_count=4, sample_length=10))


def test_inverse_cdf_sampling_draws_from_the_softmax_at_the_temperature():
    """200,000 draws of one row's next token: each token's frequency within 0.004 of softmax(scores / temperature)
    over the tokens not left out (4 standard errors or more); a token of score -inf, or one left out (EOS), never
    drawn; ids left out that the scores do not hold (past the vocabulary, negative) change nothing."""
    scores = torch.tensor([2.0, 0.5, -math.inf, 1.0, -1.0, 3.0])
    for temperature, never in ((1.0, ()), (0.7, ()), (1.0, (5, 6, -1))):
        draws = uniform_draws(0, 200_000, 1)
        drawn = InverseCdfSampling(temperature, draws, never)(None, scores.expand(200_000, -1)).argmax(-1)
        frequencies = torch.bincount(drawn, minlength=len(scores)) / len(drawn)
        left_out = torch.tensor([token for token in never if 0 <= token < len(scores)], dtype=torch.long)
        expected = torch.softmax(scores.index_fill(0, left_out, -math.inf) / temperature, -1)
        assert frequencies[2] == 0 and frequencies[left_out].sum() == 0
        assert (frequencies - expected).abs().max() < 0.004


def test_calibration_texts_are_drawn_as_the_teachers_are(llama):
    """A conversion's calibration texts (`sampled_batches`) come from the same sampler as heal's teacher texts:
    reproduced by `generate` with `InverseCdfSampling` at the seed's draws, without a static cache; the global
    generator is not drawn from."""
    teacher = load_unswapped(str(llama / "llama"), head="causal-lm")
    tokenizer = AutoTokenizer.from_pretrained(llama / "post")
    torch.manual_seed(123)
    expected_next = torch.rand(1)
    torch.manual_seed(123)
    ids = sampled_batches(teacher, tokenizer, count=6, length=9, seed=4)[0]["input_ids"]
    assert torch.equal(torch.rand(1), expected_next)
    bos = torch.full((6, 1), tokenizer.bos_token_id)
    sampling = dict(
        do_sample=False, logits_processor=LogitsProcessorList([InverseCdfSampling(1.0, uniform_draws(4, 6, 8))])
    )
    length = dict(max_new_tokens=8, min_new_tokens=8)
    expected = teacher.generate(bos, attention_mask=torch.ones_like(bos), **length, **sampling)
    assert ids.shape == (6, 9) and torch.equal(ids, expected)
    assert len({tuple(text) for text in ids.tolist()}) == 6


def _sampled_batch(llama, texts: int):
    """The tiny LLaMA teacher, its tokenizer, and a training batch of `texts` texts of 10 tokens sampled from it, as
    a healing batches them."""
    teacher = load_unswapped(str(llama / "llama"), head="causal-lm")
    tokenizer = AutoTokenizer.from_pretrained(llama / "post")
    options = HealOptions(data="teacher", sample_length=10, eval_size=4, batch_size=4)
    sampled = heal_texts(read_texts(options), options=options, tokenizer=tokenizer, teacher=teacher)
    return teacher, tokenizer, sampled.collator(list(itertools.islice(sampled.train, texts)))


def test_teacher_samples_come_with_the_teachers_states_on_them(llama):
    """Each sampled text carries the states its sampling computed: those of the teacher's forward on the text, at
    every boundary; and a batch of them stacks those states."""
    teacher, tokenizer, batch = _sampled_batch(llama, 6)
    ids, states = batch["input_ids"], batch[TEACHER_STATES]
    with torch.no_grad():
        forward = teacher(ids, output_hidden_states=True).hidden_states
    assert states.shape == (6, teacher.config.num_hidden_layers + 1, 10, teacher.config.hidden_size)
    assert ids[0, 0] == tokenizer.bos_token_id and ids[1, 0] != tokenizer.bos_token_id
    torch.testing.assert_close(states, torch.stack(forward, 1), rtol=1e-4, atol=1e-5)


def test_training_on_sampled_text_reads_the_teachers_states_from_it(llama, tmp_path, monkeypatch):
    """On sampled text the healing's loss takes the teacher's states from the text, without running the teacher (only
    its head, for the KL), and equals the loss with the teacher run on the batch."""
    teacher, _, batch = _sampled_batch(llama, 8)
    student = HEAD_CLASSES["causal-lm"].from_pretrained(llama / "post")
    arguments = TrainingArguments(str(tmp_path), use_cpu=True, report_to=[])
    trainer = HealTrainer(model=student, args=arguments, teacher=teacher, objective="kl", packing=True)
    without_states = {key: value for key, value in batch.items() if key != TEACHER_STATES}
    from_forward = trainer.compute_loss(student, dict(without_states))
    monkeypatch.setattr(teacher, "forward", None)  # the teacher does not run
    from_states = trainer.compute_loss(student, dict(batch))
    assert from_states.item() == pytest.approx(from_forward.item(), rel=1e-5)


def test_a_batch_without_padding_trains_as_it_is(llama, tmp_path, monkeypatch):
    """Sampled texts fill their rows, so with `packing` the healing runs them unpacked (no block-diagonal mask to
    build): the states are those of the batch packed, within float32 rounding, and `pack_padded` is not called."""
    teacher, _, batch = _sampled_batch(llama, 8)
    student = HEAD_CLASSES["causal-lm"].from_pretrained(llama / "post")
    inputs = {key: batch[key] for key in ("input_ids", "attention_mask")}
    with torch.no_grad():
        packed = trainer_module._outputs(student, *trainer_module.pack_padded(inputs), token_logits=False)
        as_it_is = trainer_module._outputs(student, inputs, None, token_logits=False)
    for got, expected in zip(as_it_is.hidden_states, packed.hidden_states, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    arguments = TrainingArguments(str(tmp_path), use_cpu=True, report_to=[])
    trainer = HealTrainer(model=student, args=arguments, teacher=teacher, objective="kl", packing=True)
    monkeypatch.setattr(trainer_module, "pack_padded", None)  # not called
    assert torch.isfinite(trainer.compute_loss(student, dict(batch)))


def _counted_generate(teacher, monkeypatch) -> list:
    """A list that grows by one at each call of `teacher.generate` (two a sampled group)."""
    calls = []
    generate = teacher.generate
    monkeypatch.setattr(teacher, "generate", lambda *args, **kwargs: calls.append(1) or generate(*args, **kwargs))
    return calls


def test_teacher_samples_for_the_fit_are_sampled_once(llama, monkeypatch):
    """The layers' fit reads the first texts of the stream, then training reads it from the start: the same texts,
    the fit's groups sampled once and let go once training has read them, and no other group kept."""
    teacher = load_unswapped(str(llama / "llama"), head="causal-lm")
    tokenizer = AutoTokenizer.from_pretrained(llama / "post")
    group = sampled_together(teacher)
    options = HealOptions(data="teacher", sample_length=10, reconstruct_steps=5, reconstruct_sequences=group + 1)
    stream = teacher_samples(teacher, tokenizer, options)
    calls = _counted_generate(teacher, monkeypatch)
    fitted = [row["input_ids"] for row in itertools.islice(stream.first_readings(), group + 1)]
    assert len(calls) == 2 * 2 and sorted(stream.kept) == [0, 1]  # two calls a group
    trained = [row["input_ids"] for row in itertools.islice(stream, 3 * group)]
    assert len(calls) == 2 * 3 and not stream.kept  # the third group is not kept
    assert trained[: group + 1] == fitted and len({tuple(row) for row in trained}) == 3 * group
    unfitted = teacher_samples(teacher, tokenizer, HealOptions(data="teacher", sample_length=10))
    assert [row["input_ids"] for row in itertools.islice(unfitted, 3 * group)] == trained
    assert len(calls) == 2 * 6 and not unfitted.kept


def test_teacher_samples_read_again(llama, monkeypatch):
    """With `sample_reads`, each group's texts are read again, with their states, after the next group's first
    reading and in a seeded order, without sampling them again; the layers' fit reads the first readings."""
    teacher = load_unswapped(str(llama / "llama"), head="causal-lm")
    tokenizer = AutoTokenizer.from_pretrained(llama / "post")
    group = sampled_together(teacher)
    options = HealOptions(
        data="teacher", sample_length=10, sample_reads=2, reconstruct_steps=5, reconstruct_sequences=2 * group + 1
    )
    stream = teacher_samples(teacher, tokenizer, options)
    calls = _counted_generate(teacher, monkeypatch)
    fitted = reconstruction_batches(stream, tokenizer, options)
    assert len(calls) == 2 * 3 and len(stream.kept) == 3  # two calls a group
    read = list(itertools.islice(stream, 5 * group))
    texts = [tuple(row["input_ids"]) for row in read]
    first, second, again, third = (texts[i * group : (i + 1) * group] for i in range(4))
    assert len(set(first + second + third)) == 3 * group and len(calls) == 2 * 3  # the groups fitted on, kept
    assert set(again) == set(first) and again != first
    assert [list(text) for text in first + second] == torch.cat([b["input_ids"] for b in fitted[:-2]]).tolist()
    assert texts[4 * group :] != second and set(texts[4 * group :]) == set(second)
    assert sorted(stream.kept) == [1, 2]  # the first group, read twice, let go
    states = {tuple(row["input_ids"]): row[TEACHER_STATES] for row in read[:group]}
    assert all(
        torch.equal(row[TEACHER_STATES], states[tuple(row["input_ids"])]) for row in read[2 * group : 3 * group]
    )
    assert [tuple(row["input_ids"]) for row in itertools.islice(stream, 5 * group)] == texts  # seeded


def test_a_smaller_teacher_samples_more_texts_a_group_on_a_cpu():
    """On a CPU a group holds at most SmolLM2-135M's 256 texts x parameters a decoding step, in powers of two, 64 to
    1024; where the texts a healing reads are known (`sample_count`, else its steps' batches and the one read ahead),
    as few as cover them in that many groups, each group's texts read `sample_reads` times."""
    expected = {134_515_008: 256, 10**9: 64, 134_515_008 * 3: 64, 134_515_008 // 4: 1024, 258_112: 1024}
    for parameters, texts in expected.items():
        teacher = torch.nn.Linear(parameters, 1, bias=False, device="meta")  # the meta device computes on a CPU
        assert sampled_together(teacher) == texts
    smollm2 = torch.nn.Linear(134_515_008, 1, bias=False, device="meta")
    planned = {(100, 8, 1): 202, (100, 8, 2): 162, (20, 8, 1): 168, (2, 8, 1): 24, (100, 32, 1): 249}
    for (steps, batch, reads), texts in planned.items():  # 808 reads: 4 groups of 202; 2 reads: 3 groups, 5 readings
        options = HealOptions(data="teacher", max_steps=steps, batch_size=batch, sample_reads=reads)
        assert sampled_together(smollm2, options) == texts
    for steps in (None, 100):  # texts sampled once: 1,030 in 5 groups, whatever the steps
        options = HealOptions(data="teacher", sample_count=1030, max_steps=steps)
        assert sampled_together(smollm2, options) == 206


def test_a_healing_samples_the_texts_it_reads(llama, monkeypatch):
    """A healing on the teacher's text samples its steps' texts and the batch read ahead in one group, no more (on a
    CPU: an accelerator samples 63 groups more with it)."""
    groups, reads, sample, read = [], [], TeacherSamples._sample, TeacherSamples._read

    def counted_sample(*args, **kwargs):
        sampled = sample(*args, **kwargs)
        groups.extend(len(ids) for ids, _ in sampled.values())
        return sampled

    def counted_read(*args, **kwargs):
        for row in read(*args, **kwargs):
            reads.append(1)
            yield row

    monkeypatch.setattr(TeacherSamples, "_sample", counted_sample)
    monkeypatch.setattr(TeacherSamples, "_read", counted_read)
    options = HEAL | dict(max_steps=3, batch_size=4, reconstruct_steps=0)
    report = heal_checkpoint(str(llama / "post"), str(llama / "sampled-as-read"), **options, data="teacher")
    at_once = 1024 // 16 if torch.accelerator.is_available() else 1  # an accelerator samples 64 groups at once
    assert report["steps"] == 3 and groups == [16] * at_once and len(reads) == 16  # 16: (3 + 1) x 4


def test_teacher_samples_are_the_same_however_many_groups_are_sampled_at_once(llama, monkeypatch):
    """An accelerator samples several groups in one generation (`groups_at_once`); each text comes from its own row
    of its group's draws, so the stream's texts are those a CPU samples a group at a time. The group's size depends
    on the model and the texts read, not on the device."""
    teacher = load_unswapped(str(llama / "llama"), head="causal-lm")
    tokenizer = AutoTokenizer.from_pretrained(llama / "post")
    options = HealOptions(data="teacher", sample_length=10, max_steps=4, batch_size=3, sample_reads=2)
    assert sampled_together(teacher, options) == 15 and data_module.groups_at_once(teacher, 15) == 1  # (4 + 1) x 3
    calls = _counted_generate(teacher, monkeypatch)
    one_at_a_time = [row["input_ids"] for row in itertools.islice(teacher_samples(teacher, tokenizer, options), 70)]
    assert len(calls) == 2 * 3 and len({tuple(row) for row in one_at_a_time}) == 3 * 15  # each group read twice
    monkeypatch.setattr(data_module, "groups_at_once", lambda teacher, together: 4)
    at_once = [row["input_ids"] for row in itertools.islice(teacher_samples(teacher, tokenizer, options), 70)]
    assert at_once == one_at_a_time and len(calls) == 2 * 3 + 2  # groups 0-3 in one generation
    stream = TeacherSamples(teacher, start=tokenizer.bos_token_id, pad=0, options=options, states=False)
    groups = stream._sample(range(3), 15)
    assert [groups[group][0].tolist() for group in range(3)] == [
        stream.sample(group)[0].tolist() for group in range(3)
    ]


def test_teacher_samples_depend_on_no_batch_size(llama):
    """The texts sampled are the same whatever the batch size (a process's share of the global batch)."""
    teacher = load_unswapped(str(llama / "llama"), head="causal-lm")
    tokenizer = AutoTokenizer.from_pretrained(llama / "post")
    sampled = [
        [row["input_ids"] for row in teacher_samples(teacher, tokenizer, HealOptions(**options))]
        for options in (
            dict(data="teacher", sample_count=36, sample_length=10, batch_size=2),
            dict(data="teacher", sample_count=36, sample_length=10, batch_size=8),
        )
    ]
    assert sampled[0] == sampled[1] and len({tuple(row) for row in sampled[0]}) == 36


@pytest.mark.parametrize("schedule", ["direct", "gate", "layers", "taper"])
def test_kl_healing_on_teacher_text(llama, schedule):
    report = heal_checkpoint(
        str(llama / "post-shifted" if schedule == "direct" else llama / "post"),
        str(llama / f"healed-{schedule}"),
        **HEAL,
        swap_schedule=schedule,
    )
    assert report["objective"] == "kl" and report["data"]["name"] == "teacher" and report["data"]["train_rows"] is None
    assert report["data"]["sampling"] == {"temperature": 1.0, "length": 64, "count": None, "reads": 1}
    assert report["swap_schedule"] == schedule
    assert report["tokens"] == 16 * 8 * 64  # every text sampled is 64 tokens long, none padded
    before, after = report["next_token"]["before"], report["next_token"]["after"]
    assert set(after) == {"kl", "kl_by_position", "top1_agreement", "cross_entropy_gap", "greedy_agreement"}
    bins = list(after["kl_by_position"])  # the held-out sentences' positions, from the first
    assert len(bins) >= 4 and bins == list(POSITION_BINS)[: len(bins)]
    if schedule == "direct":  # far from the source at the start: healing must bring it closer
        assert after["kl"] < 0.85 * before["kl"]
        assert "kl_by_layer" not in before  # uncalibrated: no stream recorded to swap layers alone
    else:  # each layer alone swapped, of the calibrated conversion as healing starts
        assert len(before["kl_by_layer"]) == 2 and min(before["kl_by_layer"]) > 1e-4
    losses_logged = [entry["loss"] for entry in report["log_history"] if "loss" in entry]
    assert len(losses_logged) >= 4


def test_greedy_agreement_with_a_continuation_generated_once(llama):
    teacher = load_unswapped(str(llama / "llama"), head="causal-lm")
    student = HEAD_CLASSES["causal-lm"].from_pretrained(llama / "post-shifted")
    tokenizer = AutoTokenizer.from_pretrained(llama / "post")
    batch = dict(tokenizer(["the cat sat on the mat", "a dog ran"], padding=True, return_tensors="pt"))
    prompts = greedy_prompts([batch], tokenizer, length=4)
    expected = greedy_continuation(teacher, prompts, new_tokens=6)
    assert expected.shape == (2, 6)
    assert greedy_agreement(expected, teacher, prompts) == 1.0
    settings = dict(do_sample=False, min_new_tokens=6, max_new_tokens=6, pad_token_id=student.config.pad_token_id)
    given = student.generate(**prompts, **settings)[:, prompts["input_ids"].shape[1] :]
    assert greedy_agreement(expected, student, prompts) == (given == expected).float().mean().item()


def test_next_token_kl_by_position_in_the_text(llama):
    """The KL of each position bin is the mean of the per-token KL there (positions counted from each text's first
    real token, right or left padded); the overall KL is the mean over every real token."""
    teacher = load_unswapped(str(llama / "llama"), head="causal-lm")
    student = HEAD_CLASSES["causal-lm"].from_pretrained(llama / "post-shifted")
    input_ids = torch.randint(1, teacher.config.vocab_size, (3, 20), generator=torch.Generator().manual_seed(0))
    lengths = torch.tensor([20, 5, 2])
    column = torch.arange(20).expand(3, -1)
    right = column < lengths[:, None]
    layouts = {"right": (right, column), "left": (right.flip(1), column - (20 - lengths[:, None]))}
    per_token, positions = [], []
    for mask, position in layouts.values():
        with torch.no_grad():
            expected = F.log_softmax(teacher(input_ids, attention_mask=mask.long()).logits, -1)
            given = F.log_softmax(student(input_ids, attention_mask=mask.long()).logits, -1)
        per_token.append(F.kl_div(given, expected, log_target=True, reduction="none").sum(-1)[mask])
        positions.append(position[mask])
    per_token, positions = torch.cat(per_token), torch.cat(positions)
    batches = [{"input_ids": input_ids, "attention_mask": mask.long()} for mask, _ in layouts.values()]
    figures = next_token_agreement(teacher, student, batches)
    bins = {"0": (0, 1), "1": (1, 2), "2-3": (2, 4), "4-15": (4, 16), "16-63": (16, 20)}
    assert list(figures["kl_by_position"]) == list(bins)  # no token at 64 or later
    for name, (start, end) in bins.items():
        chosen = (positions >= start) & (positions < end)
        assert figures["kl_by_position"][name] == pytest.approx(per_token[chosen].mean().item(), rel=1e-4, abs=1e-6)
    assert figures["kl"] == pytest.approx(per_token.mean().item(), rel=1e-4)
    assert (positions == 0).sum() == 6 and (positions >= 16).sum() == 8


def test_next_token_figures_from_final_states_equal_the_forwards(llama):
    """The figures a healing takes from the final states it holds (through the heads alone) are the models' own
    forwards', right and left padded, for the source LLaMA and a NormSwap student."""
    teacher = load_unswapped(str(llama / "llama"), head="causal-lm")
    student = HEAD_CLASSES["causal-lm"].from_pretrained(llama / "post-shifted")
    input_ids = torch.randint(1, teacher.config.vocab_size, (3, 12), generator=torch.Generator().manual_seed(1))
    right = torch.arange(12).expand(3, -1) < torch.tensor([12, 5, 2])[:, None]
    batches = [{"input_ids": input_ids, "attention_mask": mask.long()} for mask in (right, right.flip(1))]
    with torch.no_grad():
        finals = [[boundary_states(model, batch)[-1] for batch in batches] for model in (teacher, student)]
    figures = agreement(*(final_state_log_probs(m, f, batches) for m, f in zip((teacher, student), finals)), batches)
    expected = next_token_agreement(teacher, student, batches)
    assert expected["kl"] > 0.1  # the uncalibrated conversion is far from its source
    assert figures["kl"] == pytest.approx(expected["kl"], rel=1e-5)
    assert figures["kl_by_position"] == pytest.approx(expected["kl_by_position"], rel=1e-5)
    assert figures["top1_agreement"] == expected["top1_agreement"]
    gaps = []  # the cross-entropy gap token by token: each real token followed by a real one, from the forwards
    with torch.no_grad():
        for batch in batches:
            teacher_lp, student_lp = (F.log_softmax(m(**batch).logits, -1) for m in (teacher, student))
            for row, t in (batch["attention_mask"][:, :-1] * batch["attention_mask"][:, 1:]).nonzero().tolist():
                following = batch["input_ids"][row, t + 1]
                gaps.append((teacher_lp[row, t, following] - student_lp[row, t, following]).item())
    assert len(gaps) == 2 * (11 + 4 + 1)
    assert figures["cross_entropy_gap"] == pytest.approx(sum(gaps) / len(gaps), rel=1e-5)
    assert expected["cross_entropy_gap"] == pytest.approx(sum(gaps) / len(gaps), rel=1e-5)


def test_a_healing_generates_the_teachers_continuation_once(llama, tmp_path, monkeypatch):
    calls = []
    generate = GenerationMixin.generate

    def counted(model, *args, **kwargs):
        calls.append(model.config.layer_norm_placements[0])  # the teacher is pre-LN, the student post-LN
        return generate(model, *args, **kwargs)

    monkeypatch.setattr(GenerationMixin, "generate", counted)
    options = {**HEAL, "max_steps": 2, "data": "sst2-sample"}
    heal_checkpoint(str(llama / "post-shifted"), str(tmp_path / "healed"), **options)
    assert sorted(calls) == ["post", "post", "pre"]  # the student before and after healing


@pytest.fixture(scope="module")
def healed_text(llama):
    """The shifted post-LN variant healed on text with the KL objective; its folder and report."""
    output = llama / "healed-text"
    report = heal_checkpoint(str(llama / "post-shifted"), str(output), **{**HEAL, "max_steps": 30}, data="sst2-sample")
    return output, report


def test_kl_objective_decreases_on_text(healed_text):
    _, report = healed_text
    assert report["data"]["name"] == "sst2-sample" and report["data"]["sampling"] is None
    before, after = report["next_token"]["before"], report["next_token"]["after"]
    assert after["kl"] < 0.5 * before["kl"] and after["top1_agreement"] > before["top1_agreement"]


def test_bad_input_one_line(tmp_path, llama, capsys, monkeypatch):
    save_source(tmp_path / "bert", "bert", "Model")
    save_source(tmp_path / "llama-base", "llama", "Model")
    convert_checkpoint(str(tmp_path / "bert"), str(tmp_path / "pre"), norm_placement="pre", **QUIET)
    cases = [
        ([str(tmp_path / "pre"), "--data", "teacher"], "--data teacher needs a causal-LM student; "),
        (
            [str(llama / "post"), "--teacher", str(tmp_path / "llama-base"), "--objective", "hidden"],
            f"--data teacher needs a teacher that generates (a causal LM); {tmp_path / 'llama-base'} has none",
        ),
        ([str(llama / "post"), "--teacher", str(tmp_path / "bert")], "objective='kl' needs a causal-LM teacher;"),
        ([str(tmp_path / "pre"), "--objective", "kl"], "objective='kl' needs a causal-LM student"),
        ([str(llama / "post-shifted"), "--swap-schedule", "gate"], "needs a calibrated conversion out of pre-LN"),
        ([str(llama / "post"), "--sample-count", "0"], "sample_count=0 is invalid"),
        ([str(llama / "post"), "--sample-reads", "0"], "sample_reads=0 is invalid: at least 1"),
        (
            [str(llama / "post"), "--sample-reads", "2", "--sample-count", "64"],
            "sample_reads=2 is invalid: more than 1 needs a stream",
        ),
        ([str(llama / "post-shifted"), "--swap-schedule", "taper"], "needs a calibrated conversion out of pre-LN"),
        (
            [str(llama / "post"), "--swap-schedule", "taper", "--activation-checkpointing"],
            "swap_schedule='taper' is invalid: not with activation_checkpointing=True",
        ),
        (
            [str(llama / "post-shifted"), "--reconstruct-steps", "5"],
            "reconstruct_steps=5 needs a calibrated conversion",
        ),
        (
            [str(llama / "post"), "--reconstruct-steps", "5", "--reconstruct-sequences", "8"],
            "reconstruct_sequences=8 is invalid: too few for the fit: at least 16",
        ),
        (
            [str(llama / "post"), "--reconstruct-steps", "5", "--swap-schedule", "taper"],
            "reconstruct_steps=5 is invalid: the fit needs swap_schedule='direct'",
        ),
        (
            [str(llama / "post"), "--reconstruct-steps", "5", "--lora"],
            "reconstruct_steps=5 is invalid: not with lora=True",
        ),
        (
            [str(llama / "post"), "--reconstruct-steps", "5", "--data", str(tmp_path / "few.txt")],
            "reconstruct_sequences=128 is invalid: the training text holds",
        ),
        ([str(llama / "post"), "--max-tokens", "0"], "max_tokens=0 is invalid: a whole number, at least 1"),
        ([str(llama / "post"), "--max-seconds", "-1"], "max_seconds=-1.0 is invalid: a positive number of seconds"),
        (
            [str(llama / "post"), "--max-tokens", "4096", "--max-seconds", "60"],
            "max_tokens=4096 is invalid: give one budget",
        ),
        ([str(llama / "post"), "--stop-patience", "-1"], "stop_patience=-1 is invalid: 0 (never stop early) or more"),
        ([str(llama / "post"), "--dev-size", "65"], "dev_size=65 is invalid: 1 to 64"),
        (  # the default fit's
            [str(llama / "post"), "--reconstruct-sequences", "4"],
            "reconstruct_sequences=4 is invalid: too few for the fit: at least 16",
        ),
    ]
    (tmp_path / "few.txt").write_text("".join(f"text number {i}\n" for i in range(40)))
    capsys.readouterr()
    for arguments, message in cases:
        output = tmp_path / "out"
        with monkeypatch.context() as patch:
            if "the training text holds" not in message:  # counted on the tokenized text, after loading
                patch.setattr(heal_models, "_load_student", lambda *args, **kwargs: pytest.fail("loaded"))
            assert cli(["heal", *arguments, str(output), "--max-steps", "2"]) == 1
        error = capsys.readouterr().err.strip()
        assert message in error and len(error.splitlines()) == 1 and not output.exists(), error
    with pytest.raises(HealError, match="swap_schedule='slow' is invalid"):
        HealOptions(swap_schedule="slow")


def test_a_recorded_stream_that_does_not_fit_the_layers_is_refused_before_loading(llama, tmp_path, monkeypatch):
    variant = shutil.copytree(llama / "post", tmp_path / "post")
    record = json.loads((variant / "conversion.json").read_text())
    record["calibration"]["stream_rms"] = record["calibration"]["stream_rms"][:-1]
    (variant / "conversion.json").write_text(json.dumps(record))
    monkeypatch.setattr(heal_models, "_load_student", lambda *args, **kwargs: pytest.fail("loaded"))
    with pytest.raises(HealError, match=r"^swap_schedule='gate': the recorded stream RMS does not fit the model's"):
        heal_checkpoint(str(variant), str(tmp_path / "out"), swap_schedule="gate", log=None)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("student_positions", ["absolute", "rope"])
def test_texts_stay_within_the_absolute_positions(tmp_path, monkeypatch, student_positions):
    """Where student or teacher has absolute positions (a GPT-2 of 64; the student converted to RoPE or not), sampled
    texts longer than its table are refused, naming that model, before either loads; other texts are cut there."""
    save_source(tmp_path / "gpt2", "gpt2", "LMHeadModel")
    post = tmp_path / "post"
    convert_checkpoint(
        str(tmp_path / "gpt2"),
        str(post),
        norm_placement="post",
        attention="causal",
        position_embedding_type=student_positions,
        **QUIET,
    )
    limited = str(post) if student_positions == "absolute" else f"the teacher {tmp_path / 'gpt2'}"
    refused = f"^sample_length=100 is invalid: {re.escape(limited)} holds 64 positions; at most that$"
    with monkeypatch.context() as patch, pytest.raises(HealError, match=refused):
        patch.setattr(heal_models, "_load_student", lambda *args, **kwargs: pytest.fail("loaded"))
        heal_checkpoint(str(post), str(tmp_path / "out"), sample_length=100, max_steps=2, log=None)
    with pytest.raises(HealError, match=refused):  # `heal --plan` refuses what `heal` refuses
        heal_plan(str(post), HealOptions(sample_length=100), processes=1)
    (tmp_path / "long.txt").write_text("".join(" ".join([word] * 300) + "\n" for word in ("a", "b", "c", "d")))
    options = dict(HEAL, max_steps=1, batch_size=2, data=str(tmp_path / "long.txt"), max_length=100)
    report = heal_checkpoint(str(post), str(tmp_path / "out"), **options, reconstruct_steps=0)
    assert report["max_length"] == 64 and report["tokens"] == 2 * 64  # a step of two texts, of 64 tokens each


def test_an_unparsable_budget_gives_one_line(capsys):
    with pytest.raises(SystemExit) as exit:
        cli(["heal", "variant", "healed", "--max-tokens", "lots"])
    assert exit.value.code == 2
    assert (
        capsys.readouterr().err.strip() == "hf-normswap heal: error: argument --max-tokens: invalid int value: 'lots'"
    )


def test_the_development_texts_stop_a_healing_that_no_longer_improves(tmp_path, llama):
    """At a learning rate that moves nothing, the KL on the development texts (measured every tenth of the steps)
    stops falling: with patience 1 the healing stops at its second measurement; heal.json says where and why. The
    held-out texts are measured as it begins and ends (the stop's development KL is the curve along the way), and
    heal.png draws it beside them."""
    from matplotlib.image import imread

    options = {**HEAL, "max_steps": 20, "learning_rate": 1e-12, "stop_patience": 1, "dev_size": 32}
    report = heal_checkpoint(str(llama / "post"), str(tmp_path / "stopped"), **options)
    budget = report["budget"]
    assert budget["stopped_at"] == 4 and report["steps"] == 4 and budget["steps"] == 20
    assert [entry["step"] for entry in budget["development_kl"]] == [2, 4]
    assert budget["development_kl"][1]["kl"] == pytest.approx(budget["development_kl"][0]["kl"], rel=1e-4)
    assert budget["development_texts"] == 32 and budget["patience"] == 1
    assert [entry["step"] for entry in report["history"]] == [0, 4] and report["tokens"] == 4 * 8 * 64
    assert 0 < report["measuring_seconds"] < report["seconds"]
    assert imread(tmp_path / "stopped" / "heal.png").shape[1] == 11 * 120  # two panels, 11 inches at 120 dpi
    sampled = report["sampled_next_token"]  # on the development texts, as training begins and after
    assert set(sampled["after"]["kl_by_position"]) == {"0", "1", "2-3", "4-15", "16-63"}  # 64 tokens a text
    for figures in sampled.values():
        assert figures["kl"] == pytest.approx(budget["development_kl"][-1]["kl"], rel=1e-4)
        assert math.isfinite(figures["cross_entropy_gap"]) and 0 < figures["top1_agreement"] <= 1
    improving = heal_checkpoint(
        str(llama / "post"), str(tmp_path / "improving"), **{**options, "learning_rate": 1e-3, "stop_patience": 8}
    )
    assert improving["budget"]["stopped_at"] is None and improving["steps"] == 20
    kl = [improving["sampled_next_token"][when]["kl"] for when in ("before", "after")]
    assert kl[1] < kl[0]
    unmeasured = heal_checkpoint(str(llama / "post"), str(tmp_path / "unmeasured"), **HEAL)
    assert unmeasured["sampled_next_token"] is None and unmeasured["budget"]["development_kl"] is None
    assert [entry["step"] for entry in unmeasured["history"]] == [0, 3, 6, 9, 12, 15, 16]  # every fifth, and the last
    assert imread(tmp_path / "unmeasured" / "heal.png").shape[1] == 6 * 120


def test_an_interrupted_causal_healing_resumes_to_where_the_whole_one_stops(tmp_path, llama, monkeypatch):
    """A causal LM's healing with the teacher's texts, the layers' fit and the stop on the development texts (measured
    every step; with patience 3 the flat KL of a rate that moves nothing stops it at step 4), interrupted in step 4
    after the checkpoint of step 2: resumed, it stops at step 4 with the development figures of steps 1 and 2 read
    back from beside the checkpoint, and reports what the whole healing does within 1e-5."""
    from hf_normswap.heal import healing

    options = {**HEAL, "max_steps": 10, "learning_rate": 1e-12, "stop_patience": 3, "dev_size": 16}
    options |= {"reconstruct_steps": 2, "reconstruct_sequences": 16}
    whole = heal_checkpoint(str(llama / "post"), str(tmp_path / "whole"), **options)
    assert whole["budget"]["stopped_at"] == 4 and whole["reconstruction"]["steps"] == 2
    resumable = {**options, "checkpoint_dir": str(tmp_path / "checkpoints")}
    with interrupted(monkeypatch, healing, "HealTrainer", step=3):  # after the checkpoint of step 2
        heal_checkpoint(str(llama / "post"), str(tmp_path / "resumed"), **resumable)
    assert json.loads((tmp_path / "checkpoints" / "development_stop.json").read_text())["history"][-1]["step"] == 2
    resumed = heal_checkpoint(str(llama / "post"), str(tmp_path / "resumed"), **resumable)
    assert resumed["resumed"] and resumed["budget"]["stopped_at"] == 4 and resumed["steps"] == 4
    assert resumed["tokens"] == whole["tokens"] == 4 * 8 * 64
    ours, theirs = resumed["budget"]["development_kl"], whole["budget"]["development_kl"]
    assert [entry["step"] for entry in ours] == [entry["step"] for entry in theirs] == [1, 2, 3, 4]
    for a, b in zip(ours, theirs):
        assert a["kl"] == pytest.approx(b["kl"], abs=1e-5)
    for a, b in zip(resumed["history"] + resumed["after"], whole["history"] + whole["after"]):
        assert a == pytest.approx(b, abs=1e-5)
    assert resumed["next_token"]["after"]["kl"] == pytest.approx(whole["next_token"]["after"]["kl"], abs=1e-5)
    fits = [torch.tensor(report["reconstruction"]["layer_errors"]) for report in (resumed, whole)]
    torch.testing.assert_close(*fits, rtol=0, atol=1e-7)  # the layers fitted again, alike


def test_a_budget_in_tokens_from_the_command_line(tmp_path, llama):
    """`--max-tokens 2048` on sampled texts of 64 tokens, 8 a step: 4 steps, the budget recorded in heal.json."""
    options = ["--eval-size", "16", "--stop-patience", "0", "--reconstruct-steps", "0", "--learning-rate", "1e-3"]
    assert cli(["heal", str(llama / "post"), str(tmp_path / "healed"), "--max-tokens", "2048", *options]) == 0
    report = json.loads((tmp_path / "healed" / "heal.json").read_text())
    assert report["steps"] == report["budget"]["steps"] == 4 and report["budget"]["tokens"] == 2048
    assert report["tokens"] == 4 * 8 * 64


def test_a_time_budget_stops_training(tmp_path, llama):
    report = heal_checkpoint(str(llama / "post"), str(tmp_path / "timed"), **{**HEAL, "max_seconds": 1e-6})
    assert report["steps"] == 1 and report["budget"]["seconds"] == 1e-6 and report["budget"]["steps"] == 16


def test_a_healing_that_diverges_ends_before_the_step_and_writes_nothing(tmp_path, llama):
    """At a learning rate that overflows the weights (the first step's rate is 0, in the warm-up), the third step's
    gradient is NaN: the healing ends there in one line, as the optimizer would have made every weight NaN."""
    output = tmp_path / "diverged"
    with pytest.raises(HealError) as error:
        heal_checkpoint(str(llama / "post"), str(output), **{**HEAL, "max_steps": 6, "learning_rate": 1e30})
    assert str(error.value) == (
        "the healing diverged at step 3 of 6: its gradient is not finite (a lower learning_rate, or another "
        "swap_schedule, may train)"
    )
    assert not output.exists()


def test_card_reports_next_token_figures(healed_text):
    folder, _ = healed_text
    card, _ = build_card(folder, "user/healed", base_model="user/tiny-llama", license="mit")
    record = json.loads((folder / "conversion.json").read_text())
    effect, after = record["swap_effect"], record["heal"]["next_token"]["after"]
    assert f"top-1 agreement {effect['top1_agreement']:.3f}" in card.text
    held_out = record["heal"]["data"]["held_out_rows"]
    assert f"after healing, on {held_out} held-out texts of sst2-sample, KL {after['kl']:.3f} nats" in card.text
    gap = after["cross_entropy_gap"]
    assert f", cross-entropy {gap:+.3f} nats per token from the source's (`heal.json`" in card.text
    tokens, rows = record["heal"]["tokens"], record["heal"]["data"]["train_rows"]
    assert f"30 steps, {tokens:,} tokens of sst2-sample ({rows:,} rows)" in card.text


def test_a_pushed_healed_variant_gives_its_healed_figures_and_uploads_what_its_card_cites(healed_text, tmp_path):
    folder, report = healed_text
    upload = tmp_path / "upload"
    upload.mkdir()
    files = prepare_upload(folder, "user/healed", upload, base_model="user/tiny-llama", license="mit")
    text = (upload / "README.md").read_text()
    before, after = report["before"][-1]["token_cosine"], report["after"][-1]["token_cosine"]
    assert f"token cosine of the final output to the source {before:.4f} before, {after:.4f} after" in text
    assert f"KL {report['next_token']['after']['kl']:.3f} nats per token" in text
    cited = set(re.findall(r"`([\w.-]+\.(?:json|png))`", text))
    assert {"heal.json", "heal.png"} <= cited and cited <= set(files)
    assert json.loads((upload / "heal.json").read_text())["steps"] == 30

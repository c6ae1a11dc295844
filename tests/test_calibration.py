"""Calibrated swaps: sublayer writes scaled, and linear writes refitted against the source, where norms that wrote the
residual stream come to read it."""

import pytest
import torch
import torch.nn.functional as F

from hf_normswap import NormSwapModel, convert_checkpoint
from hf_normswap.cli import main as cli
from hf_normswap.convert import refit
from hf_normswap.convert.calibration import calibrate_writes
from hf_normswap.convert.refit import MedianSample, WriteFit, augmented, least_squares_ratios, set_write
from hf_normswap.probes.probe_data import probe_batches, probe_tokenizer

from helpers import save_source, tensors


def quiet(*args, **kwargs):
    return convert_checkpoint(*args, **kwargs, log=lambda _: None)


def token_cosine(source, folder, batch) -> float:
    """Mean cosine between the last hidden states of the source and of the checkpoint in `folder`, over real tokens."""
    real = batch["attention_mask"].bool()
    with torch.no_grad():
        expected = source(**batch).last_hidden_state[real]
        got = NormSwapModel.from_pretrained(folder).eval()(**batch).last_hidden_state[real]
    return F.cosine_similarity(expected, got, dim=-1).mean().item()


@pytest.mark.parametrize("placement", ["pre", "sandwich"])
def test_calibrated_post_to_pre_keeps_more_of_the_function(tmp_path, placement):
    bert = save_source(tmp_path / "bert", "bert", "Model")
    calibrated = quiet(str(tmp_path / "bert"), str(tmp_path / "calibrated"), norm_placement=placement)
    plain = quiet(str(tmp_path / "bert"), str(tmp_path / "plain"), norm_placement=placement, calibrate=False)
    assert plain["calibration"] is None
    record = calibrated["calibration"]
    assert "SST-2 training sample" in record["data"]
    assert sorted(record["write_scales"]) == [
        f"layers.{i}.{s}" for i in range(2) for s in ("attention_norms", "mlp_norms")
    ]

    # Held-out text (the validation sample; calibration used training sentences).
    batch = probe_batches(probe_tokenizer(tmp_path / "bert"), 0, size=32, batch_size=32)[0]
    before, after = token_cosine(bert, tmp_path / "plain", batch), token_cosine(bert, tmp_path / "calibrated", batch)
    assert after > before + 0.1, (before, after)
    assert calibrated["swap_effect"]["after"] > plain["swap_effect"]["after"]

    # Only the writes changed: a pre layer's output projections (refitted), or a sandwich layer's branch norm (a
    # uniform gain, the source norm's bias scaled).
    ours, theirs = tensors(tmp_path / "calibrated"), tensors(tmp_path / "plain")
    writes = (
        ("self_attn.o_proj", "mlp.down_proj")
        if placement == "pre"
        else ("attention_norms.output_norm", "mlp_norms.output_norm")
    )
    expected = sorted(f"layers.{i}.{module}" for i in range(2) for module in writes)
    assert sorted({name.rsplit(".", 1)[0] for name in ours if not torch.equal(ours[name], theirs[name])}) == expected
    assert sorted(record["modules"]) == expected
    if placement == "pre":
        # Every write refitted, each nearer its target than the scaled write; and refitting beats scaling alone.
        assert sorted(record["refit_errors"]) == sorted(record["write_scales"]) and record["ridge"] == refit.RIDGE
        assert all(after < before for before, after in record["refit_errors"].values()), record["refit_errors"]
        scaled = scaled_only(tmp_path / "plain", record["write_scales"])
        with torch.no_grad():
            expected = bert(**batch).last_hidden_state[batch["attention_mask"].bool()]
            got = scaled(**batch).last_hidden_state[batch["attention_mask"].bool()]
        scaled_cosine = F.cosine_similarity(expected, got, dim=-1).mean().item()
        assert 1 - after < 0.5 * (1 - scaled_cosine), (scaled_cosine, after)  # measured: 0.9856 -> 0.9968
    else:
        assert record["refit_errors"] == {} and record["ridge"] is None
        scale = record["write_scales"]["layers.1.attention_norms"]
        source_bias = theirs["layers.1.attention_norms.input_norm.bias"]
        gain = ours["layers.1.attention_norms.output_norm.weight"]
        assert torch.all(gain == gain[0]) and gain[0] > 0
        assert torch.allclose(ours["layers.1.attention_norms.output_norm.bias"], scale * source_bias, atol=1e-7)
        assert "layers.1.attention_norms.output_norm.weight (calibrated)" in calibrated["weights"]["initialized"]


def scaled_only(folder, write_scales):
    """The uncalibrated conversion in `folder` with its writes scaled, not refitted (calibration without targets);
    checks the scaling (the first scale is the recorded one: later ones follow the refitted writes before them)."""
    model = NormSwapModel.from_pretrained(folder).eval()
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    batches = probe_batches(probe_tokenizer(folder), 0, size=704, batch_size=64, split="train")
    sublayers = {
        f"layers.{i}.{s}": f"layers.{i}.{m}"
        for i in range(2)
        for s, m in (("attention_norms", "self_attn.o_proj"), ("mlp_norms", "mlp.down_proj"))
    }
    scales, errors = calibrate_writes(model, sublayers, batches)
    assert scales["layers.0.attention_norms"] == pytest.approx(write_scales["layers.0.attention_norms"], rel=1e-5)
    assert errors == {} and sorted(scales) == sorted(write_scales)
    scale, source_bias = scales["layers.1.attention_norms"], before["layers.1.attention_norms.input_norm.bias"]
    assert torch.allclose(
        model.layers[1].self_attn.o_proj.weight, scale * before["layers.1.self_attn.o_proj.weight"], atol=1e-7
    )
    assert torch.allclose(
        model.layers[1].self_attn.o_proj.bias,
        scale * (before["layers.1.self_attn.o_proj.bias"] + source_bias),
        atol=1e-7,
    )
    return model


def centred(x):
    return x - x.mean(-1, keepdim=True)


def test_a_refit_solves_the_least_squares_problem_and_the_ridge_holds_it(monkeypatch):
    """Without a ridge, the refit is the least-squares write towards the target (each token at the length the
    starting write reaches), as a centring norm sees it; the part the norm removes is kept. With a huge ridge the
    write stays."""
    generator = torch.Generator().manual_seed(0)
    inputs, stream, target = (torch.randn(200, n, generator=generator, dtype=torch.float64) for n in (5, 4, 4))
    for ridge in (1e-12, 1e12):
        monkeypatch.setattr(refit, "RIDGE", ridge)
        writer = torch.nn.Linear(5, 4, dtype=torch.float64)
        start = torch.cat([writer.weight.detach().T, writer.bias.detach()[None]])
        with torch.no_grad():
            reached = centred(stream + writer(inputs))
            fit = WriteFit(augmented(writer), torch.nn.LayerNorm(4))
            for first in range(0, 200, 64):  # summed over batches of tokens
                fit.add(inputs[first : first + 64], stream[first : first + 64], target[first : first + 64])
            refitted, before, after = fit.solve(scale=1.0)
            set_write(writer, refitted)
        fitted = torch.cat([writer.weight.detach().T, writer.bias.detach()[None]])
        rows = torch.cat([inputs, torch.ones(200, 1, dtype=torch.float64)], dim=1)
        length = (reached * centred(target)).sum(-1, keepdim=True) / centred(target).pow(2).sum(-1, keepdim=True)
        solution = torch.linalg.lstsq(rows, length * centred(target) - centred(stream)).solution
        assert before > 0.1
        assert torch.allclose(fitted - centred(fitted), start - centred(start), atol=1e-12)
        if ridge < 1:
            assert torch.allclose(centred(fitted), solution, atol=1e-8)
            assert after < before
        else:
            assert torch.allclose(fitted, start, atol=1e-9) and after == pytest.approx(before, rel=1e-8)


def median_ratio(stream, normalised) -> float:
    sample = MedianSample()
    sample.add(least_squares_ratios(stream, normalised))
    return sample.median()


def test_the_scale_is_the_median_least_squares_ratio():
    stream = torch.tensor([[2.0, 0.0], [0.0, 3.0], [1.0, 1.0]])
    assert median_ratio(stream, stream / 2) == pytest.approx(2.0)
    assert median_ratio(torch.tensor([[1.0], [10.0], [2.0]]), torch.ones(3, 1)) == pytest.approx(2.0)  # not the mean


def test_calibration_keeps_the_shards_dtype(tmp_path):
    save_source(tmp_path / "bert", "bert", "ForSequenceClassification")
    quiet(str(tmp_path / "bert"), str(tmp_path / "half"), norm_placement="pre", dtype="float16")
    quiet(str(tmp_path / "bert"), str(tmp_path / "full"), norm_placement="pre")
    ours, theirs = tensors(tmp_path / "half"), tensors(tmp_path / "full")
    assert {t.dtype for t in ours.values()} == {torch.float16}
    name = "model.layers.0.mlp.down_proj.weight"
    assert not torch.equal(
        ours[name].float(), tensors(tmp_path / "bert")["bert.encoder.layer.0.output.dense.weight"].half().float()
    )
    assert torch.allclose(ours[name].float(), theirs[name], rtol=1e-2, atol=1e-4)


@pytest.mark.parametrize(
    "swap", [dict(), dict(norm_placement="deepnorm"), dict(norm_placement="pre", norm_mapping="reset")]
)
def test_no_calibration_where_no_write_norm_becomes_a_read(tmp_path, swap):
    save_source(tmp_path / "bert", "bert", "Model")
    assert quiet(str(tmp_path / "bert"), str(tmp_path / "out"), **swap)["calibration"] is None


def test_llama_to_post_is_calibrated_out_of_pre_ln(tmp_path):
    save_source(tmp_path / "llama", "llama", "ForCausalLM")
    calibration = quiet(str(tmp_path / "llama"), str(tmp_path / "post"), norm_placement="post")["calibration"]
    assert (
        len(calibration["stream_rms"]) == 2 * 2 + 1 and calibration["refit_errors"] == {}
    )  # tests/test_heal_causal.py
    assert "layers.0.self_attn.q_proj" in calibration["modules"] and "layers.1.mlp.down_proj" in calibration["modules"]


def test_calibration_without_tokenizer_uses_random_tokens(tmp_path):
    save_source(tmp_path / "bert", "bert", "Model", tokenizer=False)
    report = quiet(str(tmp_path / "bert"), str(tmp_path / "pre"), norm_placement="pre")
    assert report["calibration"]["data"] == "704 random token sequences"
    assert all(scale > 0 for scale in report["calibration"]["write_scales"].values())


def test_no_calibrate_on_the_command_line(tmp_path, capsys):
    save_source(tmp_path / "bert", "bert", "Model")
    cli(["convert", str(tmp_path / "bert"), str(tmp_path / "on"), "--norm-placement", "pre"])
    assert "calibrated the writes of 4 sublayers" in capsys.readouterr().out
    cli(["convert", str(tmp_path / "bert"), str(tmp_path / "off"), "--norm-placement", "pre", "--no-calibrate"])
    assert "calibrated" not in capsys.readouterr().out


def test_a_conversion_without_calibration_does_not_load_the_written_model(tmp_path, monkeypatch):
    """With --no-verify, converting keeps about one shard in memory: calibration, needed by no swap here, loads
    nothing."""
    save_source(tmp_path / "bert", "bert", "Model")

    def refuse(*args, **kwargs):
        raise AssertionError("the written model was loaded")

    monkeypatch.setattr(NormSwapModel, "from_pretrained", refuse)
    for swap in (dict(), dict(norm_placement="pre", norm_mapping="reset")):
        report = quiet(str(tmp_path / "bert"), str(tmp_path / f"out-{len(swap)}"), verify=False, **swap)
        assert report["calibration"] is None

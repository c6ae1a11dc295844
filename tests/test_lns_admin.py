"""LayerNorm Scaling (`lns`) and Admin (`admin`): exact conversions, Admin's profiled initialisation, and the
initialisation scheme (`initializer`)."""

import pytest
import torch

from hf_normswap import NormSwapForCausalLM, NormSwapModel, convert_checkpoint, profile_admin
from hf_normswap.cli import main as cli
from hf_normswap.convert import ConversionError

from helpers import padded_batch, save_source, tensors, tiny_config


QUIET = dict(log=lambda line: None)


@pytest.mark.parametrize(("model_type", "suffix"), [("llama", "ForCausalLM"), ("gpt2", "LMHeadModel")])
def test_pre_converts_to_lns_exactly_and_back(tmp_path, model_type, suffix):
    save_source(tmp_path / "source", model_type, suffix, tokenizer=False)
    report = convert_checkpoint(
        str(tmp_path / "source"), str(tmp_path / "lns"), norm_placement="lns", attention="causal", **QUIET
    )
    assert report["swap"]["exact_swap"] == "pre<->lns" and report["exact"] is True
    assert report["swap_distance"]["logits_max_abs_diff"] <= 1e-5
    back = convert_checkpoint(str(tmp_path / "lns"), str(tmp_path / "pre"), norm_placement="pre", **QUIET)
    assert back["swap"]["exact_swap"] == "pre<->lns" and back["exact"] is True
    lns, pre = tensors(tmp_path / "lns"), tensors(tmp_path / "pre")
    for layer in range(2):  # depth l = layer + 1: the input norms' gains carry sqrt(l)
        name = f"model.layers.{layer}.mlp_norms.input_norm.weight"
        torch.testing.assert_close(lns[name], pre[name] * (layer + 1) ** 0.5, rtol=1e-6, atol=0)
    assert all(torch.equal(tensor, lns[name]) for name, tensor in pre.items() if "input_norm" not in name)


def test_lns_divides_each_layers_input_norms_by_the_square_root_of_its_depth():
    torch.manual_seed(0)
    model = NormSwapModel(tiny_config(norm_placement="lns", num_hidden_layers=3)).eval()
    hidden = torch.randn(2, 5, 32)
    for layer, depth in zip(model.layers, (1, 2, 3)):
        for norms in (layer.attention_norms, layer.mlp_norms):
            torch.testing.assert_close(norms.normalize_input(hidden), norms.input_norm(hidden) / depth**0.5)


@pytest.mark.parametrize("model_type", ["bert", "roberta"])
def test_post_converts_to_admin_exactly_with_unit_residual_weights(tmp_path, model_type):
    save_source(tmp_path / "source", model_type, "ForSequenceClassification", tokenizer=False)
    report = convert_checkpoint(str(tmp_path / "source"), str(tmp_path / "admin"), norm_placement="admin", **QUIET)
    assert report["swap"]["exact_swap"] == "post->admin" and report["exact"] is True
    assert report["swap_distance"]["logits_max_abs_diff"] <= 1e-5
    weights = {name: t for name, t in tensors(tmp_path / "admin").items() if name.endswith("residual_weight")}
    assert len(weights) == 2 * 2 and all(torch.equal(t, torch.ones(32)) for t in weights.values())


def test_lns_from_anything_but_pre_is_refused_in_one_line(tmp_path, capsys):
    save_source(tmp_path / "bert", "bert", "Model", tokenizer=False)
    with pytest.raises(ConversionError, match=r"post -> lns is not supported.*convert to 'pre' first"):
        convert_checkpoint(str(tmp_path / "bert"), str(tmp_path / "lns"), norm_placement="lns", **QUIET)
    assert not (tmp_path / "lns").exists()
    capsys.readouterr()
    assert cli(["convert", str(tmp_path / "bert"), str(tmp_path / "lns"), "--norm-placement", "lns"]) == 1
    error = capsys.readouterr().err.strip()
    assert "\n" not in error and "LayerNorm Scaling ('lns') converts exactly from and to 'pre' only" in error


def test_admin_profile_follows_the_definition():
    """w_1 = 1 and w_{i+1} = sqrt(Var[w_i * x_{i-1}] + Var[f_i(x_{i-1})]), over every feature of every token, with
    x_i = N(w_i * x_{i-1} + f_i(x_{i-1})): recomputed here sublayer by sublayer, outside the model."""
    torch.manual_seed(0)
    model = NormSwapModel(tiny_config(norm_placement="admin", num_hidden_layers=3, initializer="xavier"))
    input_ids = torch.randint(1, 99, (3, 7))
    profiled = profile_admin(model, {"input_ids": input_ids})
    with torch.no_grad():
        stream = model.embeddings(input_ids, None, None, torch.arange(7).expand(3, 7))
        weight, expected = 1.0, []
        for layer in model.layers:
            for norms, sublayer in (
                (layer.attention_norms, lambda x: layer.self_attn(x)[0]),
                (layer.mlp_norms, layer.mlp),
            ):
                branch = sublayer(stream)
                expected.append(weight)
                torch.testing.assert_close(norms.residual_weight, torch.full((32,), weight))
                following = ((weight * stream).var(unbiased=False) + branch.var(unbiased=False)).sqrt().item()
                stream, weight = norms.residual_norm(weight * stream + branch), following
    assert profiled == pytest.approx(expected, rel=1e-5)
    assert profiled[0] == 1.0 and profiled[-1] > 1.5  # Xavier's branches are not small: the weights grow with depth


def test_admin_profile_skips_padding_and_restores_training_mode():
    torch.manual_seed(0)
    model = NormSwapForCausalLM(tiny_config(norm_placement="admin", initializer="xavier", is_causal=True))
    input_ids, attention_mask = padded_batch(lengths=(9, 4))
    profiled = profile_admin(model, {"input_ids": input_ids, "attention_mask": attention_mask})
    assert model.training
    torch.manual_seed(0)
    alone = NormSwapForCausalLM(tiny_config(norm_placement="admin", initializer="xavier", is_causal=True))
    garbage = input_ids.masked_fill(attention_mask == 0, 5)  # what padding holds does not count
    assert profile_admin(alone, {"input_ids": garbage, "attention_mask": attention_mask}) == pytest.approx(profiled)


def _xavier_std(linear: torch.nn.Linear) -> float:
    return (2 / sum(linear.weight.shape)) ** 0.5


@pytest.mark.parametrize("placement", ["post", "deepnorm"])
def test_initializer_changes_only_the_attention_and_feed_forward_weights(placement):
    models = {}
    for initializer in ("normal", "xavier"):
        torch.manual_seed(0)
        config = tiny_config(norm_placement=placement, num_hidden_layers=4, initializer=initializer)
        models[initializer] = NormSwapModel(config)
    normal, xavier = (dict(models[name].named_parameters()) for name in ("normal", "xavier"))
    changed = {name for name in normal if not torch.equal(normal[name], xavier[name])}
    assert changed == {f"layers.{i}.{m}.{p}_proj.weight" for i in range(4) for m, p in _projections()}
    beta = models["normal"].config.deepnorm_beta if placement == "deepnorm" else 1.0
    for layer in models["xavier"].layers:
        for module, gain in (
            (layer.self_attn.q_proj, 1.0),
            (layer.self_attn.v_proj, beta),
            (layer.mlp.down_proj, beta),
        ):
            assert module.weight.std().item() == pytest.approx(gain * _xavier_std(module), rel=0.15)
    for layer in models["normal"].layers:  # BERT's: std initializer_range, DeepNorm's scaled by beta
        assert layer.self_attn.q_proj.weight.std().item() == pytest.approx(0.02, rel=0.15)
        assert layer.mlp.down_proj.weight.std().item() == pytest.approx(0.02 * beta, rel=0.15)


def _projections():
    return [("self_attn", name[0]) for name in ("q", "k", "v", "o")] + [("mlp", "up"), ("mlp", "down")]


def test_bad_initializer_is_named():
    with pytest.raises(ValueError, match=r"initializer='kaiming' is invalid: allowed are normal, xavier\.$"):
        tiny_config(initializer="kaiming")


def test_admin_trains_its_residual_weights():
    torch.manual_seed(0)
    model = NormSwapForCausalLM(tiny_config(norm_placement="admin", is_causal=True))
    input_ids, attention_mask = padded_batch()
    loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=input_ids).loss
    loss.backward()
    gradient = model.model.layers[1].mlp_norms.residual_weight.grad
    assert gradient is not None and gradient.abs().sum() > 0
    assert gradient.std() > 0.01 * gradient.abs().mean()  # one weight per feature, not one scalar

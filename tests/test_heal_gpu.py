"""Healing a causal LM on a GPU, one process: the two models are placed there when they load, so that the block-wise
fit, the held-out measurements and the teacher's sampling run there too, not only the Trainer's steps. CI has no GPU,
so these tests are skipped there; on a machine with one: `python -m pytest tests/test_heal_gpu.py`."""

import itertools

import pytest
import torch
from transformers import AutoTokenizer

from hf_normswap import convert_checkpoint, heal_checkpoint
from hf_normswap.convert import load_unswapped
from hf_normswap.heal import HealOptions
from hf_normswap.heal.data import TeacherSamples, groups_at_once, sampled_together
from hf_normswap.heal.models import for_student, load_models
from hf_normswap.heal.options import FITTED_DEFAULTS

from helpers import save_source


pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")

GPU = torch.device("cuda", 0)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tiny pre-LN LLaMA with a tokenizer and its calibrated post-LN conversion."""
    folder = tmp_path_factory.mktemp("causal-gpu")
    save_source(folder / "llama", "llama", "ForCausalLM", initializer_range=0.2)
    convert_checkpoint(
        str(folder / "llama"), str(folder / "post"), norm_placement="post", attention="causal", log=lambda line: None
    )
    return folder


def test_unsharded_models_load_onto_the_gpu(llama):
    options, pair = for_student(str(llama / "post"), HealOptions())
    models = load_models(pair, options)
    assert {parameter.device for parameter in models.student.parameters()} == {GPU}
    assert {parameter.device for parameter in models.teacher.parameters()} == {GPU}


def test_a_gpu_samples_the_texts_a_cpu_samples(llama):
    """The GPU samples 1,024 texts at once, 68 groups of 15 here, from the draws a CPU takes a group at a time: the
    same texts but where the GPU's rounding moves a draw across a token's edge."""
    tokenizer = AutoTokenizer.from_pretrained(llama / "post")
    options = HealOptions(data="teacher", sample_length=10, max_steps=4, batch_size=3)
    texts = {}
    for device in ("cpu", GPU):
        teacher = load_unswapped(str(llama / "llama"), head="causal-lm").to(device)
        stream = TeacherSamples(teacher, start=tokenizer.bos_token_id, pad=0, options=options, states=False)
        texts[device] = [row["input_ids"] for row in itertools.islice(stream.first_readings(), 2 * 1020)]
    assert groups_at_once(teacher, sampled_together(teacher, options)) == 68
    same = sum(cpu == gpu for cpu, gpu in zip(texts["cpu"], texts[GPU], strict=True))
    assert same >= 0.99 * 2 * 1020 and len({tuple(text) for text in texts[GPU]}) == 2 * 1020


def test_a_healing_fits_and_trains_on_the_gpu(llama):
    report = heal_checkpoint(
        str(llama / "post"),
        str(llama / "healed"),
        max_steps=16,
        learning_rate=1e-3,
        batch_size=8,
        eval_size=16,
        log=None,
    )
    reconstruction, next_token = report["reconstruction"], report["next_token"]
    assert reconstruction["steps"] == FITTED_DEFAULTS["reconstruct_steps"] and all(
        after < before for before, after in reconstruction["layer_errors"]
    )
    assert next_token["before"]["kl"] < 0.99 * reconstruction["conversion"]["kl"]  # the fit brought it closer
    losses = [entry["loss"] for entry in report["log_history"] if "loss" in entry]
    assert len(losses) == 16 and losses[-1] < 0.9 * losses[0]  # it trained (on CPU: 0.202 -> 0.129)
    assert 0.0 < next_token["after"]["kl"] < 1.0 and 0.0 <= next_token["after"]["top1_agreement"] <= 1.0

"""The edges users meet first (issue 19): what a model card claims, `generate` without a tokenizer in the folder,
`push` on a Trainer's output, and misspelt experiment keys."""

import json
import re
import shutil
from dataclasses import fields

import pytest
import torch
from datasets import Dataset
from huggingface_hub import ModelCard
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    Trainer,
    TrainingArguments,
)

from hf_normswap import NormSwapForCausalLM, convert_checkpoint
from hf_normswap.cli import main as cli
from hf_normswap.compare.experiment import DEFAULT_EXPERIMENT, Experiment
from hf_normswap.sharding import ShardingOptions, flat_settings
from hf_normswap.sharding.options import SECTION_TITLE

from helpers import llama_tokenizer, save_source, tiny_config


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")


def card_of(folder, tmp_path, capsys, name="up", *extra) -> ModelCard:
    """The model card `push --dry-run` writes for `folder`."""
    arguments = ["push", str(folder), "--repo-id", "me/v", "--dry-run", str(tmp_path / name), "--license", "mit"]
    assert cli([*arguments, "--base-model", "me/bert", *extra]) == 0, capsys.readouterr().err
    return ModelCard.load(tmp_path / name / "README.md")


def one_line_error(capsys, arguments) -> str:
    capsys.readouterr()
    assert cli(arguments) == 1
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1, error
    return error


def body(card: ModelCard) -> str:
    """The card's text without the parts that name the folder."""
    return card.text.split("## How to load")[0]


def test_card_of_an_exact_conversion_with_an_untrained_head(tmp_path, capsys):
    """A BertModel converted with --head masked-lm and nothing swapped: the head is created at random at load, so
    the card says so and reports no figure (two conversions give two different random-head losses)."""
    save_source(tmp_path / "bert", "bert", "Model")
    cards = []
    for name in ("a", "b"):
        convert_checkpoint(str(tmp_path / "bert"), str(tmp_path / name), head="masked-lm", log=lambda _: None)
        cards.append(card_of(tmp_path / name, tmp_path, capsys, f"up-{name}"))
    records = [json.loads((tmp_path / name / "conversion.json").read_text()) for name in ("a", "b")]
    assert records[0]["swap_effect"]["before"] != records[1]["swap_effect"]["before"]  # the random heads differ
    untrained = records[0]["weights"]["initialized_at_load"]
    assert "lm_head.dense.weight" in untrained and "lm_head.decoder.bias" in untrained
    card = cards[0].text
    assert "**The head is untrained.**" in card
    assert all(f"`{name}`" in card for name in untrained)
    assert "Train the head (fine-tune the model) before using its outputs." in card
    assert "- The head is untrained (created at random at load)" in card.split("## Limitations")[1]
    assert "Nothing was swapped" in card
    assert "moved the model" not in card and "masked lm loss" not in card and "before," not in card
    assert "A swapped placement computes something other" not in card  # nothing was swapped
    assert body(cards[0]) == body(cards[1])  # no figure that changes from one conversion to the next


def test_card_of_a_swap_with_an_untrained_head_reports_no_loss(tmp_path, capsys):
    save_source(tmp_path / "bert", "bert", "Model")
    convert_checkpoint(
        str(tmp_path / "bert"), str(tmp_path / "pre"), head="masked-lm", norm_placement="pre", log=lambda _: None
    )
    card = card_of(tmp_path / "pre", tmp_path, capsys).text
    assert "No swap effect is reported: it could only be measured through the untrained head." in card
    assert "moved the model" not in card and "masked lm loss" not in card
    assert "**The head is untrained.**" in card and "A swapped placement computes something other" in card


def test_card_of_a_swap_with_a_pretrained_head_keeps_its_figure(tmp_path, capsys):
    save_source(tmp_path / "bert", "bert", "ForMaskedLM")
    convert_checkpoint(str(tmp_path / "bert"), str(tmp_path / "pre"), norm_placement="pre", log=lambda _: None)
    record = json.loads((tmp_path / "pre" / "conversion.json").read_text())
    effect = record["swap_effect"]
    assert record["weights"]["initialized_at_load"] == [] and effect["after"] != effect["before"]
    card = card_of(tmp_path / "pre", tmp_path, capsys).text
    assert (
        f"The swap moved the model: masked lm loss {effect['before']:.4f} before, {effect['after']:.4f} after." in card
    )
    assert "untrained" not in card


def test_card_of_a_swap_with_an_untrained_classifier_keeps_the_hidden_state_figure(tmp_path, capsys):
    """A classifier head is not what the swap effect measures (the last hidden states' cosine similarity to the
    unswapped model's), so its figure stays, beside the untrained head."""
    save_source(tmp_path / "bert", "bert", "Model")
    convert_checkpoint(
        str(tmp_path / "bert"),
        str(tmp_path / "pre"),
        head="sequence-classification",
        norm_placement="pre",
        log=lambda _: None,
    )
    record = json.loads((tmp_path / "pre" / "conversion.json").read_text())
    effect = record["swap_effect"]
    assert effect["metric"] == "cosine_similarity" and 0.0 < effect["after"] < 0.9999
    assert "classifier.weight" in record["weights"]["initialized_at_load"]
    card = card_of(tmp_path / "pre", tmp_path, capsys).text
    assert (
        "The swap moved the model: mean cosine similarity of the last hidden states to the unswapped model's "
        f"{effect['after']:.4f}." in card
    )
    assert "1.0000 before" not in card and "`classifier.weight`" in card and "**The head is untrained.**" in card


@pytest.fixture
def causal_without_tokenizer(tmp_path):
    """A converted LLaMA with its tokenizer (`with`), the same without it (`without`), and the source (`source`)."""
    save_source(tmp_path / "source", "llama", "ForCausalLM")
    convert_checkpoint(str(tmp_path / "source"), str(tmp_path / "with"), attention="causal", log=lambda _: None)
    shutil.copytree(tmp_path / "with", tmp_path / "without")
    for name in TOKENIZER_FILES:
        (tmp_path / "without" / name).unlink(missing_ok=True)
    return tmp_path


def test_generate_without_a_tokenizer_says_to_pass_one(causal_without_tokenizer, capsys):
    folder = causal_without_tokenizer / "without"
    error = one_line_error(capsys, ["generate", str(folder), "--prompt", "the cat"])
    assert error == (
        f"hf-normswap generate: error: {folder}: no tokenizer files; pass --tokenizer with a folder or Hub id that "
        "has one (e.g. the source's)"
    )
    error = one_line_error(capsys, ["generate", str(folder), "--prompt", "the cat", "--tokenizer", str(folder)])
    assert error == (
        f"hf-normswap generate: error: {folder}: no tokenizer files; give --tokenizer a folder or Hub id that has one"
    )
    assert "Couldn't instantiate" not in error


def test_generate_with_tokenizer_writes_what_the_folder_with_its_tokenizer_writes(causal_without_tokenizer, capsys):
    root, prompt = causal_without_tokenizer, "the cat sat on the"
    options = ["--prompt", prompt, "--max-new-tokens", "6"]
    capsys.readouterr()
    assert cli(["generate", str(root / "without"), *options, "--tokenizer", str(root / "source")]) == 0
    given = capsys.readouterr().out.strip()
    assert cli(["generate", str(root / "with"), *options]) == 0
    assert given == capsys.readouterr().out.strip()
    tokenizer = AutoTokenizer.from_pretrained(root / "source")
    model = AutoModelForCausalLM.from_pretrained(root / "without").eval()
    encoded = tokenizer(prompt, return_tensors="pt")
    tokens = model.generate(**encoded, max_new_tokens=6, do_sample=False)[0, encoded["input_ids"].shape[1] :]
    assert len(tokens) >= 1 and given.startswith(prompt)
    assert given.endswith(tokenizer.decode(tokens, skip_special_tokens=True))


def test_generate_refuses_a_tokenizer_beyond_the_vocabulary(tmp_path, capsys):
    NormSwapForCausalLM(tiny_config(is_causal=True, vocab_size=20)).save_pretrained(tmp_path / "model")
    size = llama_tokenizer(tmp_path / "tokenizer")
    assert size > 20
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "tokenizer")
    first_outside = next(i for i in tokenizer("the fox")["input_ids"] if i >= 20)
    arguments = [
        "generate",
        str(tmp_path / "model"),
        "--prompt",
        "the fox",
        "--tokenizer",
        str(tmp_path / "tokenizer"),
    ]
    error = one_line_error(capsys, arguments)
    assert (
        f"--prompt 'the fox': the tokenizer gives token id {first_outside}, outside the model's vocabulary "
        "(vocab_size 20)" in error
    )


def test_push_of_a_trainer_output_names_what_exists(tmp_path, capsys):
    """A Trainer checkpoint of a NormSwap model has no conversion.json: push says so, not that one names nothing."""
    save_source(tmp_path / "bert", "bert", "ForSequenceClassification")
    convert_checkpoint(str(tmp_path / "bert"), str(tmp_path / "variant"), log=lambda _: None)
    model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "variant")
    generator = torch.Generator().manual_seed(0)
    data = Dataset.from_dict(
        {"input_ids": torch.randint(5, 60, (8, 12), generator=generator).tolist(), "labels": [0, 1] * 4}
    )
    arguments = TrainingArguments(
        str(tmp_path / "trained"),
        max_steps=2,
        save_steps=2,
        per_device_train_batch_size=4,
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
    )
    Trainer(model=model, args=arguments, train_dataset=data).train()
    checkpoint = tmp_path / "trained" / "checkpoint-2"
    assert (checkpoint / "trainer_state.json").exists() and not (checkpoint / "conversion.json").exists()

    push = ["push", str(checkpoint), "--repo-id", "me/x", "--dry-run", str(tmp_path / "up")]
    error = one_line_error(capsys, push)
    assert error == (
        "hf-normswap push: error: model card field 'base_model' is missing: "
        f"{checkpoint} has no conversion.json naming the source; pass --base-model"
    )
    error = one_line_error(capsys, [*push, "--base-model", "me/bert"])
    assert error == (
        "hf-normswap push: error: model card field 'license' is missing: "
        f"{checkpoint} has no conversion.json naming the source's license; pass --license"
    )
    card = card_of(checkpoint, tmp_path, capsys).text
    assert "This checkpoint has no `conversion.json`" in card and "| norm placement | not recorded | post |" in card
    assert "without verification" not in card

    error = one_line_error(capsys, ["push", str(tmp_path / "variant"), "--repo-id", "me/x"])
    assert error.endswith(
        f"{tmp_path / 'variant' / 'conversion.json'} names a local source ({tmp_path / 'bert'}), "
        "not a Hub id; pass --base-model"
    )


@pytest.mark.parametrize(
    "text, message",
    [
        ("variantz: [post, pre]\nseeds: 1\n", "unknown key 'variantz' (did you mean 'variants'?)"),
        (
            "variants: [post]\nsedes: 1\nlearningrate: 1.0e-4\n",
            "unknown keys 'learningrate', 'sedes' (did you mean 'learning_rate' for 'learningrate', 'seeds' for "
            "'sedes'?)",
        ),
        ("variants: [post]\nzzz: 1\n", "unknown key 'zzz' (see hf-normswap compare --help)"),
        ("aaa: 1\nbbb: 2\nccc: 3\nddd: 4\neee: 5\n", "unknown keys 'aaa', 'bbb', 'ccc' and 2 more (see hf-normswap"),
        ("variants: [pre+heal]\nheal: {steps: 3}\n", "heal: unknown settings ['steps'] (did you mean 'max_steps'?)"),
        ("variants: [pre+heal]\nheal: {zzz: 3}\n", "heal: unknown settings ['zzz'] (see hf-normswap compare --help)"),
    ],
)
def test_unknown_experiment_keys_name_the_nearest(tmp_path, monkeypatch, capsys, text, message):
    """As a user runs it: `hf-normswap compare --config experiment.yaml` in the experiment's folder."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "experiment.yaml").write_text(text)
    error = one_line_error(capsys, ["compare", "--config", "experiment.yaml", "--output", "out"])
    assert error.startswith(f"hf-normswap compare: error: experiment file experiment.yaml: {message}"), error
    assert len(error) < 200, len(error)
    assert not (tmp_path / "out").exists()


def test_unknown_experiment_key_with_a_long_path_stays_short(tmp_path, capsys):
    (tmp_path / "experiment.yaml").write_text("variantz: [post, pre]\n")
    error = one_line_error(capsys, ["compare", "--config", str(tmp_path / "experiment.yaml")])
    assert error == (
        f"hf-normswap compare: error: experiment file {tmp_path / 'experiment.yaml'}: unknown key 'variantz' "
        "(did you mean 'variants'?)"
    )
    assert len(error) - len(str(tmp_path)) < 120  # under 200 for paths up to 80 characters


def test_unknown_heal_setting_on_the_command_line_lists_the_allowed(tmp_path, capsys):
    save_source(tmp_path / "bert", "bert", "Model")
    arguments = ["compare", "--model", str(tmp_path / "bert"), "--variants", "pre+heal", "--output", str(tmp_path)]
    error = one_line_error(capsys, [*arguments, "--heal", "{zzz: 3}"])
    assert error.startswith("hf-normswap compare: error: heal: unknown settings ['zzz'] (allowed: data text_column")
    allowed = error.partition("(allowed: ")[2].rstrip(")").split()
    assert "reconstruct_learning_rate" in allowed and "dtype" in allowed and "teacher" not in allowed  # compare's own
    error = one_line_error(capsys, [*arguments, "--heal", "{learning_rat: 1.0e-4}"])
    assert error == (
        "hf-normswap compare: error: heal: unknown settings ['learning_rat'] (did you mean 'learning_rate'?)"
    )


@pytest.mark.parametrize("command", ["convert", "heal", "compare"])
def test_help_shows_each_default_once_choices_and_the_sharding_section_last(command, capsys):
    capsys.readouterr()
    with pytest.raises(SystemExit):
        cli([command, "--help"])
    text = capsys.readouterr().out
    options, _, section = text.split("options:", 1)[1].partition(SECTION_TITLE + ":")
    for entry in re.split(r"\n  (?=--)", options + section):
        assert entry.count("default:") <= 1, entry
    if command == "convert":
        assert not section
        return
    assert all(f"--{flag}" in section for flag in ("fsdp,", "fsdp-config", "bf16,", "activation-checkpointing,"))
    assert "--fsdp" not in options and "--bf16" not in options
    closed = {"heal": ["--objective {hidden,cka,similarity,mlm,kl}", "--dtype {float32,bfloat16}"]}
    closed["compare"] = ["--norm-mapping {shift,keep,reset}", "--attention {bidirectional,causal}"]
    assert all(choices in options for choices in closed[command]), options
    if command == "compare":  # the embedded experiment's default, then the one --model takes where it differs
        embedded, own = Experiment.from_file(DEFAULT_EXPERIMENT), {f.name: f.default for f in fields(Experiment)}
        assert embedded.seeds != own["seeds"] and embedded.max_length == own["max_length"]
        flat = " ".join(options.split())
        assert f"(default: {embedded.seeds}; with --model: {own['seeds']})" in flat
        assert f"(default: {embedded.max_length})" in flat


@pytest.mark.parametrize(
    "text, message",
    [
        ("variants: [post]\nsharding: {fsdpp: true}\n", "sharding: unknown settings ['fsdpp'] (allowed: fsdp, "),
        ("variants: [post]\nsharding: yes\n", "sharding=True is invalid: a mapping of fsdp, fsdp_config, bf16, "),
    ],
)
def test_a_bad_sharding_section_in_an_experiment_file_gets_one_line(tmp_path, capsys, text, message):
    (tmp_path / "experiment.yaml").write_text(text)
    error = one_line_error(capsys, ["compare", "--config", str(tmp_path / "experiment.yaml")])
    assert error.startswith(f"hf-normswap compare: error: {message}"), error


def test_sharding_settings_read_flat_or_as_a_section_alike(tmp_path):
    """An experiment file may name the sharding settings flat (as the command line does) or in their section; the
    command line's flat setting overrides the file's section."""
    (tmp_path / "flat.yaml").write_text("variants: [post]\nbf16: true\nactivation_checkpointing: true\n")
    (tmp_path / "section.yaml").write_text(
        "variants: [post]\nsharding: {bf16: true, activation_checkpointing: true}\n"
    )
    flat, section = (Experiment.from_file(str(tmp_path / f"{name}.yaml")) for name in ("flat", "section"))
    assert flat == section and flat.sharding == ShardingOptions(bf16=True, activation_checkpointing=True)
    assert flat_settings(flat)["bf16"] is True and "sharding" not in flat_settings(flat)
    overridden = Experiment.from_file(str(tmp_path / "section.yaml"), bf16=False)
    assert overridden.sharding == ShardingOptions(bf16=False, activation_checkpointing=True)

"""`heal --plan` and `compare --plan`: the memory plan of a real run's models, printed before any weight loads."""

import json

from transformers import BertForSequenceClassification

from hf_normswap import convert_checkpoint
from hf_normswap.cli import main
from hf_normswap.compare.experiment import Experiment
from hf_normswap.compare.plan import comparison_plan
from hf_normswap.convert import load_unswapped
from hf_normswap.heal.options import HealOptions
from hf_normswap.heal.plan import heal_plan
from hf_normswap.sharding import ShardingOptions, describe_plan

from helpers import save_source


def variant_without_weights(tmp_path):
    """A LLaMA causal LM converted to post-LN, then every weight file of it and of its source deleted."""
    source = save_source(tmp_path / "source", "llama", "ForCausalLM", tie_word_embeddings=False)
    convert_checkpoint(
        str(tmp_path / "source"),
        str(tmp_path / "post"),
        norm_placement="post",
        attention="causal",
        log=lambda line: None,
    )
    for file in [*tmp_path.glob("source/*.safetensors"), *tmp_path.glob("post/*.safetensors")]:
        file.unlink()
    return source


def test_heal_plan_counts_the_student_and_its_teacher_without_loading_them(tmp_path, capsys):
    source = variant_without_weights(tmp_path)
    parameters = sum(parameter.numel() for parameter in source.parameters())
    hidden = source.config.hidden_size
    embeddings = source.get_input_embeddings().weight.numel() + hidden  # and the embedding norm post-LN adds there
    plan = heal_plan(str(tmp_path / "post"), HealOptions(sharding=ShardingOptions(fsdp=True)), processes=2)
    assert plan.parameters == parameters  # NormSwap holds what the source holds
    assert plan.trainable_parameters == parameters - embeddings  # heal keeps the embeddings module frozen
    assert plan.optimizer_states == 2 * plan.gradients
    # the teacher (the source with its causal-LM head) in float32, half of every first dimension per process
    teacher = sum(-(-p.shape[0] // 2) * (p.numel() // p.shape[0]) if p.dim() else 1 for p in source.parameters())
    assert plan.teacher == 4 * teacher

    assert main(["heal", str(tmp_path / "post"), str(tmp_path / "out"), "--plan", "--processes", "2", "--fsdp"]) == 0
    assert capsys.readouterr().out.strip() == describe_plan(plan)
    assert not (tmp_path / "out").exists()
    assert main(["heal", str(tmp_path / "post"), str(tmp_path / "out"), "--processes", "2"]) == 1  # nothing to plan
    assert capsys.readouterr().err.strip() == (
        "hf-normswap heal: error: --processes 2 is invalid without --plan: a launch runs its own processes"
    )
    assert not (tmp_path / "out").exists()
    save_source(tmp_path / "wide", "llama", "ForCausalLM", hidden_size=64)
    plan = ["heal", str(tmp_path / "post"), str(tmp_path / "out"), "--plan", "--teacher", str(tmp_path / "wide")]
    assert main(plan) == 1
    assert capsys.readouterr().err.strip() == (
        f"hf-normswap heal: error: teacher {tmp_path / 'wide'}: hidden_size 64 differs from the student's {hidden}"
    )


def test_heal_plan_of_one_process_is_not_sharded_and_counts_lora_norms_only(tmp_path):
    variant_without_weights(tmp_path)
    one = heal_plan(str(tmp_path / "post"), HealOptions(sharding=ShardingOptions(fsdp=True)), processes=1)
    lora = heal_plan(str(tmp_path / "post"), HealOptions(lora=True), processes=1)
    assert not one.sharded and one.processes == 1
    norms = json.loads((tmp_path / "post" / "config.json").read_text())["hidden_size"] * 2 * 2
    assert lora.trainable_parameters == norms  # 2 layers x 2 norms (the embedding norm stays frozen)


def test_heal_plan_counts_the_teacher_as_healing_loads_it(tmp_path):
    """Student and teacher sharing a head that is not a language model's: the teacher runs (and is counted) without
    it."""
    save_source(tmp_path / "source", "bert", "ForSequenceClassification")
    convert_checkpoint(str(tmp_path / "source"), str(tmp_path / "pre"), norm_placement="pre", log=lambda line: None)
    teacher = load_unswapped(str(tmp_path / "source"), head="base")
    classifier = load_unswapped(str(tmp_path / "source"), head="sequence-classification")
    plan = heal_plan(str(tmp_path / "pre"), HealOptions(), processes=1)
    assert plan.teacher == 4 * sum(p.numel() for p in teacher.parameters())  # float32, whole
    assert plan.teacher < 4 * sum(p.numel() for p in classifier.parameters())


def test_compare_plan_reads_the_experiments_model(tmp_path, capsys):
    source = save_source(tmp_path / "bert", "bert", "Model")
    classifier = BertForSequenceClassification(source.config)  # what the comparison fine-tunes: 2 labels
    plan = comparison_plan(
        Experiment(model=str(tmp_path / "bert"), sharding=ShardingOptions(fsdp=True, bf16=True)), processes=4
    )
    assert plan.parameters == plan.trainable_parameters == classifier.num_parameters()
    assert plan.sharded and plan.bf16 and plan.teacher == 0
    assert main(["compare", "--model", str(tmp_path / "bert"), "--plan", "--processes", "4", "--fsdp", "--bf16"]) == 0
    assert capsys.readouterr().out.strip() == describe_plan(plan)
    assert main(["compare", "--model", str(tmp_path / "bert"), "--plan", "--seeds", "0"]) == 1  # checked as a run is
    assert capsys.readouterr().err.strip() == "hf-normswap compare: error: seeds=0 is invalid: at least 1"

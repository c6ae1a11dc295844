"""The memory plan against hand counts on tiny configurations: weights, gradients, AdamW states, compute copies and
the teacher, replicated and sharded (padded as FSDP2 pads), in float32 and with bfloat16."""

from dataclasses import replace

import pytest
from transformers import LlamaConfig

from hf_normswap.sharding.memory_plan import GIB, describe_plan, plan_memory

from helpers import LLAMA_LIKE, tiny_config


SHAPE = dict(vocab_size=99, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
# Hand counts of the tiny LLaMA-like causal LM (head tied to the embeddings, no biases, no token types):
EMBEDDINGS = 99 * 32
LAYER = 32 * 32 + 16 * 32 + 16 * 32 + 32 * 32 + 32 + 3 * 64 * 32 + 32  # q, k, v, o, norm, gate, up, down, norm
PARAMETERS = EMBEDDINGS + 2 * LAYER + 32  # and the final norm
# One of 5 processes' shards, each first dimension padded to a multiple of 5 (99 -> 100, 32 -> 35, 16 -> 20, 64 -> 65):
SHARD = 20 * 32 + 2 * (7 * 32 + 4 * 32 + 4 * 32 + 7 * 32 + 7 + 13 * 32 + 13 * 32 + 7 * 64 + 7) + 7


def llama_like():
    return tiny_config(**SHAPE, **LLAMA_LIKE, type_vocab_size=0, is_causal=True, architectures=["NormSwapForCausalLM"])


def test_replicated_float32_counts_every_parameter_once():
    plan = plan_memory(llama_like(), processes=4, sharded=False)
    assert (plan.parameters, plan.trainable_parameters) == (PARAMETERS, PARAMETERS) == (21760, 21760)
    assert (plan.student, plan.gradients, plan.optimizer_states) == (4 * PARAMETERS, 4 * PARAMETERS, 8 * PARAMETERS)
    assert (plan.compute_weights, plan.teacher) == (0, 0)
    assert plan.total == 16 * PARAMETERS


def test_sharding_divides_with_fsdp2_padding():
    plan = plan_memory(llama_like(), processes=5, sharded=True)
    assert SHARD == 4643
    assert (plan.student, plan.gradients, plan.optimizer_states) == (4 * SHARD, 4 * SHARD, 8 * SHARD)
    # gathered while computing: the root (embeddings, final norm; the tied head) and two layers
    assert plan.compute_weights == 4 * (EMBEDDINGS + 32 + 2 * LAYER)
    assert plan.total == 16 * SHARD + plan.compute_weights
    assert plan_memory(llama_like(), processes=1, sharded=True).student == 4 * PARAMETERS


def test_bf16_compute_copies():
    replicated = plan_memory(llama_like(), processes=2, sharded=False, bf16=True)
    assert replicated.student == 4 * PARAMETERS  # float32 weights, computed with in bfloat16
    assert replicated.compute_weights == 2 * PARAMETERS
    sharded = plan_memory(llama_like(), processes=5, sharded=True, bf16=True)
    assert sharded.student == 4 * SHARD
    assert sharded.compute_weights == 2 * (EMBEDDINGS + 32 + 2 * LAYER)


def test_frozen_parameters_in_dtype_trainable_in_float32():
    trainable = lambda name: ".embeddings." not in name  # noqa: E731
    plan = plan_memory(llama_like(), processes=1, sharded=False, dtype="bfloat16", bf16=True, trainable=trainable)
    learning = PARAMETERS - EMBEDDINGS
    assert plan.trainable_parameters == learning
    assert plan.student == 2 * EMBEDDINGS + 4 * learning
    assert (plan.gradients, plan.optimizer_states) == (4 * learning, 8 * learning)
    assert plan.compute_weights == 2 * learning  # only the float32 weights are cast
    assert plan.total == 2 * EMBEDDINGS + 18 * learning


def test_teacher_from_transformers_or_normswap_config():
    teacher = LlamaConfig(**SHAPE, num_key_value_heads=2, tie_word_embeddings=True, architectures=["LlamaForCausalLM"])
    plan = plan_memory(llama_like(), processes=5, sharded=True, teacher_config=teacher)
    assert plan.teacher == 4 * SHARD
    plan = plan_memory(llama_like(), processes=5, sharded=False, dtype="bfloat16", teacher_config=llama_like())
    assert plan.teacher == 2 * PARAMETERS
    assert plan.total == 16 * PARAMETERS + 2 * PARAMETERS


def test_bert_shaped_base_model():
    config = tiny_config()  # post-LN, absolute positions, two token types, biases, a base model
    embeddings = 99 * 32 + 64 * 32 + 2 * 32 + 2 * 32
    layer = 4 * (32 * 32 + 32) + 2 * 32 + (64 * 32 + 64) + (32 * 64 + 32) + 2 * 32
    assert plan_memory(config, processes=1, sharded=False).parameters == embeddings + 2 * layer


def test_describe_plan():
    plan = replace(
        plan_memory(llama_like(), processes=5, sharded=True, bf16=True), student=3 * GIB, total=5 * GIB // 4
    )
    text = describe_plan(plan).splitlines()
    assert (
        text[0]
        == "memory per process, 5 processes sharded (FSDP2), bfloat16 mixed precision; activations not estimated"
    )
    assert text[1] == f"student: {PARAMETERS:,} parameters, {PARAMETERS:,} trainable"
    assert text[2].split() == ["student", "weights", "3.00", "GiB"]
    assert text[-1].split() == ["total", "1.25", "GiB"]
    replicated = describe_plan(plan_memory(llama_like(), processes=1, sharded=False))
    assert replicated.startswith("memory per process, 1 process replicated, no mixed precision;")


@pytest.mark.parametrize(
    "keywords, message",
    [
        ({"processes": 0, "sharded": True}, "processes=0 is invalid"),
        ({"processes": 2, "sharded": True, "dtype": "float16"}, "dtype='float16' is invalid"),
    ],
)
def test_bad_input(keywords, message):
    with pytest.raises(ValueError, match=message):
        plan_memory(llama_like(), **keywords)

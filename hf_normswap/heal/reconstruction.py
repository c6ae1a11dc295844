"""Block-wise reconstruction out of pre-LN: before healing, each layer of the student is fitted in turn, on its own
inputs, to the teacher's stream after that layer as the student's norms would hold it (where its norms write the
stream, normalised per token, after the last layer the teacher's final norm; where they sit on the branch, as it is),
each token's error relative to its target's mean square, a few optimiser steps a layer on a few hundred texts (compare
the block reconstruction that recovers quantised LLMs from 128 calibration sequences).

Post-LN cannot carry each token's stream RMS, which divides the source's writes (`convert.stream_calibration`); a
layer fitted on the stream it will see learns what of that it can from the token's normalised state. Fitting on the
student's own inputs (the layers before it already fitted) rather than the teacher's lets each layer repair what the
earlier ones left; and a batch of texts one token long shows the layers the first position, which attends to itself
alone, for many more tokens than the texts begin with: measured, docs/experiments/healing.md.
"""

import itertools

import torch
from torch import nn
from transformers import DataCollatorWithPadding

from ..model.configuration_normswap import NORM_PLACEMENTS
from ..model.evaluation_mode import evaluation_mode
from ..probes.probe_data import on_device
from ..probes.stream_mix import normalised
from .data import SampledTexts, TeacherSamples
from .options import RECONSTRUCTION_BATCH_SIZE, HealError, HealOptions


FIRST_POSITION_TOKENS = 1024  # the most texts of one token a fit adds to its texts (one batch)


class _LayerInputs(Exception):
    """Raised by a hook to stop a forward at the first layer, its inputs captured."""


def _first_layer_inputs(model: nn.Module, batch: dict) -> tuple[torch.Tensor, dict]:
    """The stream entering `model`'s first layer on `batch`, and the keywords each of its layers is called with."""
    captured = {}

    def capture(layer, args, kwargs):
        captured.update(kwargs, hidden_states=args[0] if args else kwargs.pop("hidden_states"))
        raise _LayerInputs

    hook = model.base_model.layers[0].register_forward_pre_hook(capture, with_kwargs=True)
    try:
        model.base_model(**on_device(batch, model, ("input_ids", "attention_mask")), use_cache=False)
    except _LayerInputs:
        pass
    finally:
        hook.remove()
    return captured.pop("hidden_states"), captured


def _error(states: torch.Tensor, target: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """The mean squared difference per feature over the real tokens, each relative to the target's mean square."""
    target = target[real].float()
    return ((states[real].float() - target).pow(2).mean(-1) / target.pow(2).mean(-1).clamp_min(1e-12)).mean()


class _Stream:
    """One batch's stream through a model, layer after layer: the states entering the next layer, its keywords, and
    which tokens are real."""

    def __init__(self, model: nn.Module, batch: dict):
        self.states, self.keywords = _first_layer_inputs(model, batch)
        self.real = batch["attention_mask"].bool().to(self.states.device)

    def through(self, layer: nn.Module) -> torch.Tensor:
        return layer(self.states, **self.keywords)


def _fit_layer(
    layer: nn.Module, inputs: list[_Stream], targets: list[torch.Tensor], steps: int, learning_rate: float
) -> list[float]:
    """Fits all of `layer`'s weights by Adam at `learning_rate` so that on each of `inputs` it gives the `targets`,
    cycling through them for `steps` steps; leaves the layer's outputs as the streams' states; returns the mean error
    before and after."""
    weights, pairs = list(layer.parameters()), list(zip(inputs, targets))
    trained = [weight.requires_grad for weight in weights]
    with torch.no_grad():
        before = sum(_error(stream.through(layer), target, stream.real).item() for stream, target in pairs)
    optimizer = torch.optim.Adam(weights, lr=learning_rate)
    try:
        for weight in weights:
            weight.requires_grad_(True)
        for stream, target in itertools.islice(itertools.cycle(pairs), steps):
            loss = _error(stream.through(layer), target, stream.real)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
    finally:
        optimizer.zero_grad(set_to_none=True)
        for weight, was_trained in zip(weights, trained):
            weight.requires_grad_(was_trained)
    after = 0.0
    with torch.no_grad():
        for stream, target in pairs:
            stream.states = stream.through(layer)
            after += _error(stream.states, target, stream.real).item()
    return [before / len(inputs), after / len(inputs)]


def reconstruct_layers(
    student: nn.Module, teacher: nn.Module, batches: list[dict], steps: int, learning_rate: float
) -> list[list[float]]:
    """Fits the student's layers one after another (module docstring), `steps` Adam steps a layer at `learning_rate`
    over `batches`; returns each layer's mean squared error per feature to its target, before and after its fit."""
    config, errors = student.config, []
    centred = config.norm_type == "layernorm"
    with evaluation_mode(student), evaluation_mode(teacher), torch.no_grad():
        inputs = [_Stream(student, batch) for batch in batches]
        sources = [_Stream(teacher, batch) for batch in batches]
    layers = zip(student.base_model.layers, teacher.base_model.layers, strict=True)
    for index, (layer, source_layer) in enumerate(layers):
        last = index == config.num_hidden_layers - 1
        writes = "residual_norm" in NORM_PLACEMENTS[config.layer_norm_placements[index]]
        with evaluation_mode(teacher), torch.no_grad():
            targets = []
            for source, stream in zip(sources, inputs):
                source.states = target = source.through(source_layer)
                if writes:
                    target = teacher.base_model.norm(target) if last else normalised(target, centred, config.norm_eps)
                targets.append(target.to(stream.states.device))
        with evaluation_mode(student):
            errors.append(_fit_layer(layer, inputs, targets, steps, learning_rate))
    return errors


def reconstruction_batches(train, tokenizer, options: HealOptions) -> list[dict]:
    """The first `reconstruct_sequences` texts of the healing's training text (of a stream that reads texts again,
    their first readings), padded in batches of `RECONSTRUCTION_BATCH_SIZE`, then `first_position_batch` of them."""
    texts = train.first_readings() if isinstance(train, TeacherSamples | SampledTexts) else iter(train)
    rows = list(itertools.islice(texts, options.reconstruct_sequences))
    if len(rows) < options.reconstruct_sequences:
        raise HealError(
            f"reconstruct_sequences={options.reconstruct_sequences} is invalid: the training text holds "
            f"{len(rows)} texts: give at most that, or reconstruct_steps=0 (no fit)"
        )
    pad = DataCollatorWithPadding(tokenizer)
    keys = ("input_ids", "attention_mask")
    batches = [
        dict(pad([{key: row[key] for key in keys} for row in rows[start : start + RECONSTRUCTION_BATCH_SIZE]]))
        for start in range(0, len(rows), RECONSTRUCTION_BATCH_SIZE)
    ]
    return batches + [first_position_batch(batches)]


def first_position_batch(batches: list[dict]) -> dict:
    """Texts of one token each: up to `FIRST_POSITION_TOKENS` of the distinct real tokens of `batches`, drawn by a
    seeded permutation. At the first position a token attends to itself alone, so its states depend on the token
    only; fitted on the few tokens that texts begin with, the layers overfit them (docs/experiments/healing.md)."""
    tokens = torch.cat([batch["input_ids"][batch["attention_mask"].bool()] for batch in batches]).unique()
    drawn = tokens[torch.randperm(len(tokens), generator=torch.Generator().manual_seed(0))[:FIRST_POSITION_TOKENS]]
    return {"input_ids": drawn[:, None], "attention_mask": torch.ones(len(drawn), 1, dtype=torch.long)}

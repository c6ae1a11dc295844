"""What each variant starts from (a converted or healed folder, the native checkpoint, or a configuration), and its
model built from there with the seed's classification head."""

import dataclasses
import zlib
from pathlib import Path

import torch
from accelerate import init_empty_weights
from huggingface_hub.errors import StrictDataclassError
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

from ..convert import convert_checkpoint
from ..convert.converter import ConversionRecord
from ..convert.families import family_of
from ..heal import heal_checkpoint
from ..heal.report import HealReport
from ..model.admin import profile_admin
from ..model.configuration_normswap import NormSwapConfig, mix_ln_placement
from ..model.heads import head_of_config
from ..model.modeling_normswap import NormSwapForCausalLM, NormSwapForSequenceClassification
from ..sharding import resumable
from ..tasks import Task
from .experiment import Experiment, Variant


HEAL_SUMMARY = (  # what a comparison keeps of a healing's heal.json, beside its first and last measurements
    "objective",
    "steps",
    "learning_rate",
    "batch_size",
    "packing",
    "dropout",
    "freeze_embeddings",
    "swap_schedule",
    "seconds",
    "resumed",
    "teacher_collapse",
    "next_token",  # a causal LM's next-token KL and agreements before and after; None for other heads
    "reconstruction",  # the layers' fit before healing, the conversion's figures before it; None without one
)


@dataclasses.dataclass(frozen=True)
class Start:
    """What a variant starts from: a checkpoint folder (converted, healed, or the native source), or a NormSwap
    configuration to initialise at random."""

    kind: str  # "converted", "native" or "config"
    path: str | None = None  # the checkpoint folder or Hub id
    config: dict | None = None  # for "config": the NormSwap configuration
    heal: dict | None = None  # for a healed variant: what its healing did (`HEAL_SUMMARY`)


def prepare_variant(
    model: str, variant: Variant, from_config: bool, task: Task | None, experiment: Experiment, output: Path
) -> Start:
    """Where `variant` of `model` starts from; a conversion or healing is written once into OUTPUT/variants."""
    if variant.heal:
        return _healed(model=model, variant=variant, task=task, experiment=experiment, output=output)
    if variant.native:
        return Start(kind="native", path=model)
    source_config = _read_config(model, from_config)
    placement = variant.placement
    if placement == "mix_ln":
        placement = mix_ln_placement(source_config.num_hidden_layers)
    if from_config:
        return _configured(source_config, placement, variant, task, experiment)
    folder = output / "variants" / variant.start_folder
    attention = _attention(experiment, source_config)
    head = _head(experiment, source_config, attention)
    return _converted(model, placement, variant, experiment, attention, head, folder)


def _attention(experiment: Experiment, source_config) -> str:
    """The attention conversions are written with: the experiment's, else bidirectional (a NormSwap source: its
    own)."""
    if experiment.conversion_attention is not None:
        return experiment.conversion_attention
    return "causal" if isinstance(source_config, NormSwapConfig) and source_config.is_causal else "bidirectional"


def _head(experiment: Experiment, source_config, attention: str) -> str:
    """The head conversions write: a causal LM's own under causal attention (healed as a language model; fine-tuning
    loads it as a sequence classifier), else the task's."""
    if experiment.task_type == "causal-lm":
        return "causal-lm"
    if attention == "causal" and head_of_config(source_config) == "causal-lm":
        return "causal-lm"
    return "sequence-classification"


def _converted(
    model: str, placement, variant: Variant, experiment: Experiment, attention: str, head: str, folder: Path
) -> Start:
    """`model` converted to the variant's placement and position with `head`, once per output folder, as `convert`
    does."""
    if not (folder / ConversionRecord.FILE).exists():
        convert_checkpoint(
            source=model,
            output=str(folder),
            norm_placement=placement,
            position_embedding_type=variant.position,
            norm_mapping=experiment.norm_mapping,
            calibrate=experiment.calibrate,
            attention=attention,
            head=head,
            overwrite=True,
            allow_pickle=experiment.allow_pickle,
            log=lambda line: None,
        )
    return Start(kind="converted", path=str(folder))


def _read_config(model: str, from_config: bool):
    try:
        return NormSwapConfig.from_json_file(model) if from_config else AutoConfig.from_pretrained(model)
    except (OSError, ValueError, StrictDataclassError) as error:
        raise ValueError(f"{model}: not a readable configuration ({str(error).splitlines()[0]})") from None


def _configured(source: NormSwapConfig, placement, variant: Variant, task: Task, experiment: Experiment) -> Start:
    """A configuration with the variant's placement, position, initializer and attention, and the task's head."""
    fields = source.to_dict()
    if placement:
        fields.update(norm_placement=placement, embedding_norm=None, final_norm=None, final_scale=None)
    if variant.position:
        fields.update(position_embedding_type=variant.position)
    if variant.initializer:
        fields.update(initializer=variant.initializer)
    fields = {k: v for k, v in fields.items() if k not in ("id2label", "label2id")}
    if experiment.conversion_attention:
        fields.update(is_causal=experiment.conversion_attention == "causal")
    if experiment.task_type != "causal-lm":
        fields.update(num_labels=task.num_labels)
    return Start(kind="config", config=NormSwapConfig.from_dict(fields).to_dict())


def _healed(model: str, variant: Variant, task: Task, experiment: Experiment, output: Path) -> Start:
    """The converted variant healed once per output folder and shared by every seed; an interrupted healing resumes
    from its last checkpoint."""
    converted = prepare_variant(
        model=model, variant=variant.converted, from_config=False, task=task, experiment=experiment, output=output
    )
    folder = output / "variants" / variant.start_folder
    if not (folder / HealReport.FILE).exists():
        resumable_healing = resumable(experiment.sharding)
        heal_checkpoint(
            variant=converted.path,
            output=str(folder),
            teacher=model,
            checkpoint_dir=str(output / "healing" / variant.start_folder) if resumable_healing else None,
            overwrite=True,
            log=None,
            **{"packing": experiment.packing, **(experiment.heal or {}), "sharding": experiment.sharding},
        )
    report = HealReport.read(folder)
    recorded = report.to_dict()  # a heal.json of an older version lacks some: None
    summary = {key: recorded[key] for key in HEAL_SUMMARY}
    summary.update(before=report.before[-1], after=report.after[-1], data=report.data.name)
    return Start(kind="converted", path=str(folder), heal=summary)


def build_model(start: Start, seed: int, num_labels: int, causal: bool, empty: bool = False) -> torch.nn.Module:
    """The variant's model; a classification head is initialised from `seed` alone, the same for every variant. With
    `empty`, a checkpoint's model is built without reading it (its parameters on the meta device, its buffers built),
    for sharding to hand it the main process's weights."""
    torch.manual_seed(seed)  # whatever the checkpoint lacks (pooler, head), or all of a config's weights
    if start.kind == "config":
        config = NormSwapConfig.from_dict(start.config)
        return NormSwapForCausalLM(config) if causal else NormSwapForSequenceClassification(config)
    if empty:
        config = AutoConfig.from_pretrained(start.path, **({} if causal else {"num_labels": num_labels}))
        with init_empty_weights(include_buffers=False):
            return (AutoModelForCausalLM if causal else AutoModelForSequenceClassification).from_config(config)
    if causal:
        return AutoModelForCausalLM.from_pretrained(start.path)
    model, loading = AutoModelForSequenceClassification.from_pretrained(
        start.path, num_labels=num_labels, ignore_mismatched_sizes=True, output_loading_info=True
    )
    fresh = set(loading["missing_keys"]) | {name for name, *_ in loading["mismatched_keys"]}
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            role = _role(model, name)
            if name in fresh or (isinstance(role, str) and role.startswith("classifier.")):
                parameter.copy_(_head_start(role, parameter.shape, seed, model.config.initializer_range))
    return model


def profile_admin_start(start: Start, model: torch.nn.Module, batch: dict) -> list[float] | None:
    """Admin's profiled initialisation (Liu et al. 2020) of a model initialised from a configuration, on `batch`:
    the residual weights set, in forward order; None for a checkpoint or a model without Admin layers."""
    if start.kind != "config" or "admin" not in model.config.layer_norm_placements:
        return None
    return profile_admin(model, batch)


def _role(model, name: str):
    """The NormSwap name of a parameter of a NormSwap or native sequence classifier (a tuple for a fused one)."""
    if isinstance(model.config, NormSwapConfig):
        return name
    return family_of(model.config).rename(name, head="sequence-classification")


def _head_start(role: str, shape, seed: int, std: float) -> torch.Tensor:
    """The starting value of a classification-head tensor (or any other the checkpoint lacks), named by its NormSwap
    name so that every variant gets the same: biases 0, norm weights 1, other weights normal(0, std) from the seed."""
    if role.endswith("bias"):
        return torch.zeros(shape)
    if "norm" in role:
        return torch.ones(shape)
    offset = 0 if role == "classifier.weight" else zlib.crc32(role.encode())
    generator = torch.Generator().manual_seed(seed + offset)
    return torch.randn(shape, generator=generator) * std

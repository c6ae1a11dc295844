"""What a conversion will do, decided from the source's configuration and the options before any weight is read."""

from dataclasses import dataclass
from pathlib import Path

from transformers import AutoConfig, PreTrainedConfig

from ..checkpoint import resolve_source, weight_files
from ..model.configuration_normswap import NormSwapConfig
from ..model.heads import HEAD_CLASSES
from ..model.modeling_normswap import AUTO_MAP
from .branch_calibration import branch_calibration_blockers
from .exact_swaps import plan_exact_swap
from .families import NORMSWAP, Family, family_of, normswap_config
from .norm_mapping import map_norms
from .norm_weight_folding import check_foldable
from .options import ConversionError, ConvertOptions
from .stream_calibration import pre_ln_source


@dataclass
class ConversionPlan:
    """The source, the unswapped (`plain`) and target configurations, and how the weights go from one to the other."""

    source: str  # as given: a folder or a Hub id
    folder: Path
    revision: str | None
    files: list[Path]
    family: Family
    source_config: PreTrainedConfig
    architecture: str
    head: str
    attention: str
    plain: NormSwapConfig
    target: NormSwapConfig
    norm_sources: dict[str, str | None]  # target norm -> the source norm whose weights it takes (None: identity)
    exact_swap: str | None
    dtype: str | None


def plan_conversion(*, source: str, options: ConvertOptions) -> ConversionPlan:
    """Reads SOURCE's configuration (downloading it if it is a Hub id) and decides the conversion `options` ask for."""
    folder, revision = resolve_source(source=source, allow_pickle=options.allow_pickle)
    source_config, family = _read_config(folder, options.family)
    files = weight_files(folder=folder, allow_pickle=options.allow_pickle)
    attention = options.attention
    if attention is None:  # the source's own
        causal = source_config.is_causal if family is NORMSWAP else family.causal
        attention = "causal" if causal else "bidirectional"
    # A config without `architectures` is taken as the base model ("BertConfig" -> "BertModel").
    architecture = (source_config.architectures or [type(source_config).__name__.removesuffix("Config") + "Model"])[0]
    head = _head(options.head, family.head_of(architecture), family, attention)
    plain = normswap_config(source_config)
    swaps = _swaps(plain, options, attention)
    target = normswap_config(source_config, **swaps)
    _check_depth_scaling(plain, target)
    _check_norm_free(plain, target, options.calibrate)
    norm_sources = map_norms(source=plain, target=target, mapping=options.norm_mapping)
    exact_swap, exact_fields = plan_exact_swap(plain=plain, target=target, head=head, norm_sources=norm_sources)
    if exact_fields:
        target = normswap_config(source_config, **swaps, **exact_fields)
    target.architectures = [HEAD_CLASSES[head].__name__]
    target.auto_map = dict(AUTO_MAP)
    if options.fold_norm_weights:
        check_foldable(target, head)
    return ConversionPlan(
        source=source,
        folder=folder,
        revision=revision,
        files=files,
        family=family,
        source_config=source_config,
        architecture=architecture,
        head=head,
        attention=attention,
        plain=plain,
        target=target,
        norm_sources=norm_sources,
        exact_swap=exact_swap,
        dtype=options.dtype,
    )


def _check_depth_scaling(plain: NormSwapConfig, target: NormSwapConfig) -> None:
    """LayerNorm Scaling (`lns`) is reached from pre-LN and left for pre-LN only, where the conversion is exact."""
    for before, after in zip(plain.layer_norm_placements, target.layer_norm_placements):
        if "lns" in (before, after) and before != after and {before, after} != {"pre", "lns"}:
            raise ConversionError(
                f"norm_placement: {before} -> {after} is not supported: LayerNorm Scaling ('lns') converts exactly "
                f"from and to 'pre' only; convert to 'pre' first, then to {after!r}"
            )


def _check_norm_free(plain: NormSwapConfig, target: NormSwapConfig, calibrate: bool) -> None:
    """Norm-free layers are reached from pre-LN, whose norms only read the stream: calibrated, each folds into its
    readers over the source's stream RMS there."""
    if "none" not in target.layer_norm_placements:
        return
    if not pre_ln_source(plain):
        raise ConversionError(
            f"norm_placement: none needs a pre-LN source, whose norms only read the residual stream; this one's is "
            f"{plain.norm_placement!r}" + (" with an embedding norm" if plain.embedding_norm else "")
        )
    blockers = branch_calibration_blockers(plain, target) if calibrate else []  # else: the norms dropped, as mapped
    if blockers:
        raise ConversionError(f"norm_placement: none cannot fold the source's norms into their readers: {blockers[0]}")


def _read_config(folder: Path, expected_family: str | None) -> tuple[PreTrainedConfig, Family]:
    """The source's configuration and family, refused when it is not of `expected_family`."""
    try:
        config = AutoConfig.from_pretrained(folder)
        family = family_of(config)
    except (OSError, ValueError, KeyError) as error:
        raise ConversionError(f"{folder}: {error}".splitlines()[0]) from None
    if expected_family not in (None, family.name):
        raise ConversionError(
            f"{folder}: a {family.name}-family checkpoint ({config.model_type}), expected {expected_family}-family"
        )
    return config, family


def _head(head: str, source_head: str, family: Family, attention: str) -> str:
    """The head to write: `head`, or for "auto" the source's (a bidirectional causal LM: the base model)."""
    if head == "auto":
        head = "base" if source_head == "causal-lm" and attention == "bidirectional" else source_head
    if head not in family.heads:
        allowed = ", ".join(["auto", *family.heads])
        raise ConversionError(f"head={head!r} is invalid for a {family.name}-family source: allowed are {allowed}")
    if head == "causal-lm" and attention != "causal":
        raise ConversionError("head='causal-lm' needs attention='causal'")
    return head


def _swaps(plain: NormSwapConfig, options: ConvertOptions, attention: str) -> dict:
    """The target's configuration fields that differ from the source's: the swap the options ask for."""
    swaps = {"is_causal": attention == "causal"}
    if options.norm_placement is not None and options.norm_placement != plain.norm_placement:
        swaps.update(norm_placement=options.norm_placement, embedding_norm=None, final_norm=None, final_scale=None)
        swaps["first_attention_input_norm"] = True
    if options.position_embedding_type is not None:
        swaps["position_embedding_type"] = options.position_embedding_type
    if options.norm_type is not None:
        swaps["norm_type"] = options.norm_type
    return swaps

"""Write a NormSwap checkpoint back as Transformers' own classes (BERT, LLaMA, Mistral, Qwen2/3, GPT-2, Gemma 2/3,
OLMo 2, ELECTRA, DistilBERT, ModernBERT), when its configuration allows; its source's own class first.

Whether it allows is read off a round trip: each target's native configuration is written from the NormSwap one by
its `FieldTable` and read back the way `convert` reads sources (`families.normswap_config`); a field that comes back
different is one the native architecture cannot represent. A norm-free model is written with norms that divide by a
constant (`constant_norms`)."""

from pathlib import Path

from huggingface_hub.errors import StrictDataclassError
from transformers import AutoConfig, BertModel

from ..checkpoint import copy_companion_files, output_folder, resolve_source
from ..model.configuration_normswap import NormSwapConfig
from ..model.heads import HEAD_CLASSES, NATIVE_AUTO_CLASSES, head_of_config, local_name
from .branch_calibration import removes_norms
from .config_fields import GEMMA3_TEXT_FIELDS, MISTRAL_FIELDS, QWEN2_FIELDS, QWEN3_FIELDS
from .constant_norms import constant_norm_config, with_constant_norms
from .converter import ConversionRecord
from .families import (
    BERT,
    DISTILBERT,
    ELECTRA,
    FAMILIES,
    GEMMA,
    GPT2,
    LLAMA,
    MODERNBERT,
    OLMO2,
    Family,
    normswap_config,
)
from .field_table import FieldTable
from .options import ConversionError


# The native architectures a NormSwap configuration can be written as: family (names) and field table (configuration).
TARGETS = (
    (BERT, BERT.fields),
    (LLAMA, LLAMA.fields),
    (LLAMA, MISTRAL_FIELDS),
    (LLAMA, QWEN2_FIELDS),
    (LLAMA, QWEN3_FIELDS),
    (GPT2, GPT2.fields),
    (GEMMA, GEMMA.fields),
    (GEMMA, GEMMA3_TEXT_FIELDS),
    (OLMO2, OLMO2.fields),
    (ELECTRA, ELECTRA.fields),
    (DISTILBERT, DISTILBERT.fields),
    (MODERNBERT, MODERNBERT.fields),
)

# Fields that do not change what a model computes (initialisation, dropout, labels, token ids, the cache, file
# metadata): left out of the round trip's comparison.
_IGNORED_FIELDS = {
    "use_cache",
    "architectures",
    "auto_map",
    "id2label",
    "label2id",
    "initializer_range",
    "dyt_alpha_init",
    "hidden_dropout",
    "attention_dropout",
    "classifier_dropout",
    "bos_token_id",
    "eos_token_id",
    "dtype",
    "transformers_version",
    "_name_or_path",
}


def _blockers(config: NormSwapConfig, fields: FieldTable) -> tuple[list[str], bool]:
    """The fields of `config` that the native configuration written from it reads back differently (FIELD=VALUE
    (needs WANTED)), or the native configuration's own refusal; and whether it refused."""
    try:
        round_trip = normswap_config(fields.native_config(config)).to_dict()
    except (ValueError, TypeError, StrictDataclassError) as error:
        return [" ".join(str(error).split())], True
    ignored = set(_IGNORED_FIELDS)
    if round_trip["position_embedding_type"] != config.position_embedding_type:
        ignored.add("rope_parameters")  # follows from the position scheme, which is named already
    blockers = [
        f"{field}={value!r} (needs {round_trip.get(field)})"
        for field, value in config.to_dict().items()
        if field not in ignored and round_trip.get(field) != value
    ]
    return blockers, False


def native_config(config: NormSwapConfig, head: str, own: str | None = None) -> tuple[Family, object]:
    """The family and Transformers configuration that compute what `config` computes (the class of model type `own`,
    its source's, where it can), or a ConversionError naming why not: the blocking fields of the source's family where
    known, else of the closest native architecture, and which native families hold its placement where that blocks."""
    own_family = next((family for family in FAMILIES if own in family.model_types and family.fields), None)
    candidates = []
    for family, fields in TARGETS:
        blockers, refused = _blockers(config, fields)
        if not blockers and head not in family.heads:
            blockers = [f"head {head!r} (the {family.name} export has {', '.join(family.heads)})"]
        holds_placement = not refused and not any(blocker.startswith("norm_placement=") for blocker in blockers)
        candidates.append((family, fields, blockers, holds_placement))
    family, fields, blockers, holds_placement = min(
        candidates,
        key=lambda candidate: (
            candidate[0] is not own_family,
            bool(candidate[2]),
            candidate[1].native_class.model_type != own,
            len(candidate[2]),
        ),
    )
    if blockers:
        native = fields.native_class.model_type
        whose = "its source's family" if family is own_family else "the closest"
        whose = "its source's class" if native == own else whose
        message = f"cannot be written as a native {native} model ({whose}): {'; '.join(blockers)}"
        if not holds_placement and family is own_family:
            holding = dict.fromkeys(candidate[0].name for candidate in candidates if candidate[3])
            message += f"; native classes with this norm_placement: {', '.join(holding) or 'none'}"
        raise ConversionError(message)
    return family, fields.native_config(config)


def _source_model_type(record: ConversionRecord | None) -> str | None:
    """The model type of the checkpoint a NormSwap model's conversion `record` was first converted from, where it
    records one."""
    if record is None:
        return None
    source = [*record.lineage_records(), record][0].source
    return source.model_type if source else None


def export_native(source: str, output: str, *, overwrite: bool = False, log=print) -> dict:
    """Writes the NormSwap checkpoint SOURCE as a native checkpoint (see `TARGETS`) in OUTPUT, with SOURCE's
    conversion.json."""
    folder, _ = resolve_source(source)
    try:
        config = AutoConfig.from_pretrained(folder)
    except (OSError, ValueError) as error:
        raise ConversionError(f"{folder}: {error}".splitlines()[0]) from None
    if not isinstance(config, NormSwapConfig):
        raise ConversionError(f"{folder}: not a NormSwap checkpoint (model_type {config.model_type!r})")
    head = head_of_config(config)
    norm_free = removes_norms(config)
    normed = constant_norm_config(config) if norm_free else config
    record = ConversionRecord.read(folder)
    family, target_config = native_config(normed, head, _source_model_type(record))

    model = HEAD_CLASSES[head].from_pretrained(folder)
    if norm_free:
        model = with_constant_norms(model)
    ours = model.state_dict()
    extra = {"add_pooling_layer": False} if family is BERT and head == "base" else {}
    native = BertModel(target_config, **extra) if extra else NATIVE_AUTO_CLASSES[head].from_config(target_config)
    native = native.to(next(model.parameters()).dtype)
    state = {}
    for name in native.state_dict():
        tensor = family.from_normswap(name, lambda ours_name: ours[local_name(name=ours_name, head=head)], head)
        if tensor is not None:
            state[name] = tensor
    missing = native.load_state_dict(state, strict=False).missing_keys
    tied = set(type(native)._tied_weights_keys or {})
    if set(missing) - tied:
        raise ConversionError(f"{folder}: no NormSwap tensor for {sorted(set(missing) - tied)}")
    native.tie_weights()

    with output_folder(output=output, overwrite=overwrite) as staging:
        native.save_pretrained(staging)
        copy_companion_files(folder=Path(folder), destination=staging)
        if record is not None:  # what made it, for its card (`push`) and for a conversion of it
            record.write(staging)
    log(
        f"wrote {type(native).__name__} to {output}"
        + (f" (norm-free: norms of epsilon {normed.norm_eps:.0f} that divide by a constant)" if norm_free else "")
    )
    return {"family": family.name, "architecture": type(native).__name__}


__all__ = ["export_native", "native_config"]

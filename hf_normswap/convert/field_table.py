"""A family's configuration fields as one table, read in both directions: from a source configuration to NormSwap's
fields (`FieldTable.normswap_fields`) and from a NormSwap configuration back to the native one
(`FieldTable.native_config`)."""

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedConfig

from ..model.configuration_normswap import NormSwapConfig


LABEL_FIELDS = ("id2label", "label2id", "problem_type")
TOKEN_ID_FIELDS = ("bos_token_id", "eos_token_id")


@dataclass(frozen=True)
class Computed:
    """A NormSwap field that is computed rather than copied: `read` gives its value from a source configuration,
    `write` the native keyword arguments that carry it back (None: the native configuration has no such field)."""

    name: str
    read: Callable[[PreTrainedConfig], Any]
    write: Callable[[NormSwapConfig], dict] | None = None


@dataclass(frozen=True)
class FieldTable:
    """How one family's configuration fields map onto NormSwap's. Labels and token ids pass through as they are:
    read where the source sets them, written back always (token ids only where the native configuration takes them)."""

    native_class: type[PreTrainedConfig]  # the configuration `native_config` writes
    copied: tuple[tuple[str, str], ...]  # (native name, NormSwap name): copied as they are, both ways
    fixed: dict[str, Any]  # NormSwap values that the architecture itself fixes: read only
    computed: tuple[Computed, ...] = ()
    refused: tuple[tuple[str, Any, str], ...] = ()  # (source field, value, why): a source with it does not convert
    writes_token_ids: bool = True

    def __post_init__(self):
        names = [name for _, name in self.copied] + list(self.fixed) + [field.name for field in self.computed]
        if len(names) != len(set(names)):
            raise ValueError(f"NormSwap fields declared twice: {sorted({n for n in names if names.count(n) > 1})}")

    def normswap_fields(self, source: PreTrainedConfig) -> dict:
        """The NormSwap fields that compute what `source` computes, or a ValueError for a refused setting."""
        for field, value, why in self.refused:
            _refuse(source, field, value, why)
        fields = {name: copy.deepcopy(getattr(source, native)) for native, name in self.copied}
        fields.update(self.fixed)
        fields.update({field.name: field.read(source) for field in self.computed})
        for name in LABEL_FIELDS + TOKEN_ID_FIELDS:
            if getattr(source, name, None) is not None:
                fields[name] = getattr(source, name)
        return fields

    def native_config(self, config: NormSwapConfig) -> PreTrainedConfig:
        """The native configuration that carries `config` (whether it computes the same is for the caller to check)."""
        kwargs = {native: copy.deepcopy(getattr(config, name)) for native, name in self.copied}
        for field in self.computed:
            if field.write:
                kwargs.update(field.write(config))
        passed = LABEL_FIELDS + TOKEN_ID_FIELDS if self.writes_token_ids else LABEL_FIELDS
        return self.native_class(**kwargs, **{name: getattr(config, name) for name in passed})


def same_names(*names: str) -> tuple[tuple[str, str], ...]:
    """Rows of `FieldTable.copied` for fields that the native configuration names as NormSwap does."""
    return tuple((name, name) for name in names)


def _refuse(source: PreTrainedConfig, field: str, value, why: str) -> None:
    if getattr(source, field, None) == value:
        raise ValueError(f"{source.model_type} with {field}={value!r} is not supported: {why}")

"""One variant of a comparison, as written (`pre:rope+heal@learning_rate=1e-4`) and parsed."""

import dataclasses

from ..model.configuration_normswap import INITIALIZERS, NORM_PLACEMENTS, POSITION_EMBEDDING_TYPES
from ..option_rules import not_allowed


PLACEMENTS = (*NORM_PLACEMENTS, "mix_ln")
NUMBER_SETTINGS = ("learning_rate", "warmup_ratio")  # the numbers a variant may pin
VARIANT_SETTINGS = (*NUMBER_SETTINGS, "initializer")  # what `VARIANT@field=value` may pin
HEAL_SUFFIX = "+heal"  # `pre+heal`: the converted variant is healed before fine-tuning


@dataclasses.dataclass(frozen=True)
class Variant:
    """One variant of a comparison, parsed once from its name as written (`pre:rope+heal@learning_rate=1e-4`)."""

    spec: str  # as written: how results and the report name it
    name: str  # without the pinned settings (`pre:rope+heal`)
    placement: str | None  # None: the source's own (native, or a position-only variant)
    position: str | None  # None: the source's own
    heal: bool  # healed before fine-tuning
    learning_rate: float | None = None  # pinned by `@learning_rate=`; None: the experiment's
    warmup_ratio: float | None = None  # pinned by `@warmup_ratio=`; None: the experiment's
    initializer: str | None = None  # pinned by `@initializer=` (one of INITIALIZERS); None: the configuration's

    @classmethod
    def parse(cls, spec: str) -> "Variant":
        """`NAME` or `NAME@field=value@...`, NAME being `native`, `PLACEMENT`, `PLACEMENT:POSITION` or `:POSITION`,
        possibly followed by `+heal`; a field is one of `VARIANT_SETTINGS`."""
        if not isinstance(spec, str):
            raise ValueError(f"variants: {spec!r} is not a variant name")
        name, *settings = spec.split("@")
        placement, position = _placement_and_position(name.removesuffix(HEAL_SUFFIX))
        pinned = {}
        for setting in settings:
            field, _, value = setting.partition("=")
            if field not in VARIANT_SETTINGS or not value:
                raise ValueError(
                    f"variant {spec!r}: after '@' comes field=value, with field one of {', '.join(VARIANT_SETTINGS)}"
                )
            if field == "initializer" and value not in INITIALIZERS:
                raise ValueError(f"variant {spec!r}: {not_allowed('initializer', value, INITIALIZERS)}")
            pinned[field] = value if field == "initializer" else read_number(f"variant {spec!r}: {field}", value)
        return cls(spec, name, placement, position, name.endswith(HEAL_SUFFIX), **pinned)

    @property
    def native(self) -> bool:
        """The source itself, as its own class."""
        return self.placement is None and self.position is None

    @property
    def converted(self) -> "Variant":
        """What a healed variant is healed from: the same conversion, without healing or pinned settings."""
        name = self.name.removesuffix(HEAL_SUFFIX)
        return Variant(spec=name, name=name, placement=self.placement, position=self.position, heal=False)

    @property
    def folder(self) -> str:
        """The variant in the names of its runs' folders (`:` is not portable)."""
        return self.spec.replace(":", "-")

    @property
    def start_name(self) -> str:
        """What it starts from: its name and the initializer it pins, shared by the variants that differ only in
        learning rate or warm-up."""
        return self.name + (f"@initializer={self.initializer}" if self.initializer else "")

    @property
    def start_folder(self) -> str:
        """The folder name of what it starts from."""
        return self.start_name.replace(":", "-")


def _placement_and_position(name: str) -> tuple[str | None, str | None]:
    """`native`, `PLACEMENT`, `PLACEMENT:POSITION` or `:POSITION` -> (placement, position); native is (None, None)."""
    if name == "native":
        return None, None
    placement, _, position = name.partition(":")
    if (
        (placement and placement not in PLACEMENTS)
        or (position and position not in POSITION_EMBEDDING_TYPES)
        or not (placement or position)
    ):
        raise ValueError(
            f"unknown variant {name!r}: use native, a placement ({' '.join(PLACEMENTS)}) and/or "
            f":POSITION ({' '.join(POSITION_EMBEDDING_TYPES)})"
        )
    return placement or None, position or None


def read_number(name: str, value, kind: type = float):
    """`value`, read as a `kind` (float or int) when it is text."""
    if isinstance(value, str):
        try:
            return kind(value)
        except ValueError:
            raise ValueError(f"{name}: {value!r} is not {'a number' if kind is float else 'an integer'}") from None
    return value

"""What `convert` may change and how it runs: one declaration for the Python keywords, the CLI and the checks."""

from dataclasses import dataclass, field

from ..model.configuration_normswap import NORM_PLACEMENTS, NORM_TYPES, POSITION_EMBEDDING_TYPES
from ..model.heads import HEAD_CLASSES
from ..option_rules import check_options
from .families import FAMILIES
from .norm_mapping import NORM_MAPPINGS


ATTENTIONS = ("bidirectional", "causal")
DTYPES = ("float32", "float16", "bfloat16")


def placement(text: str) -> str | list[str]:
    """One placement, or a comma-separated list with one per layer."""
    return text.split(",") if "," in text else text


class ConversionError(ValueError):
    """A conversion that cannot be done or did not verify, said in one line."""


@dataclass
class ConvertOptions:
    """The swap and the conversion's settings (`None`: keep the source's)."""

    norm_placement: str | list[str] | None = field(
        default=None,
        metadata={
            "help": f"one of {', '.join(NORM_PLACEMENTS)}, or one per layer, comma-separated; default: the source's",
            "parse": placement,
        },
    )
    position_embedding_type: str | None = field(
        default=None, metadata={"choices": POSITION_EMBEDDING_TYPES, "help": "default: the source's"}
    )
    norm_type: str | None = field(default=None, metadata={"choices": NORM_TYPES, "help": "default: the source's"})
    norm_mapping: str = field(
        default="shift", metadata={"choices": NORM_MAPPINGS, "help": "which pretrained norm fills which slot"}
    )
    calibrate: bool = field(
        default=True,
        metadata={
            "help": "scale sublayer writes and refit output projections against the source where norms that wrote "
            "the residual stream come to read it (post -> pre, sandwich); scale writes and fold the norm gains "
            "where norms come to write a stream they only read (pre -> post, pre_post, deepnorm)"
        },
    )
    fold_norm_weights: bool = field(
        default=False,
        metadata={
            "help": "fold each norm's gain and bias into the linear layers reading it, which then compute the same "
            "(FlashNorm); refused for a norm that writes the residual stream or whose gain no linear layer reads alone"
        },
    )
    attention: str | None = field(
        default=None,
        metadata={"choices": ATTENTIONS, "help": "default: the source's own (causal for a causal LM family)"},
    )
    head: str = field(default="auto", metadata={"choices": ("auto", *HEAD_CLASSES), "help": "default: the source's"})
    dtype: str | None = field(default=None, metadata={"choices": DTYPES, "help": "default: the source's"})
    verify: bool = field(default=True, metadata={"help": "check exactness against the source and measure the swap"})
    low_memory: bool | None = field(
        default=None,
        metadata={
            "help": "calibrate one layer at a time (the unswapped and the written model's layers read from their "
            "files as they run) and verify one module at a time (Transformers' disk offload); default: when the "
            "checkpoint would not fit whole (its size x 6 above available memory)"
        },
    )
    allow_pickle: bool = field(
        default=False, metadata={"help": "accept pytorch_model.bin (read with weights_only=True)"}
    )
    family: str | None = field(
        default=None,
        metadata={"choices": tuple(family.name for family in FAMILIES), "help": "refuse sources of any other family"},
    )

    def __post_init__(self):
        check_options(self, ConversionError)  # norm_placement's length and the head's family: against the source

"""Which pretrained norm fills which slot when the norm placement changes.

Every norm sits at a point of the residual stream: point 0 is after the embeddings, point s + 1 after sublayer s
(sublayer 2l is layer l's attention, 2l + 1 its feed-forward), point 2L after the last layer. A norm either
*writes* the stream at its point (post-LN's norm after the sum, the embedding norm), *reads* it (pre-LN's norm before
a sublayer, the final norm), or sits on the *branch* of a sublayer (sandwich and output placements).

- `shift`: a target norm takes the unused source norm at the same point, of the same kind if there is one (so going
  post to pre, the norm before attention in layer l takes the norm after the feed-forward of layer l - 1, or the
  embedding norm for layer 0; the final norm takes the last layer's output norm; and the inverse for pre to post).
- `keep`: each norm stays with its sublayer (or as embedding / final norm), in slot order.
- `reset`: no pretrained norm is used.

A target norm without a source starts at identity (weight 1, bias 0).
"""

from dataclasses import dataclass

from ..model.configuration_normswap import NORM_PLACEMENTS, NormSwapConfig


NORM_MAPPINGS = ("shift", "keep", "reset")
_SLOT_ORDER = ("input_norm", "output_norm", "residual_norm")
_SUBLAYERS = ("attention_norms", "mlp_norms")


@dataclass(frozen=True)
class NormSlot:
    name: str  # module path in a NormSwap head model, e.g. "model.layers.3.mlp_norms.input_norm"
    point: int  # residual-stream point, or the sublayer index for branch norms
    kind: str  # "write", "read" or "branch"
    group: str  # "embedding", "final" or "sublayer {s}": what `keep` preserves


def norm_slots(config: NormSwapConfig) -> list[NormSlot]:
    """Every norm of the placement in `config`, in forward order."""
    slots = []
    if config.embedding_norm:  # before the projection of projected embeddings: on no point of the residual stream
        point = 0 if config.embedding_size == config.hidden_size else -1
        slots.append(NormSlot("model.embeddings.norm", point, "write", "embedding"))
    for layer, placement in enumerate(config.layer_norm_placements):
        for offset, sublayer in enumerate(_SUBLAYERS):
            index = 2 * layer + offset
            prefix = f"model.layers.{layer}.{sublayer}"
            for slot in _SLOT_ORDER:
                if slot not in NORM_PLACEMENTS[placement]:
                    continue
                if index == 0 and slot == "input_norm" and not config.first_attention_input_norm:
                    continue
                point, kind = {
                    "input_norm": (index, "read"),
                    "output_norm": (index, "branch"),
                    "residual_norm": (index + 1, "write"),
                }[slot]
                slots.append(NormSlot(f"{prefix}.{slot}", point, kind, f"sublayer {index}"))
    if config.final_norm or config.final_scale:  # the fixed scale of a norm-free model takes the final norm's weights
        slots.append(NormSlot("model.norm", 2 * config.num_hidden_layers, "read", "final"))
    return slots


def map_norms(source: NormSwapConfig, target: NormSwapConfig, mapping: str) -> dict[str, str | None]:
    """For each target norm, the source norm whose weights it takes (None: starts at identity)."""

    def candidate(slot: NormSlot, other: NormSlot) -> bool:
        if mapping == "keep":
            return other.group == slot.group
        return other.point == slot.point and (other.kind == "branch") == (slot.kind == "branch")

    unused = norm_slots(source) if mapping != "reset" else []
    result = {slot.name: None for slot in norm_slots(target)}
    for same_kind_only in (True, False):
        for slot in norm_slots(target):
            if result[slot.name] is not None:
                continue
            match = next(
                (s for s in unused if candidate(slot, s) and (s.kind == slot.kind or not same_kind_only)), None
            )
            if match is not None:
                unused.remove(match)
                result[slot.name] = match.name
    return result

"""Verifying a conversion: the unswapped conversion must compute what the source computes (or nothing is written),
and the written model is measured against the source: exact or not, how far, the swap's effect, collapse."""

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig

from ..checkpoint import read_tensors, resolve_source, weight_files
from ..model.configuration_normswap import NormSwapConfig
from ..model.heads import HEAD_CLASSES, NATIVE_AUTO_CLASSES, empty_model, local_name
from ..probes.collapse import COLLAPSE_MARGIN, conversion_collapse
from ..probes.stream_mix import LayerGates, kl_by_layer, largest_layers
from ..probes.swap_effect import swap_batch, swap_effect
from .exact_swaps import keeps_last_hidden_state
from .families import Family, family_of, normswap_config
from .gguf import local_checkpoint
from .lazy_layers import assign_weights, folder_loaders, lazy_model, source_loaders
from .options import ConversionError
from .plan import ConversionPlan


HIDDEN_TOLERANCE = 1e-5
LOGITS_TOLERANCE = 1e-4


@dataclass
class Tolerance:
    last_hidden_state: float
    logits: float


@dataclass
class Distance:
    """Max |difference| between two models on the real tokens of a batch (None: not compared)."""

    last_hidden_state_max_abs_diff: float | None
    logits_max_abs_diff: float | None


@dataclass
class Measured(Distance):
    mode: str  # the attention the source was run with: "causal" or "bidirectional"


@dataclass
class Verification:
    """What `verify_conversion` found; all None when verification was skipped."""

    exact: bool | None = None
    swap_distance: Distance | None = None
    measured: Measured | None = None
    swap_effect: dict | None = None
    collapse: dict | None = None


def tolerance() -> Tolerance:
    """The tolerances within which a conversion counts as exact."""
    return Tolerance(last_hidden_state=HIDDEN_TOLERANCE, logits=LOGITS_TOLERANCE)


def load_plain(
    plain: NormSwapConfig, head: str, family: Family, files: list[Path], dtype: torch.dtype = torch.float32
) -> torch.nn.Module:
    """The unswapped NormSwap model of the source's weight files, in `dtype` (mapped in float32)."""
    model = empty_model(plain, head, dtype)
    expected = set(model.state_dict())
    state = {}
    for file in files:
        for source_name, tensor in read_tensors(file):
            for name, value in family.to_normswap(source_name, tensor.float(), head):
                name = local_name(name=name, head=head)
                if name in expected:
                    state[name] = value.to(dtype)
    assign_weights(model, model, "", state.get)
    model.tie_weights()
    return model.eval()


def load_unswapped(source: str, head: str = "base", dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """SOURCE (folder, Hub id or GGUF file of a BERT-, LLaMA-family or NormSwap checkpoint) as the unswapped NormSwap
    model with `head`, in `dtype`: the model every conversion of it is verified against (in float32)."""
    with local_checkpoint(source) as local:  # a GGUF file: read into a temporary folder
        folder, _ = resolve_source(local)
        try:
            config = AutoConfig.from_pretrained(folder)
            return load_plain(normswap_config(config), head, family_of(config), weight_files(folder), dtype=dtype)
        except (OSError, ValueError, KeyError) as error:
            raise ConversionError(f"{source}: cannot be loaded as NormSwap ({str(error).splitlines()[0]})") from None


def padding_id(pad_token_id: int | None, eos_token_id, vocab_size: int) -> int:
    """The id a verification batch is padded with: the pad id, else EOS, where it lies in the vocabulary, else 0 (a
    config may keep special ids beyond a shrunk vocabulary, as GPT2Config(vocab_size=211) keeps EOS 50256)."""
    for candidate in (pad_token_id, eos_token_id):
        if isinstance(candidate, int) and 0 <= candidate < vocab_size:
            return candidate
    return 0


def random_batch(vocab_size: int, pad_token_id: int | None, seed: int = 0):
    """Random token ids (never the pad id) with right padding, and the attention mask."""
    generator = torch.Generator().manual_seed(seed)
    pad = 0 if pad_token_id is None else pad_token_id
    input_ids = torch.randint(0, vocab_size - 1, (3, 16), generator=generator)
    input_ids = input_ids + (input_ids >= pad).long()  # skip the pad id
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 11:] = 0
    attention_mask[2, 5:] = 0
    return input_ids.masked_fill(attention_mask == 0, pad), attention_mask


def load_written(folder: Path, head: str, low_memory: bool) -> torch.nn.Module:
    """The model written in FOLDER in float32: whole, or with lazy layers that write their changes back."""
    if not low_memory:
        return load_pretrained(HEAD_CLASSES[head], folder, low_memory=False)
    return lazy_model(NormSwapConfig.from_pretrained(folder), head, folder_loaders(folder), folder=folder)


def load_pretrained(model_class, folder: Path, low_memory: bool) -> torch.nn.Module:
    """`model_class.from_pretrained(FOLDER)` in float32: whole, or with `low_memory` offloaded to its own safetensors
    files (Transformers' disk offload: each module's weights are read when it runs and dropped after); modules whose
    weights the files lack are initialised in memory, as `from_pretrained` initialises them."""
    if not low_memory:
        return model_class.from_pretrained(folder, dtype=torch.float32).eval()
    dispatch = logging.getLogger("accelerate.big_modeling")  # it warns that offloaded weights are on the meta device
    level = dispatch.level
    dispatch.setLevel(logging.ERROR)
    try:
        model, loading = model_class.from_pretrained(
            folder, dtype=torch.float32, device_map={"": "disk"}, output_loading_info=True
        )
    finally:
        dispatch.setLevel(level)
    missing = set(loading["missing_keys"])
    for owner in sorted({name.rpartition(".")[0] for name in missing}):
        module = model.get_submodule(owner)
        module.to_empty(device="cpu", recurse=False)
        model._init_weights(module)
        offloaded = module._hf_hook.weights_map  # accelerate's offload loader: a tensor in its state_dict is served
        for name, tensor in module.named_parameters(recurse=False):
            if f"{owner}.{name}" in missing:
                offloaded.dataset.state_dict[offloaded.prefix + name] = tensor.detach()
        module.to("meta")
    return model.eval()


def load_unswapped_model(plan: ConversionPlan, low_memory: bool) -> torch.nn.Module:
    """The unswapped model of the plan's source in float32: whole, or with lazy layers."""
    if not low_memory:
        return load_plain(plain=plan.plain, head=plan.head, family=plan.family, files=plan.files)
    return lazy_model(plan.plain, plan.head, source_loaders(plan.files, plan.family, plan.head))


def verify_conversion(
    *,
    plan: ConversionPlan,
    plain_model,
    folder: Path,
    compare_logits: bool,
    log,
    low_memory: bool = False,
    layer_gates: LayerGates | None = None,
    head_took_final_norm: bool = False,
) -> Verification:
    """Runs the source, the unswapped conversion (`plain_model`) and the model written in FOLDER on random padded
    inputs. Raises when the unswapped conversion is beyond tolerance; records whether the written model is exact,
    how far it is, the swap's effect and collapse. With `low_memory`, the source's model and the written one hold one
    module's weights at a time (`load_pretrained`). With `layer_gates` (a calibrated conversion out of pre-LN that
    can compute its source layer by layer), a causal LM's swap effect also gives the KL with each layer alone swapped
    (`stream_mix.kl_by_layer`).
    Where the head took the final norm's gain (`head_took_final_norm`), only the logits are compared."""
    plain = plain_model.config
    native = load_pretrained(NATIVE_AUTO_CLASSES[plan.head], plan.folder, low_memory)
    # causal-LM classifiers find the last token by the pad id: the one the batch is padded with
    native.config.pad_token_id = padding_id(native.config.pad_token_id, plain.eos_token_id, plain.vocab_size)
    batch = random_batch(plain.vocab_size, native.config.pad_token_id)
    source, source_name = _outputs(native, plan.head, batch, compare_logits), type(native).__name__
    del native  # its outputs are all the comparisons need
    measured = _measure_unswapped(source, source_name, plain_model, plan.head, batch, compare_logits, log)
    written = load_pretrained(HEAD_CLASSES[plan.head], folder, low_memory)
    compare_hidden = keeps_last_hidden_state(kind=plan.exact_swap, head=plan.head) and not head_took_final_norm
    swap_distance = _distance(source, written, plan.head, batch, compare_hidden, compare_logits)
    exact = (compare_hidden or compare_logits) and _within_tolerance(swap_distance)
    compared = ", ".join(
        f"{what} {value:.2e}"
        for what, value in (
            ("last hidden state", swap_distance.last_hidden_state_max_abs_diff),
            ("logits", swap_distance.logits_max_abs_diff),
        )
        if value is not None
    )
    log(f"written model: {'exact' if exact else 'approximate'} (max |difference| to the source: {compared})")

    effect = swap_effect(before=plain_model, after=written, folder=folder, head=plan.head)
    if "kl" in effect and layer_gates is not None:
        batch = swap_batch(folder, written.config.vocab_size)
        effect["kl_by_layer"] = kl_by_layer(plain_model, written, layer_gates, [batch])
    log(_swap_line(effect))
    collapse = conversion_collapse(source=plain_model, variant=written, folder=folder)
    log(_collapse_line(collapse))
    return Verification(
        exact=exact, swap_distance=swap_distance, measured=measured, swap_effect=effect, collapse=collapse
    )


def _measure_unswapped(source, source_name: str, plain_model, head: str, batch, compare_logits: bool, log) -> Measured:
    """How far the unswapped conversion is from the `source` outputs (of Transformers' `source_name`); raises beyond
    tolerance."""
    distance = _distance(source, plain_model, head, batch, True, compare_logits)
    hidden, logits = distance.last_hidden_state_max_abs_diff, distance.logits_max_abs_diff
    mode = "causal" if plain_model.config.is_causal else "bidirectional"
    log(
        f"verified against {source_name} ({mode}): max |difference| last hidden state {hidden:.2e}"
        + (f", logits {logits:.2e}" if logits is not None else "")
    )
    if not _within_tolerance(distance):
        on_logits = "not compared" if logits is None else f"{logits:.3e}"
        raise ConversionError(
            f"verification failed: max |difference| {hidden:.3e} on the last hidden state (tolerance "
            f"{HIDDEN_TOLERANCE}), {on_logits} on the logits (tolerance {LOGITS_TOLERANCE}); nothing was written"
        )
    return Measured(last_hidden_state_max_abs_diff=hidden, logits_max_abs_diff=logits, mode=mode)


def _distance(source, ours, head: str, batch, compare_hidden: bool, compare_logits: bool) -> Distance:
    """Max |difference| between the `source` outputs (`_outputs`) and model `ours`'s on the real tokens of `batch`:
    last hidden state, head logits."""
    if not (compare_hidden or compare_logits):
        return Distance(last_hidden_state_max_abs_diff=None, logits_max_abs_diff=None)
    real = batch[1].bool()
    native_hidden, native_logits = source
    ours_hidden, ours_logits = _outputs(ours, head, batch, compare_logits)
    hidden_diff = logits_diff = None
    if compare_hidden:
        hidden_diff = (native_hidden - ours_hidden)[real].abs().max().item()
    if compare_logits:
        differences = [(a - b).abs() for a, b in zip(native_logits, ours_logits)]
        per_token = head != "sequence-classification"
        logits_diff = max((d[real] if per_token else d).max().item() for d in differences)
    return Distance(last_hidden_state_max_abs_diff=hidden_diff, logits_max_abs_diff=logits_diff)


@torch.no_grad()
def _outputs(model, head: str, batch, logits: bool) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """The base model's last hidden state and, with `logits`, the head's logits (start and end logits for question
    answering), from one forward."""
    input_ids, attention_mask = batch
    if not logits:
        return model.base_model(input_ids, attention_mask=attention_mask).last_hidden_state, ()
    captured = []
    hook = model.base_model.register_forward_hook(lambda module, args, output: captured.append(output[0]))
    try:
        outputs = model(input_ids, attention_mask=attention_mask, return_dict=False)
    finally:
        hook.remove()
    return captured[0], outputs[: 2 if head == "question-answering" else 1]


def _within_tolerance(distance: Distance) -> bool:
    hidden, logits = distance.last_hidden_state_max_abs_diff, distance.logits_max_abs_diff
    return (hidden is None or hidden <= HIDDEN_TOLERANCE) and (logits is None or logits <= LOGITS_TOLERANCE)


def _swap_line(effect: dict) -> str:
    if effect["metric"] == "cosine_similarity":
        return f"swap effect: cosine similarity of hidden states before/after {effect['after']:.4f}"
    line = f"swap effect: {effect['metric']} {effect['before']:.4f} -> {effect['after']:.4f}"
    if "kl" in effect:
        line += f"; KL to the source {effect['kl']:.3f} nats/token, top-1 agreement {effect['top1_agreement']:.3f}"
    if "kl_by_layer" in effect:
        line += f"; KL with one layer alone swapped, largest: {largest_layers(effect['kl_by_layer'])}"
    return line


def _collapse_line(collapse: dict) -> str:
    source, variant = collapse["source"], collapse["variant"]
    line = (
        f"collapse (mean pairwise cosine of first-token / mean vectors, final output): source "
        f"{source['first_token'][-1]:.4f} / {source['mean'][-1]:.4f}, converted {variant['first_token'][-1]:.4f} / "
        f"{variant['mean'][-1]:.4f}"
    )
    return line + (
        f"; more than {COLLAPSE_MARGIN} above the source: the swap collapsed it" if collapse["flagged"] else ""
    )

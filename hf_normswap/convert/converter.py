"""Put a BERT- or LLaMA-family checkpoint on NormSwap exactly, optionally swapping norm placement or position scheme."""

import json
from importlib.metadata import version
from pathlib import Path

import torch
from huggingface_hub import ModelCard
from transformers import AutoConfig, AutoTokenizer

from ..checkpoint import (
    TOKENIZER_FILES,
    ShardWriter,
    check_output,
    copy_tokenizer_files,
    output_folder,
    read_tensors,
    resolve_source,
    update_tensors,
    weight_files,
)
from ..model import copy_remote_code
from ..model.configuration_normswap import NormSwapConfig
from ..model.heads import HEAD_CLASSES, NATIVE_AUTO_CLASSES, local_name
from ..model.modeling_normswap import AUTO_MAP
from ..probes.collapse import COLLAPSE_MARGIN, conversion_collapse
from ..probes.probe_data import probe_batches, probe_tokenizer
from ..probes.swap_effect import swap_effect
from .calibration import RIDGE, calibrate_writes, calibrated_sublayers, fitted_sources, source_sums
from .exact_swaps import apply_exact_swap, keeps_last_hidden_state, plan_exact_swap
from .families import NORMSWAP, family_of, normswap_config
from .norm_mapping import map_norms, norm_slots
from .options import DTYPES, ConversionError


HIDDEN_TOLERANCE = 1e-5
LOGITS_TOLERANCE = 1e-4
CALIBRATION_SIZE = 704  # the shipped SST-2 training sample, all of it


def convert_checkpoint(
    source: str,
    output: str,
    *,
    norm_placement: str | list[str] | None = None,
    position_embedding_type: str | None = None,
    norm_type: str | None = None,
    norm_mapping: str = "shift",
    calibrate: bool = True,
    attention: str | None = None,
    head: str = "auto",
    dtype: str | None = None,
    verify: bool = True,
    overwrite: bool = False,
    allow_pickle: bool = False,
    family: str | None = None,
    log=print,
) -> dict:
    """Converts SOURCE (folder or Hub id) to a NormSwap checkpoint in OUTPUT and returns the conversion report.

    `attention` defaults to bidirectional, or to the source's own for a NormSwap source. With `calibrate`, a swap that
    turns norms writing the residual stream into norms reading it has its sublayers' writes scaled and its output
    projections refitted against the source (see `hf_normswap.calibration`).
    """
    if attention not in (None, "bidirectional", "causal"):
        raise ConversionError(f"attention={attention!r} is invalid: allowed are 'bidirectional', 'causal'")
    if dtype not in (None, *DTYPES):
        raise ConversionError(f"dtype={dtype!r} is invalid: allowed are {list(DTYPES)}")
    check_output(output, overwrite)  # before a download
    folder, revision = resolve_source(source, allow_pickle)
    try:
        source_config = AutoConfig.from_pretrained(folder)
        source_family = family_of(source_config)
    except (OSError, ValueError, KeyError) as error:
        raise ConversionError(f"{folder}: {error}".splitlines()[0]) from None
    if family not in (None, source_family.name):
        raise ConversionError(
            f"{folder}: a {source_family.name}-family checkpoint ({source_config.model_type}), expected {family}-family"
        )
    files = weight_files(folder, allow_pickle)
    if attention is None:
        attention = "causal" if source_family is NORMSWAP and source_config.is_causal else "bidirectional"

    # A config without `architectures` is taken as the base model ("BertConfig" -> "BertModel").
    architecture = (source_config.architectures or [type(source_config).__name__.removesuffix("Config") + "Model"])[0]
    source_head = source_family.head_of(architecture)
    if head == "auto":
        head = "base" if source_head == "causal-lm" and attention == "bidirectional" else source_head
    if head not in source_family.heads:
        raise ConversionError(
            f"head={head!r} is invalid for a {source_family.name}-family source: allowed are {['auto', *source_family.heads]}"
        )
    if head == "causal-lm" and attention != "causal":
        raise ConversionError("head='causal-lm' needs attention='causal'")

    plain = normswap_config(source_config)
    swaps = {"is_causal": attention == "causal"}
    if norm_placement is not None and norm_placement != plain.norm_placement:
        swaps.update(norm_placement=norm_placement, embedding_norm=None, final_norm=None)
        swaps["first_attention_input_norm"] = True
    if position_embedding_type is not None:
        swaps["position_embedding_type"] = position_embedding_type
    if norm_type is not None:
        swaps["norm_type"] = norm_type
    target = normswap_config(source_config, **swaps)
    norm_sources = map_norms(plain, target, norm_mapping)
    exact_swap, exact_fields = plan_exact_swap(plain, target, head, norm_sources)
    if exact_fields:
        target = normswap_config(source_config, **swaps, **exact_fields)

    report = {
        "hf_normswap_version": version("hf-normswap"),
        "source": {
            "id": source,
            "revision": revision,
            "model_type": source_config.model_type,
            "architecture": architecture,
            "license": _source_license(folder),
        },
        "lineage": _lineage(folder),
        "source_config": source_config.to_dict(),
        "target_config": None,
        "head": head,
        "swap": {
            "norm_placement": [plain.norm_placement, target.norm_placement],
            "position_embedding_type": [plain.position_embedding_type, target.position_embedding_type],
            "attention": ["causal" if plain.is_causal else "bidirectional", attention],
            "norm_type": [plain.norm_type, target.norm_type],
            "exact_swap": exact_swap,
        },
        "norm_mapping": norm_mapping,
        "norm_sources": norm_sources,
        "calibration": None,
        "tolerance": {"last_hidden_state": HIDDEN_TOLERANCE, "logits": LOGITS_TOLERANCE},
        "notes": [],
    }

    with output_folder(output, overwrite) as staging:
        _write_weights(files, source_family, plain, target, head, norm_sources, exact_swap, dtype, staging, report)
        report["tokenizer"] = _copy_tokenizer(folder, source_family, staging)
        target.architectures = [HEAD_CLASSES[head].__name__]
        target.auto_map = dict(AUTO_MAP)
        target.save_pretrained(staging)
        copy_remote_code(staging)
        report["target_config"] = target.to_dict()
        sublayers = (
            calibrated_sublayers(target, norm_sources, norm_slots(plain)) if calibrate and not exact_swap else {}
        )
        plain_model = load_plain(plain, head, source_family, files) if verify or sublayers else None
        if sublayers:
            report["calibration"] = _calibrate(
                staging, head, plain_model, target, norm_sources, sublayers, report, log
            )

        if verify:
            report["measured"] = _verify(folder, plain_model, staging, head, exact_swap, report, log)
            report["swap_effect"] = swap_effect(plain_model, staging, head)
            log(_swap_line(report["swap_effect"]))
            report["collapse"] = conversion_collapse(plain_model, staging)
            log(_collapse_line(report["collapse"]))
        else:
            report["measured"] = report["exact"] = report["swap_distance"] = None
            report["swap_effect"] = None
            report["collapse"] = None
            log("verification skipped (--no-verify)")
        (staging / "conversion.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    log(f"wrote {output}")
    return report


def _write_weights(files, family, plain, target, head, norm_sources, exact_swap, dtype, staging, report) -> None:
    """Streams the source tensors into the target's names and shards (through memory when an exact swap rewrites
    them)."""
    with torch.device("meta"):
        expected = HEAD_CLASSES[head](target).state_dict()
    tied = set(HEAD_CLASSES[head]._tied_weights_keys or {}) if target.tie_word_embeddings else set()
    moved_norms = {source: goal for goal, source in norm_sources.items() if source is not None}
    plain_norms = {slot.name for slot in norm_slots(plain)}
    cast = getattr(torch, dtype) if dtype else None
    writer = ShardWriter(staging, max_shard_bytes=max(file.stat().st_size for file in files))
    written, dropped, collected, dtypes = set(), [], {}, []

    def place(name: str, tensor: torch.Tensor, file: Path, source_name: str) -> None:
        name = local_name(name, head)
        if name in tied:
            return
        if name not in expected:
            dropped.append(f"{source_name} (no place in a NormSwap {head} model of this configuration)")
            return
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise ConversionError(
                f"{file}: tensor {source_name!r} has shape {tuple(tensor.shape)}, expected {tuple(expected[name].shape)}"
            )
        dtypes.append(tensor.dtype)
        writer.add(name, tensor.to(cast) if cast else tensor)
        written.add(name)

    for file in files:
        for source_name, source_tensor in read_tensors(file):
            try:
                converted = family.to_normswap(source_name, source_tensor, head)
            except KeyError:
                raise ConversionError(
                    f"{file}: unexpected tensor {source_name!r} for a {family.name}-family checkpoint"
                ) from None
            for name, tensor in converted:
                norm, parameter = name.rsplit(".", 1)
                if norm in plain_norms:
                    if norm not in moved_norms:
                        dropped.append(f"{source_name} (a norm without a slot under the new placement)")
                        continue
                    name = f"{moved_norms[norm]}.{parameter}"
                if exact_swap:  # rewritten as a whole below
                    collected[name] = tensor
                else:
                    place(name, tensor, file, source_name)
    if exact_swap:
        for name, tensor in apply_exact_swap(exact_swap, collected, plain, target, head).items():
            place(name, tensor, files[0].parent, f"{name} (after the {exact_swap} swap)")
    weights_dtype = cast or dtypes[0]

    new_norms = {local_name(goal, head) for goal, source in norm_sources.items() if source is None}
    initialized, at_load = [], []
    generator = torch.Generator().manual_seed(0)
    for name, meta in expected.items():
        if name in written or name in tied:
            continue
        module, parameter = name.rsplit(".", 1)
        if module in new_norms:
            value = torch.ones(meta.shape) if parameter == "weight" else torch.zeros(meta.shape)
            initialized.append(f"{name} (identity)")
        elif parameter == "bias" and f"{module}.weight" in written:
            value = torch.zeros(meta.shape)
            initialized.append(f"{name} (zero: the source has no bias there)")
        elif parameter == "alpha":
            value = torch.full(meta.shape, target.dyt_alpha_init)
            initialized.append(f"{name} (dyt_alpha_init {target.dyt_alpha_init})")
        elif name.endswith("embeddings.position_embeddings.weight"):
            value = torch.randn(meta.shape, generator=generator) * target.initializer_range
            initialized.append(f"{name} (normal, std {target.initializer_range})")
        elif name.startswith(("classifier.", "pooler.", "head.", "qa_outputs.", "lm_head.")):
            at_load.append(name)
            continue
        else:
            raise ConversionError(f"{files[0].parent}: no tensor for {name!r} in the {family.name}-family checkpoint")
        writer.add(name, value.to(weights_dtype))
    report["weights"] = {
        "files": writer.close(),
        "dropped": dropped,
        "initialized": initialized,
        "initialized_at_load": at_load,
        "dtype": dtype or str(weights_dtype).removeprefix("torch."),
    }
    if family.norm_weight_offset and weights_dtype != torch.float32:
        report["notes"].append(
            f"the norm weights hold the source's {family.norm_weight_offset:g} + w, rounded to "
            f"{report['weights']['dtype']}; the source adds in float32, so outputs differ slightly outside float32"
        )


def _calibrate(
    staging: Path,
    head: str,
    plain_model,
    target: NormSwapConfig,
    norm_sources: dict,
    sublayers: dict,
    report: dict,
    log,
) -> dict:
    """Scales the written model's sublayer writes, and refits its linear writes against the unswapped source
    (`plain_model`); returns what was done. Norms initialised at identity and then calibrated are listed as such."""
    model = HEAD_CLASSES[head].from_pretrained(staging, dtype=torch.float32)
    tokenizer = probe_tokenizer(staging)
    batch = probe_batches(tokenizer, model.config.vocab_size, CALIBRATION_SIZE, CALIBRATION_SIZE, split="train")[0]
    sources = fitted_sources(target, norm_sources, norm_slots(plain_model.config), sublayers)
    scales, errors = calibrate_writes(model, sublayers, batch, source_sums(plain_model, sources, batch))
    prefix = "" if model.base_model is model else f"{model.base_model_prefix}."
    written = tuple(f"{prefix}{module}." for module in sublayers.values())
    changed = {name: tensor for name, tensor in model.state_dict().items() if name.startswith(written)}
    update_tensors(staging, changed)
    report["weights"]["initialized"] = [
        entry.replace(" (identity)", " (calibrated)") if entry.split(" ")[0] in changed else entry
        for entry in report["weights"]["initialized"]
    ]
    data = (
        f"the {CALIBRATION_SIZE} sentences of the shipped SST-2 training sample"
        if tokenizer
        else f"{CALIBRATION_SIZE} random token sequences"
    )
    log(
        f"calibrated the writes of {len(scales)} sublayers on {data} (scales {min(scales.values()):.3g} to {max(scales.values()):.3g})"
        + (f", refitted {len(errors)} of them" if errors else "")
    )
    return {
        "data": data,
        "write_scales": scales,
        "refit_errors": errors,
        "ridge": RIDGE if errors else None,
        "modules": list(sublayers.values()),
    }


def _lineage(folder: Path) -> list[dict]:
    """The reports of the steps that made a NormSwap source (`conversion.json` and its own lineage), oldest first."""
    record = folder / "conversion.json"
    if not record.exists():
        return []
    try:
        earlier = json.loads(record.read_text())
    except json.JSONDecodeError as error:
        raise ConversionError(f"{record}: not valid JSON ({error})") from None
    return [*earlier.pop("lineage", []), earlier]


def _source_license(folder: Path) -> str | None:
    """The license in the source's model card, if it has one."""
    try:
        return ModelCard.load(folder / "README.md", ignore_metadata_errors=True).data.license
    except (OSError, ValueError):
        return None


def _copy_tokenizer(folder: Path, family, staging: Path) -> dict:
    """Copies the tokenizer; a causal family's is saved as Transformers loads it, with EOS as pad if it had none."""
    if not family.causal or not any((folder / name).exists() for name in TOKENIZER_FILES):
        return {"files": copy_tokenizer_files(folder, staging), "pad_token_added": None}
    tokenizer = AutoTokenizer.from_pretrained(folder)
    added = None
    if tokenizer.pad_token is None and (tokenizer.eos_token or tokenizer.unk_token):
        tokenizer.pad_token = added = tokenizer.eos_token or tokenizer.unk_token
    files = sorted(Path(name).name for name in tokenizer.save_pretrained(staging))
    return {"files": files, "pad_token_added": added}


def load_plain(plain: NormSwapConfig, head: str, family, files: list[Path]) -> torch.nn.Module:
    """The unswapped NormSwap model of the source's weight files, in float32."""
    model = HEAD_CLASSES[head]._from_config(plain, dtype=torch.float32)
    expected = set(model.state_dict())
    state = {}
    for file in files:
        for source_name, tensor in read_tensors(file):
            for name, value in family.to_normswap(source_name, tensor.float(), head):
                if local_name(name, head) in expected:
                    state[local_name(name, head)] = value
    model.load_state_dict(state, strict=False)
    return model.eval()


def load_unswapped(source: str, head: str = "base") -> torch.nn.Module:
    """SOURCE (folder or Hub id of a BERT-, LLaMA-family or NormSwap checkpoint) as the unswapped NormSwap model with
    `head`, in float32: the model every conversion of it is verified against."""
    folder, _ = resolve_source(source)
    try:
        config = AutoConfig.from_pretrained(folder)
        return load_plain(normswap_config(config), head, family_of(config), weight_files(folder))
    except (OSError, ValueError, KeyError) as error:
        raise ConversionError(f"{source}: cannot be loaded as NormSwap ({str(error).splitlines()[0]})") from None


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


def _differences(native, ours, head: str, batch, compare_hidden: bool, compare_logits: bool) -> tuple:
    """Max |difference| between two models on the real tokens of `batch`: last hidden state, head logits."""
    input_ids, attention_mask = batch
    real = attention_mask.bool()
    hidden_diff = logits_diff = None
    with torch.no_grad():
        if compare_hidden:
            native_hidden = native.base_model(input_ids, attention_mask=attention_mask).last_hidden_state
            ours_hidden = ours.base_model(input_ids, attention_mask=attention_mask).last_hidden_state
            hidden_diff = (native_hidden - ours_hidden)[real].abs().max().item()
        if compare_logits:
            native_outputs = native(input_ids, attention_mask=attention_mask, return_dict=False)
            ours_outputs = ours(input_ids, attention_mask=attention_mask, return_dict=False)
            count = 2 if head == "question-answering" else 1  # start and end logits
            differences = [(a - b).abs() for a, b in zip(native_outputs[:count], ours_outputs[:count])]
            per_token = head != "sequence-classification"
            logits_diff = max((d[real] if per_token else d).max().item() for d in differences)
    return hidden_diff, logits_diff


def _within_tolerance(hidden_diff, logits_diff) -> bool:
    return (hidden_diff is None or hidden_diff <= HIDDEN_TOLERANCE) and (
        logits_diff is None or logits_diff <= LOGITS_TOLERANCE
    )


def _verify(folder, plain_model, staging, head, exact_swap, report, log) -> dict:
    """Runs the source, the unswapped conversion and the written model on random padded inputs. Raises when the
    unswapped conversion is beyond tolerance; records whether the written model is exact, and how far it is."""
    native = NATIVE_AUTO_CLASSES[head].from_pretrained(folder, dtype=torch.float32).eval()
    plain = plain_model.config
    if native.config.pad_token_id is None:  # causal-LM classifiers find the last token by a pad id
        native.config.pad_token_id = plain.eos_token_id if isinstance(plain.eos_token_id, int) else 0
    batch = random_batch(plain.vocab_size, native.config.pad_token_id)
    compare_logits = head != "base" and not report["weights"]["initialized_at_load"]
    hidden_diff, logits_diff = _differences(native, plain_model, head, batch, True, compare_logits)
    mode = "causal" if plain.is_causal else "bidirectional"
    log(
        f"verified against {type(native).__name__} ({mode}): max |difference| last hidden state {hidden_diff:.2e}"
        + (f", logits {logits_diff:.2e}" if logits_diff is not None else "")
    )
    if not _within_tolerance(hidden_diff, logits_diff):
        logits = "not compared" if logits_diff is None else f"{logits_diff:.3e}"
        raise ConversionError(
            f"verification failed: max |difference| {hidden_diff:.3e} on the last hidden state (tolerance "
            f"{HIDDEN_TOLERANCE}), {logits} on the logits (tolerance {LOGITS_TOLERANCE}); nothing was written"
        )

    written = HEAD_CLASSES[head].from_pretrained(staging, dtype=torch.float32).eval()
    compare_hidden = keeps_last_hidden_state(exact_swap, head)
    swap_hidden, swap_logits = _differences(native, written, head, batch, compare_hidden, compare_logits)
    report["exact"] = (compare_hidden or compare_logits) and _within_tolerance(swap_hidden, swap_logits)
    report["swap_distance"] = {"last_hidden_state_max_abs_diff": swap_hidden, "logits_max_abs_diff": swap_logits}
    compared = ", ".join(
        f"{what} {value:.2e}"
        for what, value in (("last hidden state", swap_hidden), ("logits", swap_logits))
        if value is not None
    )
    log(f"written model: {'exact' if report['exact'] else 'approximate'} (max |difference| to the source: {compared})")
    return {"last_hidden_state_max_abs_diff": hidden_diff, "logits_max_abs_diff": logits_diff, "mode": mode}


def _swap_line(effect: dict) -> str:
    if effect["metric"] == "cosine_similarity":
        return f"swap effect: cosine similarity of hidden states before/after {effect['after']:.4f}"
    return f"swap effect: {effect['metric']} {effect['before']:.4f} -> {effect['after']:.4f}"


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

"""Put a supported checkpoint on NormSwap exactly, optionally swapping norm placement, norm type or position scheme:
plan -> write -> calibrate -> verify -> record (conversion.json)."""

import json
from dataclasses import asdict, dataclass
from dataclasses import fields as dataclass_fields
from importlib.metadata import version
from pathlib import Path

from huggingface_hub import ModelCard
from torch import nn
from transformers import AutoTokenizer

from ..checkpoint import TOKENIZER_FILES, check_output, copy_companion_files, output_folder
from ..memory import available_memory, peak_memory, release_freed_memory
from ..model import copy_remote_code
from ..model.heads import HEAD_CLASSES
from ..records import JsonRecord, from_fields
from .branch_calibration import calibrates_branches, folds_input_norms
from .calibration import CalibrationRecord, calibrate_checkpoint, calibrated_sublayers, write_back
from .gguf import local_checkpoint, shipped_model
from .norm_mapping import norm_slots
from .norm_weight_folding import fold_norm_weights
from .options import ConversionError, ConvertOptions
from .plan import ConversionPlan, plan_conversion
from .stream_calibration import calibrates_stream
from .verification import (
    Tolerance,
    Verification,
    load_pretrained,
    load_unswapped_model,
    load_written,
    tolerance,
    verify_conversion,
)
from .weights import WeightsRecord, write_weights


WHOLE_MODEL_COPIES = 6  # the source's weights held whole: three models in float32 (from 16 bits: twice the files)


@dataclass
class SourceRecord:
    id: str  # as given: a folder or a Hub id
    revision: str | None
    model_type: str
    architecture: str
    license: str | None


@dataclass
class SwapRecord:
    """Each property as [source, target], and the exact swap if the swap is one."""

    norm_placement: list
    position_embedding_type: list[str]
    attention: list[str]
    norm_type: list[str]
    exact_swap: str | None


@dataclass
class TokenizerRecord:
    files: list[str]
    pad_token_added: str | None
    sentence_transformers: list[str]  # the pipeline's files carried with it: modules.json, its settings, its modules


@dataclass
class MemoryRecord:
    """The peak resident memory of each stage above the memory at its start, in MiB (None: the stage did not run),
    and how it was measured (`memory.peak_memory`), and whether the models were held whole."""

    write_mib: float
    calibrate_mib: float | None
    verify_mib: float | None
    measured_by: str
    low_memory: bool  # calibration ran one layer at a time, verification one module (`ConvertOptions.low_memory`)


@dataclass
class ConversionRecord(JsonRecord):
    """What conversion.json holds: what was converted into what, how, and what verification found; after a healing,
    what the healing did (`heal.report.HealLineage`)."""

    hf_normswap_version: str
    source: SourceRecord
    lineage: list[dict]  # the records of the conversions that made the source, oldest first, without their lineage
    source_config: dict
    target_config: dict
    head: str
    swap: SwapRecord
    norm_mapping: str
    norm_sources: dict[str, str | None]
    calibration: CalibrationRecord | None
    tolerance: Tolerance
    notes: list[str]
    weights: WeightsRecord
    tokenizer: TokenizerRecord
    memory: MemoryRecord
    verification: Verification  # its fields sit at the top level of conversion.json
    heal: dict | None = None  # written last, where a healing made this folder

    FILE = "conversion.json"
    INDENT = 2
    ERROR = ConversionError

    def to_dict(self) -> dict:
        record = asdict(self)
        heal = record.pop("heal")
        record.update(record.pop("verification"))
        return record | ({"heal": heal} if heal is not None else {})

    @classmethod
    def from_dict(cls, fields: dict) -> "ConversionRecord":
        """The record of `to_dict`'s `fields`: Verification's gathered from the top level."""
        names = [field.name for field in dataclass_fields(Verification)]
        verification = {name: fields[name] for name in names if name in fields}
        return from_fields(cls, fields | {"verification": verification})

    def lineage_records(self) -> list["ConversionRecord"]:
        """The records of `lineage`, typed, oldest first."""
        return [ConversionRecord.from_dict(entry) for entry in self.lineage or []]


def convert_checkpoint(source: str, output: str, *, overwrite: bool = False, log=print, **options) -> dict:
    """Converts SOURCE (folder, Hub id, GGUF file, or a name of `gguf.SHIPPED_MODELS` such as `smollm2`) to a NormSwap
    checkpoint in OUTPUT and returns the conversion report.

    `options` are the fields of `ConvertOptions`. `attention` defaults to the source's own (causal for a causal LM
    family). With `calibrate`, a swap that turns norms writing the residual stream into norms reading it has
    its sublayers' writes scaled and its output projections refitted against the source (see `convert.calibration`).
    A GGUF file is read as a float32 checkpoint in a temporary folder that lasts the conversion.
    """
    options = ConvertOptions(**options)
    check_output(output=output, overwrite=overwrite)  # before a download
    source = shipped_model(source)
    with local_checkpoint(source, log=log) as folder:
        plan = plan_conversion(source=folder, options=options)
        plan.source = source  # as given, also for a GGUF file
        record = _convert(plan, options, output=output, overwrite=overwrite, log=log)
    log(f"wrote {output}")
    return record


def _convert(plan: ConversionPlan, options: ConvertOptions, *, output: str, overwrite: bool, log) -> dict:
    """Writes, calibrates, verifies and records the conversion `plan` in OUTPUT; returns the conversion report."""
    with output_folder(output=output, overwrite=overwrite) as staging:
        with peak_memory() as write_peak:
            weights, tokenizer, target_config = _write(plan, staging)
        low_memory = _low_memory(plan, options, log)
        if low_memory:
            release_freed_memory()  # layers are allocated and freed over and over: the heap would keep them
        with peak_memory() as calibrate_peak:
            plain_model, calibration = _calibrate(plan, options, staging, weights, low_memory, log)
        if calibration is not None and calibration.removed_norm_rms is not None:
            plan.target.save_pretrained(staging)  # with the constants the norm-free conversion removed
            target_config = plan.target.to_dict()
        folded, head_took_final_norm = None, False
        if options.fold_norm_weights:
            folded, head_took_final_norm = _fold_norm_weights(plan, staging, weights, log)
        with peak_memory() as verify_peak:
            if options.verify:
                verification = verify_conversion(
                    plan=plan,
                    plain_model=plain_model or load_unswapped_model(plan, low_memory),
                    folder=staging,
                    compare_logits=plan.head != "base" and not weights.initialized_at_load,
                    log=log,
                    low_memory=low_memory,
                    layer_gates=calibration.layer_gates(plan.target) if calibration else None,
                    head_took_final_norm=head_took_final_norm,
                )
            else:
                verification = Verification()
                log("verification skipped (--no-verify)")
        memory = MemoryRecord(
            write_mib=write_peak.mib,
            calibrate_mib=calibrate_peak.mib if calibration is not None else None,
            verify_mib=verify_peak.mib if options.verify else None,
            measured_by=write_peak.method,
            low_memory=low_memory,
        )
        record = _record(
            plan,
            options,
            target_config=target_config,
            weights=weights,
            tokenizer=tokenizer,
            calibration=calibration,
            verification=verification,
            memory=memory,
            folded=folded,
        )
        record.write(staging)
    return record.to_dict()


def _write(plan: ConversionPlan, staging: Path) -> tuple[WeightsRecord, TokenizerRecord, dict]:
    """Writes the weights, the tokenizer, the configuration and the model code; returns the configuration written."""
    weights = write_weights(plan=plan, folder=staging)
    tokenizer = _write_tokenizer(plan, staging)
    plan.target.save_pretrained(staging)
    copy_remote_code(staging)
    return weights, tokenizer, plan.target.to_dict()


def _write_tokenizer(plan: ConversionPlan, staging: Path) -> TokenizerRecord:
    """Copies the tokenizer and a sentence-transformers pipeline around the model; a causal family's tokenizer is
    saved as Transformers loads it, with EOS as pad if it had none."""
    folder = plan.folder
    resave = plan.family.causal and any((folder / name).exists() for name in TOKENIZER_FILES)
    copied = copy_companion_files(folder=folder, destination=staging, tokenizer=not resave)
    pipeline = [name for name in copied if name not in TOKENIZER_FILES]
    if not resave:
        files = [name for name in copied if name in TOKENIZER_FILES]
        if files:
            _name_tokenizer_class(folder, staging)
            files += [] if "tokenizer_config.json" in files else ["tokenizer_config.json"]
        return TokenizerRecord(files=files, pad_token_added=None, sentence_transformers=pipeline)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    added = None
    if tokenizer.pad_token is None and (tokenizer.eos_token or tokenizer.unk_token):
        tokenizer.pad_token = added = tokenizer.eos_token or tokenizer.unk_token
    files = sorted(Path(name).name for name in tokenizer.save_pretrained(staging))
    return TokenizerRecord(files=files, pad_token_added=added, sentence_transformers=pipeline)


def _name_tokenizer_class(source: Path, staging: Path) -> None:
    """Writes the class the source's tokenizer loads as into the copied `tokenizer_config.json` where it names none:
    `AutoTokenizer` finds the class of a source with a built-in `model_type` from that type, but a NormSwap folder's
    type names no tokenizer, and without the key it would load a generic one."""
    path = staging / "tokenizer_config.json"
    fields = json.loads(path.read_text()) if path.exists() else {}
    if "tokenizer_class" not in fields:
        fields["tokenizer_class"] = type(AutoTokenizer.from_pretrained(source)).__name__.removesuffix("Fast")
        path.write_text(json.dumps(fields, indent=2) + "\n")


def _low_memory(plan: ConversionPlan, options: ConvertOptions, log) -> bool:
    """`options.low_memory`, or whether the source's safetensors weights, held WHOLE_MODEL_COPIES times, would not fit
    in the available memory."""
    if options.low_memory is not None:
        return options.low_memory
    safetensors = all(file.suffix == ".safetensors" for file in plan.files)
    size = sum(file.stat().st_size for file in plan.files)
    low_memory = safetensors and size * WHOLE_MODEL_COPIES > available_memory()
    if low_memory:
        held = f"{size / 2**30:.1f} GiB of weights x {WHOLE_MODEL_COPIES}"
        log(f"calibrating one layer and verifying one module at a time: {held} would not fit")
    return low_memory


def _calibrate(
    plan: ConversionPlan, options: ConvertOptions, staging: Path, weights: WeightsRecord, low_memory: bool, log
) -> tuple[nn.Module | None, CalibrationRecord | None]:
    """Calibrates the written model against the unswapped one where the swap needs it (norms that started at identity
    are then calibrated); returns the unswapped model, if it was loaded, and what calibration did."""
    if not options.calibrate or plan.exact_swap:
        return None, None
    sublayers = calibrated_sublayers(
        target=plan.target, norm_sources=plan.norm_sources, source_slots=norm_slots(plan.plain)
    )
    if (
        not sublayers
        and not calibrates_stream(plan.plain, plan.target)
        and not calibrates_branches(plan.plain, plan.target)
    ):
        return None, None
    plain_model = load_unswapped_model(plan, low_memory)
    calibration, calibrated = calibrate_checkpoint(
        folder=staging,
        head=plan.head,
        source_model=plain_model,
        target=plan.target,
        norm_sources=plan.norm_sources,
        sublayers=sublayers,
        log=log,
        model=load_written(staging, plan.head, low_memory),
    )
    weights.mark_calibrated(calibrated)
    if folds_input_norms(plan.plain, plan.target):
        weights.mark_folded()
    return plain_model, calibration


def _fold_norm_weights(plan: ConversionPlan, staging: Path, weights: WeightsRecord, log) -> tuple[str, bool]:
    """Folds the written model's norm gains into the layers reading them (`norm_weight_folding`); returns the note and
    whether the head took the final norm's."""
    model = load_pretrained(HEAD_CLASSES[plan.head], staging, low_memory=False)
    kept = fold_norm_weights(model)
    weights.mark_calibrated(write_back(model, staging))
    note = "the norm gains and biases are folded into the linear layers reading them (FlashNorm)" + (
        f"; {', '.join(kept)} keeps its gain, its head tied to the embeddings or not a causal LM's" if kept else ""
    )
    log(note)
    return note, plan.target.final_norm and not kept


def _record(
    plan: ConversionPlan,
    options: ConvertOptions,
    *,
    target_config: dict,
    weights: WeightsRecord,
    tokenizer: TokenizerRecord,
    calibration: CalibrationRecord | None,
    verification: Verification,
    memory: MemoryRecord,
    folded: str | None = None,
) -> ConversionRecord:
    plain, target = plan.plain, plan.target
    return ConversionRecord(
        hf_normswap_version=version("hf-normswap"),
        source=SourceRecord(
            id=plan.source,
            revision=plan.revision,
            model_type=plan.source_config.model_type,
            architecture=plan.architecture,
            license=_source_license(plan.folder),
        ),
        lineage=_lineage(plan.folder),
        source_config=plan.source_config.to_dict(),
        target_config=target_config,
        head=plan.head,
        swap=SwapRecord(
            norm_placement=[plain.norm_placement, target.norm_placement],
            position_embedding_type=[plain.position_embedding_type, target.position_embedding_type],
            attention=["causal" if plain.is_causal else "bidirectional", plan.attention],
            norm_type=[plain.norm_type, target.norm_type],
            exact_swap=plan.exact_swap,
        ),
        norm_mapping=options.norm_mapping,
        norm_sources=plan.norm_sources,
        calibration=calibration,
        tolerance=tolerance(),
        notes=_notes(plan, weights) + ([folded] if folded else []),
        weights=weights,
        tokenizer=tokenizer,
        memory=memory,
        verification=verification,
    )


def _notes(plan: ConversionPlan, weights: WeightsRecord) -> list[str]:
    offset = plan.family.norm_weight_offset
    if not offset or weights.dtype == "float32":
        return []
    return [
        f"the norm weights hold the source's {offset:g} + w, rounded to {weights.dtype}; the source adds in "
        "float32, so outputs differ slightly outside float32"
    ]


def _lineage(folder: Path) -> list[dict]:
    """The reports of the steps that made a NormSwap source (`conversion.json` and its own lineage), oldest first."""
    earlier = ConversionRecord.read(folder)
    if earlier is None:
        return []
    entry = earlier.to_dict()
    del entry["lineage"]
    return [*(earlier.lineage or []), entry]


def _source_license(folder: Path) -> str | None:
    """The license in the source's model card, if it has one."""
    try:
        return ModelCard.load(folder / "README.md", ignore_metadata_errors=True).data.license
    except (OSError, ValueError):
        return None

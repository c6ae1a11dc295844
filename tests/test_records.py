"""The records a checkpoint folder carries (conversion.json, heal.json) read back typed and written back unchanged."""

import dataclasses
import json

from hf_normswap import convert_checkpoint
from hf_normswap.convert.calibration import CalibrationRecord
from hf_normswap.convert.converter import ConversionRecord
from hf_normswap.convert.verification import Measured, Verification
from hf_normswap.heal.report import Budget, HealData, HealReport, NextTokenAgreement, Reconstruction, TeacherSampling

from helpers import save_source


def healing_report() -> HealReport:
    """A report with every nested record filled in."""
    return HealReport(
        teacher="teacher-folder",
        data=HealData(
            name="teacher",
            text_columns=["text"],
            train_rows=None,
            held_out_rows=8,
            sampling=TeacherSampling(temperature=1.0, length=16, count=None, reads=1),
        ),
        objective="kl",
        steps=2,
        learning_rate=1e-3,
        batch_size=4,
        max_length=16,
        packing=True,
        dropout=False,
        freeze_embeddings=True,
        swap_schedule="direct",
        seconds=1.5,
        measuring_seconds=0.5,
        tokens=128,
        resumed=False,
        teacher_collapse={"first_token": [0.1, 0.2], "mean": [0.3, 0.4]},
        masked_lm_loss=None,
        next_token=NextTokenAgreement(before={"kl": 1.0}, after={"kl": 0.5}),
        before=[{"token_cosine": 0.9}],
        after=[{"token_cosine": 0.95}],
        history=[{"step": 0, "token_cosine": 0.9}],
        log_history=[{"step": 1, "loss": 2.0}],
        reconstruction=Reconstruction(
            sequences=4, steps=3, learning_rate=1e-2, seconds=0.5, layer_errors=[[1.0, 0.5]], conversion=None
        ),
        budget=Budget(
            steps=2,
            tokens=None,
            seconds=None,
            development_texts=8,
            patience=1,
            development_kl=[{"step": 1, "kl": 0.7}],
            stopped_at=None,
        ),
    )


def test_records_read_typed_and_write_back_the_same_json(tmp_path):
    save_source(tmp_path / "bert", "bert", "Model")
    convert_checkpoint(str(tmp_path / "bert"), str(tmp_path / "pre"), norm_placement="pre", log=lambda line: None)
    conversion = ConversionRecord.read(tmp_path / "pre")
    assert isinstance(conversion.calibration, CalibrationRecord) and isinstance(conversion.verification, Verification)
    assert isinstance(conversion.verification.measured, Measured) and conversion.heal is None
    nested = ("source", "swap", "tolerance", "weights", "tokenizer", "memory")
    assert all(dataclasses.is_dataclass(getattr(conversion, name)) for name in nested)
    (tmp_path / "healed").mkdir()
    conversion.write(tmp_path / "healed")
    written = (tmp_path / "pre" / ConversionRecord.FILE).read_text()
    assert (tmp_path / "healed" / ConversionRecord.FILE).read_text() == written

    report = healing_report()
    report.write(tmp_path / "healed")
    assert HealReport.read(tmp_path / "healed") == report  # nested records of the same classes
    conversion.heal = dataclasses.asdict(report.lineage())
    conversion.write(tmp_path / "healed")
    assert ConversionRecord.read(tmp_path / "healed") == conversion
    expected = json.dumps(json.loads(written) | {"heal": conversion.heal}, indent=2) + "\n"  # the healing last
    assert (tmp_path / "healed" / ConversionRecord.FILE).read_text() == expected
    assert HealReport.read(tmp_path / "bert") is None and ConversionRecord.read(tmp_path / "bert") is None


def test_a_record_of_an_older_version_reads_with_defaults(tmp_path):
    """Fields an older heal.json lacks read as their defaults, or None; keys no field holds are ignored."""
    report = healing_report()
    lacking = ("swap_schedule", "next_token", "dtype", "budget")
    older = {key: value for key, value in report.to_dict().items() if key not in lacking} | {"retired": 1}
    (tmp_path / HealReport.FILE).write_text(json.dumps(older))
    read = HealReport.read(tmp_path)
    assert read.swap_schedule is None and read.next_token is None and read.budget is None
    assert read.dtype == "float32" and read.data == report.data and read.reconstruction == report.reconstruction

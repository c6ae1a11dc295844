"""A healing's resumable checkpoints (`checkpoint_dir`): the Trainer's `checkpoint-*`, the figures kept beside them
(`CheckpointedFigures`) and the record of the healing they belong to, so that a rerun resumes only its own."""

import contextlib
import json
import shutil
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import ClassVar

from ..checkpoint import file_above, made_folder
from ..records import JsonRecord
from .options import HealError, HealOptions
from .trainer import CheckpointedFigures


UNCHECKED_OPTIONS = ("checkpoint_dir", "max_seconds")  # a rerun may move the folder's name or give more time
UNCHECKED_SHARDING = ("activation_checkpointing",)  # or spend less memory on the same function
PATH_OPTIONS = ("teacher", "data", "data_dir", "fsdp_config")  # compared as the files they name, where they exist


@dataclass
class CheckpointedHealing(JsonRecord):
    """The healing a `checkpoint_dir`'s checkpoints belong to: the variant and the options, but those a rerun may
    change (`UNCHECKED_OPTIONS`, `UNCHECKED_SHARDING`), paths resolved."""

    FILE: ClassVar[str] = "healing.json"
    INDENT: ClassVar[int] = 1
    ERROR: ClassVar[type[ValueError]] = HealError

    variant: str
    options: dict

    @classmethod
    def of(cls, variant: str, options: HealOptions) -> "CheckpointedHealing":
        kept = {name: value for name, value in asdict(options).items() if name not in UNCHECKED_OPTIONS}
        kept["sharding"] = {name: value for name, value in kept["sharding"].items() if name not in UNCHECKED_SHARDING}
        for section in (kept, kept["sharding"]):
            section.update({name: _resolved(section[name]) for name in PATH_OPTIONS if name in section})
        return cls(variant=_resolved(variant), options=json.loads(json.dumps(kept, default=str)))

    def resumes(self, folder: Path) -> bool:
        """Whether this healing resumes from FOLDER's checkpoints; refused in one line where they are another's."""
        if blocking := file_above(folder):
            raise HealError(f"checkpoint_dir={str(folder)!r} is invalid: {blocking} is a file; give a folder")
        if not any(folder.glob("checkpoint-*")):
            return False
        kept = self.read(folder)
        if kept == self:
            return True
        if kept is None:
            why = f"no {self.FILE} says whose: written before hf_normswap kept one"
        else:
            names = sorted(set(self.options) | set(kept.options))
            options = [name for name in names if kept.options.get(name) != self.options.get(name)]
            why = "differing: " + ", ".join(["the variant"] * (kept.variant != self.variant) + options)
        raise HealError(
            f"checkpoint_dir={str(folder)!r} holds another healing's checkpoints ({why}); rerun that healing to "
            "resume it, or give another folder"
        )


def checkpoint_folder(options: HealOptions, output: str, healing: CheckpointedHealing) -> tuple[Path | None, bool]:
    """The options' `checkpoint_dir`, checked to be one a healing into OUTPUT may keep its checkpoints in (its own, if
    it holds any), and whether the healing resumes from them (`resumes`); None and False without one."""
    if options.checkpoint_dir is None:
        return None, False
    folder = Path(options.checkpoint_dir)
    if folder.resolve().is_relative_to(Path(output).resolve()):
        raise HealError(
            f"checkpoint_dir={options.checkpoint_dir!r} is invalid: inside OUTPUT, which the healing replaces; give a "
            "folder outside it"
        )
    return folder, healing.resumes(folder)


def _resolved(path: str | None) -> str | None:
    """PATH resolved where it names a file or folder, else as given (a Hub id, a GLUE task, none)."""
    return str(Path(path).resolve()) if path and Path(path).exists() else path


@contextlib.contextmanager
def kept_checkpoints(folder: Path | None, healing: CheckpointedHealing, main: bool, resumes: bool) -> Iterator[None]:
    """A healing with its checkpoints in `folder` (none: nothing kept): its record written there first (by the main
    process) unless it `resumes` (its record is this one); once the block succeeds, all it kept is removed; if it
    fails, its checkpoints stay for a rerun, and where it wrote none, the folders it made go too."""
    if folder is None or not main:
        yield
        return
    with made_folder(folder):
        if not resumes:
            healing.write(folder)
        try:
            yield
        except BaseException:
            if not any(folder.glob("checkpoint-*")):
                (folder / healing.FILE).unlink(missing_ok=True)
            raise
    remove_checkpoints(folder)


def remove_checkpoints(folder: Path) -> None:
    """Removes what a healing kept in `folder` (its `checkpoint_dir`): the Trainer's checkpoints, the figures beside
    them (`CheckpointedFigures`) and its record; the folder too if nothing else is in it."""
    for checkpoint in folder.glob("checkpoint-*"):
        shutil.rmtree(checkpoint, ignore_errors=True)
    for file in [CheckpointedHealing.FILE] + [figures.FILE for figures in CheckpointedFigures.__subclasses__()]:
        (folder / file).unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        folder.rmdir()

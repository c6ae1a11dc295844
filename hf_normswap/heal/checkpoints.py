"""A healing's resumable checkpoints (`checkpoint_dir`): the Trainer's `checkpoint-*`, the figures kept beside them
(`CheckpointedFigures`) and the record of the healing they belong to, so that a rerun resumes only its own."""

import contextlib
import json
import shutil
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import ClassVar

from ..records import JsonRecord
from .options import HealError, HealOptions
from .trainer import CheckpointedFigures


UNCHECKED_OPTIONS = ("checkpoint_dir", "max_seconds")  # a rerun may move the folder's name or give more time


@dataclass
class CheckpointedHealing(JsonRecord):
    """The healing a `checkpoint_dir`'s checkpoints belong to: the variant (its resolved path) and the options, but
    those a rerun may change (`UNCHECKED_OPTIONS`)."""

    FILE: ClassVar[str] = "healing.json"
    INDENT: ClassVar[int] = 1
    ERROR: ClassVar[type[ValueError]] = HealError

    variant: str
    options: dict

    @classmethod
    def of(cls, variant: str, options: HealOptions) -> "CheckpointedHealing":
        kept = {name: value for name, value in asdict(options).items() if name not in UNCHECKED_OPTIONS}
        return cls(variant=str(Path(variant).resolve()), options=json.loads(json.dumps(kept, default=str)))

    def resumes(self, folder: Path) -> bool:
        """Whether this healing resumes from FOLDER's checkpoints; refused in one line where they are another's."""
        if folder.exists() and not folder.is_dir():
            raise HealError(f"checkpoint_dir={str(folder)!r} is invalid: a file; give a folder")
        if not any(folder.glob("checkpoint-*")):
            return False
        kept = self.read(folder)
        if kept == self:
            return True
        if kept is None:
            why = f"no {self.FILE} says whose"
        else:
            options = [name for name in self.options if kept.options.get(name) != self.options[name]]
            why = "differing: " + ", ".join(["the variant"] * (kept.variant != self.variant) + options)
        raise HealError(
            f"checkpoint_dir={str(folder)!r} holds another healing's checkpoints ({why}): give another folder, or "
            "empty it to heal from the start"
        )


@contextlib.contextmanager
def kept_checkpoints(folder: Path | None, healing: CheckpointedHealing, main: bool) -> Iterator[None]:
    """A healing with its checkpoints in `folder` (none: nothing kept): its record written there first (by the main
    process); once the block succeeds, all it kept is removed; if it fails, its checkpoints stay for a rerun, and
    where it wrote none, the folders it made go too."""
    if folder is None or not main:
        yield
        return
    made = [path for path in (folder, *folder.parents) if not path.exists()]  # the innermost first
    folder.mkdir(parents=True, exist_ok=True)
    healing.write(folder)
    try:
        yield
    except BaseException:
        if not any(folder.glob("checkpoint-*")):
            (folder / healing.FILE).unlink(missing_ok=True)
            for path in made:
                with contextlib.suppress(OSError):
                    path.rmdir()
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

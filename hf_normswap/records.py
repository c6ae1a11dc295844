"""The JSON records a checkpoint folder carries (conversion.json, heal.json): dataclasses written as JSON objects and
read back as the same dataclasses."""

import dataclasses
import json
import types
import typing
from pathlib import Path
from typing import ClassVar


def from_fields(cls: type, fields: dict):
    """The dataclass `cls` built from `fields` (its JSON object), nested dataclasses, lists and dicts of them
    included. Keys `cls` has no field for are ignored; a field a file of an older version lacks gets its default,
    or None where it has none. Values are not converted: a value of another shape than its field's is kept as read."""
    hints = typing.get_type_hints(cls)
    values = {}
    for field in dataclasses.fields(cls):
        if field.name in fields:
            values[field.name] = _typed(hints[field.name], fields[field.name])
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            values[field.name] = None
    return cls(**values)


def _typed(hint, value):
    """`value` read as type `hint`: the dataclasses it holds built (`from_fields`)."""
    origin, arguments = typing.get_origin(hint), typing.get_args(hint)
    if value is None:
        return None
    if origin in (typing.Union, types.UnionType):
        present = [argument for argument in arguments if argument is not type(None)]
        return _typed(present[0], value) if len(present) == 1 else value
    if dataclasses.is_dataclass(hint) and isinstance(value, dict):
        return from_fields(hint, value)
    if origin is list and arguments and isinstance(value, list):
        return [_typed(arguments[0], item) for item in value]
    if origin is dict and arguments and isinstance(value, dict):
        return {key: _typed(arguments[1], item) for key, item in value.items()}
    return value


class JsonRecord:
    """A dataclass kept as FILE in a checkpoint folder, as its `to_dict` indented by INDENT; an invalid file is
    reported as ERROR."""

    FILE: ClassVar[str]
    INDENT: ClassVar[int]
    ERROR: ClassVar[type[ValueError]] = ValueError

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, fields: dict):
        """The record of `to_dict`'s `fields` (`from_fields`)."""
        return from_fields(cls, fields)

    @classmethod
    def read(cls, folder: str | Path):
        """FOLDER's record, or None where it has none."""
        path = Path(folder) / cls.FILE
        if not path.exists():
            return None
        try:
            return cls.from_dict(json.loads(path.read_text()))
        except json.JSONDecodeError as error:
            raise cls.ERROR(f"{path}: not valid JSON ({error})") from None

    def write(self, folder: str | Path) -> None:
        (Path(folder) / self.FILE).write_text(json.dumps(self.to_dict(), indent=self.INDENT, default=str) + "\n")

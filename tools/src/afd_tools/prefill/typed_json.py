"""Reading a frozen dataclass back from the JSON it wrote, field by field, with an error that
names the file and the field: the checks behind the reports' ``from_json``."""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from afd_protocol import AFDError

T = TypeVar("T")

_NON_FINITE = {"nan", "inf", "-inf"}
"""How :func:`afd_tools.outputs.json_safe` writes a float that is not finite."""


class ReportError(AFDError, ValueError):
    """A report file that is not what its schema says; the message names the file and the
    field."""


def field_error(where: str, name: str, why: str) -> ReportError:
    return ReportError(f"{where}: field {name!r} {why}")


def _describe(hint: Any) -> str:
    return getattr(hint, "__name__", None) or str(hint)


def check_value(value: Any, hint: Any, where: str, name: str) -> Any:
    """``value`` as type ``hint`` (``int``, ``float``, ``str``, ``bool``, ``None``,
    ``X | Y``, ``list[X]``, ``tuple[X, ...]``, ``dict[str, X]``, ``Any``); a
    :class:`ReportError` naming ``name`` when it is not one."""
    origin = typing.get_origin(hint)
    if hint is Any:
        return value
    if origin is typing.Union or origin is types.UnionType:
        for option in typing.get_args(hint):
            try:
                return check_value(value, option, where, name)
            except ReportError:
                continue
        raise field_error(where, name, f"must be {_describe(hint)}, got {value!r:.80}")
    if hint is type(None) or hint is None:
        if value is None:
            return None
    elif hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif hint is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str) and value in _NON_FINITE:
            return float(value)
    elif hint is str:
        if isinstance(value, str):
            return value
    elif origin is list or origin is tuple:
        if isinstance(value, list | tuple):
            (item,) = typing.get_args(hint)[:1]
            items = [check_value(v, item, where, f"{name}[{i}]") for i, v in enumerate(value)]
            return items if origin is list else tuple(items)
    elif origin is dict:
        if isinstance(value, dict):
            _, item = typing.get_args(hint)
            out = {}
            for key, v in value.items():
                if not isinstance(key, str):
                    raise field_error(where, name, f"has a key that is not a string: {key!r}")
                out[key] = check_value(v, item, where, f"{name}.{key}")
            return out
    else:
        raise TypeError(f"check_value: no check for {hint!r}")
    raise field_error(where, name, f"must be {_describe(hint)}, got {value!r:.80}")


FieldReader = Callable[[Any, str, str], Any]
"""Reads one field's JSON value: ``(value, where, name) -> value``, raising a
:class:`ReportError` that names ``where`` and ``name``."""


def dataclass_from_json(
    cls: type[T],
    obj: Any,
    where: str,
    name: str,
    readers: Mapping[str, FieldReader] | None = None,
) -> T:
    """An instance of the dataclass ``cls`` from the JSON object ``obj``: every field
    present with its declared type (fields with a default may be missing); a field named
    in ``readers`` is read by its reader instead (a typed object within the object)."""
    if not isinstance(obj, dict):
        raise field_error(where, name, f"must be an object, got {obj!r:.80}")
    hints = typing.get_type_hints(cls)
    values = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        label = f"{name}.{f.name}" if name else f.name
        if f.name not in obj:
            has_default = (
                f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
            )
            if has_default:
                continue
            raise field_error(where, label, "is missing")
        if readers is not None and f.name in readers:
            values[f.name] = readers[f.name](obj[f.name], where, label)
        else:
            values[f.name] = check_value(obj[f.name], hints[f.name], where, label)
    return cls(**values)

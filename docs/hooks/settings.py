"""The settings tables, generated from the code: `AppArgs` (serve_config.yaml's `args:`, a pydantic
model: each field's `description`) and `EngineConfig` (a dataclass: each field's `doc` metadata).
A field without a description fails the docs build and tests/docs/test_docs.py."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

from annotated_types import Ge, Gt, Le, Lt
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

SETTINGS = ("AppArgs", "EngineConfig")
_BOUNDS = ((Ge, "ge", "≥"), (Gt, "gt", ">"), (Le, "le", "≤"), (Lt, "lt", "<"))
GiB = 1 << 30
MiB = 1 << 20


class MissingDescription(ValueError):
    """A settings field has no description for the docs."""


def _value(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, int) and value >= MiB and value % MiB == 0:
        return f"{value // GiB} GiB" if value % GiB == 0 else f"{value // MiB} MiB"
    if isinstance(value, int | float):
        return f"`{value}`"
    if isinstance(value, dict | list) and not value:
        return f"`{value}`"
    return f"`{value}`"


def _type(annotation: Any) -> str:
    if isinstance(annotation, str):
        return annotation
    if typing.get_origin(annotation) is typing.Literal:
        return " | ".join(f'"{arg}"' for arg in typing.get_args(annotation))
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, type(int | None)):
        return " | ".join(_type(arg) for arg in args)
    if args:
        return f"{typing.get_origin(annotation).__name__}[{', '.join(_type(arg) for arg in args)}]"
    if annotation is type(None):
        return "None"
    return "Any" if annotation is typing.Any else getattr(annotation, "__name__", str(annotation))


def _bounds(info: FieldInfo) -> str:
    shown = []
    for constraint in info.metadata:
        for kind, attribute, symbol in _BOUNDS:
            if isinstance(constraint, kind):
                shown.append(f"{symbol} {getattr(constraint, attribute)}")
    return ", ".join(shown)


def _table(rows: list[list[str]]) -> str:
    lines = ["| setting | type | default | meaning |", "|---|---|---|---|"]
    return "\n".join(
        lines + ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    )


def app_args_rows() -> list[list[str]]:
    from deployments.app_args import AppArgs

    rows = []
    for name, info in AppArgs.model_fields.items():
        if not info.description:
            raise MissingDescription(f"AppArgs.{name} has no description (Field(description=...))")
        if info.default is PydanticUndefined and info.default_factory is not None:
            default = _value(info.default_factory())  # type: ignore[call-arg]
        else:
            default = _value(info.default)
        kind = _type(info.annotation)
        bounds = _bounds(info)
        rows.append([f"`{name}`", kind + (f", {bounds}" if bounds else ""), default, info.description])
    return rows


def _device_default(name: str, default: Any) -> str:
    from replica_engine.config import CPU_DEFAULTS, GPU_DEFAULTS

    if name not in CPU_DEFAULTS and name not in GPU_DEFAULTS:
        return _value(default)

    def per_device(key: str) -> str:
        tables = (("CPU", CPU_DEFAULTS), ("GPU", GPU_DEFAULTS))
        return " / ".join(f"{_value(table[key])} {device}" for device, table in tables if key in table)

    offline = f"offline_{name}"
    if offline in CPU_DEFAULTS or offline in GPU_DEFAULTS:
        return f"serving: {per_device(name)}; `LLM`: {per_device(offline)}"
    return per_device(name)


def engine_config_rows() -> list[list[str]]:
    from replica_engine.config import EngineConfig

    rows = []
    for field in dataclasses.fields(EngineConfig):
        doc = field.metadata.get("doc")
        if not doc:
            raise MissingDescription(f"EngineConfig.{field.name} has no description (metadata doc)")
        default = field.default if field.default is not dataclasses.MISSING else None
        rows.append([f"`{field.name}`", _type(field.type), _device_default(field.name, default), doc])
    return rows


def render(which: str) -> str:
    if which == "AppArgs":
        from deployments.app_args import SAMPLING_DEFAULTS

        sampling = ", ".join(f"`{name}`" for name in sorted(SAMPLING_DEFAULTS))
        return _table(app_args_rows()) + f"\n\n`sampling_defaults` takes: {sampling}."
    if which == "EngineConfig":
        from deployments.app_args import ENGINE_KNOBS
        from replica_engine.config import EngineConfig

        left_out = sorted({f.name for f in dataclasses.fields(EngineConfig)} - ENGINE_KNOBS)
        note = ", ".join(f"`{name}`" for name in left_out)
        return _table(engine_config_rows()) + f"\n\nUnder a deployment's `engine:`, every field but {note}."
    raise ValueError(f"unknown settings {which!r}; known: {SETTINGS}")

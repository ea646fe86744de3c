"""Settings defined once: default, one-line documentation and range in one place.

A config class is a dataclass whose tunable fields are declared with
``setting(default, doc, ...)``; the range (``gt``/``ge``/``choices``/
``nonempty``) sits in the field's metadata, ``check_settings`` enforces it,
and ``metalog.broker.server.config`` builds the YAML schema, ``--help-config`` and
docs/config.md from the same metadata. Fields declared without ``setting``
are not user settings (e.g. the node identity the driver fills into
``QuorumConfig``).

Pure: no IO, so the quorum core can check its own config.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from metalog.protocol.invariants import invariant

_KEY = "metalog_setting"


@dataclasses.dataclass(frozen=True, slots=True)
class SettingSpec:
    doc: str
    gt: float | None = None
    ge: float | None = None
    choices: tuple[Any, ...] | None = None
    nonempty: bool = False
    note: str = ""  # what the boundary value means, e.g. "0 = off"
    le: float | None = None


def setting(default: Any = dataclasses.MISSING, doc: str = "", *, default_factory: Any = dataclasses.MISSING,
            gt: float | None = None, ge: float | None = None, choices: tuple[Any, ...] | None = None,
            nonempty: bool = False, note: str = "", le: float | None = None) -> Any:
    """A dataclass field that is a user setting (no default: required)."""
    invariant(doc, "every setting needs a one-line description")
    spec = SettingSpec(doc, gt, ge, choices, nonempty, note, le)
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata={_KEY: spec})
    return dataclasses.field(default=default, metadata={_KEY: spec})


def setting_fields(cls: type[Any]) -> list[tuple[dataclasses.Field[Any], SettingSpec]]:
    """The fields of a config class that are user settings, in declaration order."""
    return [(f, f.metadata[_KEY]) for f in dataclasses.fields(cls) if _KEY in f.metadata]


def check_settings(obj: Any) -> tuple[str, str] | None:
    """The first setting of `obj` outside its declared range, as (key, why)."""
    for f, spec in setting_fields(type(obj)):
        value = getattr(obj, f.name)
        why = _check(spec, value)
        if why is not None:
            return f.name, why
    return None


def _check(spec: SettingSpec, value: Any) -> str | None:
    note = f" ({spec.note})" if spec.note else ""
    if spec.nonempty and (value is None or not str(value).strip()):
        return "must not be empty"
    if value is None:
        return None  # optional, not given
    if spec.gt is not None and not value > spec.gt:
        return f"must be > {spec.gt:g}{note}, got {value}"
    if spec.ge is not None and not value >= spec.ge:
        return f"must be >= {spec.ge:g}{note}, got {value}"
    if spec.le is not None and not value <= spec.le:
        return f"must be <= {spec.le:g}{note}, got {value}"
    if spec.choices is not None and value not in spec.choices:
        return f"must be one of {'/'.join(map(str, spec.choices))}, got {value!r}"
    return None

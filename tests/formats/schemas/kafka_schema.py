"""A reader and writer driven by Kafka's JSON message schemas (test only).

Interprets a metadata record schema (tests/formats/schemas/*.json, see the
README there) as Kafka's generated classes do for a flexible version: fields
in declaration order, those present at the version; int8..int64, uint16,
bool, uuid as 16 bytes, compact (nullable) strings and arrays of scalars or
inline structs; tagged fields (taggedVersions) in a trailing section, in tag
order, written only when not at their default. Written without looking at
storage/metadata_records.py, to check it. Values are plain Python: ints,
bools, str, None, bytes (uuid), lists, dicts (structs) keyed by field name.
"""

from __future__ import annotations

import json
import os
import re
import struct

HERE = os.path.dirname(os.path.abspath(__file__))
_INTS = {"int8": ">b", "int16": ">h", "int32": ">i", "int64": ">q", "uint16": ">H"}


def load(name: str) -> dict:
    """The schema of e.g. "TopicRecord", comments stripped."""
    with open(os.path.join(HERE, f"{name}.json")) as fh:
        text = "\n".join(line for line in fh.read().splitlines() if not line.lstrip().startswith("//"))
    return json.loads(text)


def in_range(spec: str | None, version: int) -> bool:
    if not spec or spec == "none":
        return False
    if spec.endswith("+"):
        return version >= int(spec[:-1])
    lo, _, hi = spec.partition("-")
    return int(lo) <= version <= int(hi or lo)


def versions(schema: dict) -> range:
    lo, _, hi = schema["validVersions"].partition("-")
    return range(int(lo), int(hi or lo) + 1)


def default_of(field: dict):
    d = field.get("default")
    t = field["type"]
    if t.startswith("[]"):
        return None if d == "null" else []
    if t in _INTS:
        return int(d) if d is not None else 0
    if t == "bool":
        return d == "true"
    if t == "uuid":
        return bytes(16)
    if t == "string":
        return None if d == "null" else (d or "")
    raise ValueError(f"no default for type {t}")


def _uv(out: bytearray, v: int) -> None:
    while v >= 0x80:
        out.append((v & 0x7F) | 0x80)
        v >>= 7
    out.append(v)


def _write_value(out: bytearray, field: dict, t: str, value, version: int) -> None:
    if t in _INTS:
        out += struct.pack(_INTS[t], value)
    elif t == "bool":
        out.append(1 if value else 0)
    elif t == "uuid":
        assert len(value) == 16
        out += value
    elif t == "string":
        if value is None:
            out.append(0)
        else:
            raw = value.encode()
            _uv(out, len(raw) + 1)
            out += raw
    elif t.startswith("[]"):
        if value is None:
            out.append(0)
            return
        _uv(out, len(value) + 1)
        inner = t[2:]
        for item in value:
            if inner in _INTS or inner in ("uuid", "string", "bool"):
                _write_value(out, field, inner, item, version)
            else:
                _write_struct(out, field["fields"], item, version)
    else:
        raise ValueError(f"type {t}")


def _write_struct(out: bytearray, fields: list[dict], values: dict, version: int) -> None:
    tagged = []
    for f in fields:
        if not in_range(f["versions"], version):
            continue
        value = values.get(f["name"], default_of(f))
        if "tag" in f and in_range(f.get("taggedVersions"), version):
            if value != default_of(f):
                raw = bytearray()
                _write_value(raw, f, f["type"], value, version)
                tagged.append((int(f["tag"]), bytes(raw)))
            continue
        _write_value(out, f, f["type"], value, version)
    _uv(out, len(tagged))
    for tag, raw in sorted(tagged):
        _uv(out, tag)
        _uv(out, len(raw))
        out += raw


def write(schema: dict, values: dict, version: int = 0) -> bytes:
    """The record framed as ApiMessageAndVersion (frame 1, api key, version)."""
    assert version in versions(schema)
    out = bytearray()
    _uv(out, 1)
    _uv(out, schema["apiKey"])
    _uv(out, version)
    _write_struct(out, schema["fields"], values, version)
    return bytes(out)


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def take(self, n: int) -> bytes:
        assert self.pos + n <= len(self.data), "truncated"
        raw = self.data[self.pos:self.pos + n]
        self.pos += n
        return raw

    def uv(self) -> int:
        v = shift = 0
        while True:
            b = self.take(1)[0]
            v |= (b & 0x7F) << shift
            if b < 0x80:
                return v
            shift += 7

    def value(self, field: dict, t: str, version: int):
        if t in _INTS:
            fmt = _INTS[t]
            return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]
        if t == "bool":
            return self.take(1)[0] != 0
        if t == "uuid":
            return self.take(16)
        if t == "string":
            n = self.uv()
            return None if n == 0 else self.take(n - 1).decode()
        if t.startswith("[]"):
            n = self.uv()
            if n == 0:
                return None
            inner = t[2:]
            if inner in _INTS or inner in ("uuid", "string", "bool"):
                return [self.value(field, inner, version) for _ in range(n - 1)]
            return [self.struct(field["fields"], version) for _ in range(n - 1)]
        raise ValueError(f"type {t}")

    def struct(self, fields: list[dict], version: int) -> dict:
        out: dict = {}
        by_tag = {}
        for f in fields:
            if not in_range(f["versions"], version):
                continue
            if "tag" in f and in_range(f.get("taggedVersions"), version):
                by_tag[int(f["tag"])] = f
                out[f["name"]] = default_of(f)
                continue
            out[f["name"]] = self.value(f, f["type"], version)
        for _ in range(self.uv()):
            tag, size = self.uv(), self.uv()
            raw = self.take(size)
            f = by_tag.get(tag)
            if f is None:
                out.setdefault("_unknown_tags", {})[tag] = raw
                continue
            sub = _Reader(raw)
            out[f["name"]] = sub.value(f, f["type"], version)
            assert sub.pos == len(raw), f"tagged field {f['name']}: trailing bytes"
        return out


def read(schema: dict, value: bytes) -> tuple[int, dict]:
    """(version, fields) of a framed record of this schema; AssertionError if
    the bytes do not follow it exactly."""
    r = _Reader(value)
    assert r.uv() == 1, "frame version"
    assert r.uv() == schema["apiKey"], "api key"
    version = r.uv()
    assert version in versions(schema), f"version {version}"
    fields = r.struct(schema["fields"], version)
    assert r.pos == len(value), f"{len(value) - r.pos} bytes after the record"
    return version, fields


def snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()

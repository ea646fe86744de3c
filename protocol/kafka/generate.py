"""Generate ``messages.py`` from Kafka's JSON message schemas (``schemas/``).

    python -m metalog.protocol.kafka.generate            # rewrites messages.py
    python -m metalog.protocol.kafka.generate --out F    # writes F instead

It reads Kafka's vendored schemas (``schemas/``) first, then metalog's own
extension messages in the same format (``schemas_metalog/``: apis Kafka has
no counterpart for, under api keys outside Kafka's range; a schema there
that reuses a key already read is refused). ``METALOG_API_KEYS`` in the
output lists the extension keys.

The rules are Kafka's (read from its generator, org.apache.kafka.message):

* ``validVersions`` / ``versions`` / ``nullableVersions`` / ``taggedVersions``
  / ``flexibleVersions`` are ranges: ``"3+"``, ``"0-5"``, ``"7"``, ``"none"``.
  A field is on the wire in the versions of its ``versions`` range only;
  nested structs are written with the message's version.
* Flexible versions (KIP-482) use compact strings, bytes and arrays (unsigned
  varint of length + 1, 0 = null) and end every struct with a tagged-field
  section: a count, then (tag, size, data) per field in tag order. A tagged
  field is written when its value is not its default; tags a reader does not
  know are skipped. A field may override the message's ``flexibleVersions``
  (the request header's ClientId keeps its int16 length for good).
* A field absent from a version must hold its default there, unless it is
  ``ignorable``: otherwise encoding raises UnsupportedVersionError.
* ``default`` is the field's default (``"null"`` for a nullable one); without
  it: 0, false, "", empty bytes, an empty array, the all-zero UUID, a struct
  of defaults; records default to null.
* Struct types are declared inline (``"fields"``) or in ``commonStructs``;
  ``[]T`` is an array. ``entityType``, ``mapKey``, ``about``, ``zeroCopy``
  and ``listeners`` do not change the encoding.

The output is straight-line Python per message, no schema looked at per
request. Each struct's versions are cut into *layouts* (runs of versions
whose untagged fields are on the wire alike); the newest layouts get a path
each under one ``if version >= N`` test, with no version test inside it and
their fixed-width neighbours packed by one ``struct.Struct``, as many as
keep the method within 100 lines (the older versions share one path with
the tests inside). A Python call costs
more than most of what the primitives do, so the common cases are inline:
a compact count, string or bytes whose length varint is one byte (two for
bytes and records), a UUID, a tagged field's one-byte tag and size, an
empty tagged section; anything else, and every error, goes through the
helper in ``primitives``, so the error texts are the helpers'. (A replica's
Fetch request took 93,000 instructions to decode before, 63,000 after;
callgrind: v17, one partition, three tagged fields.) Deterministic: the same
schemas give the same bytes (tests/protocol/kafka checks the committed file).
"""

from __future__ import annotations

import argparse
import json
import keyword
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from metalog.protocol.invariants import InvariantViolation

HERE = Path(__file__).resolve().parent
SCHEMA_DIR = HERE / "schemas"
METALOG_SCHEMA_DIR = HERE / "schemas_metalog"  # metalog's own extension messages (README.md there)
SCHEMA_DIRS = (SCHEMA_DIR, METALOG_SCHEMA_DIR)  # Kafka's first
OUTPUT = HERE / "messages.py"
INF = 1 << 15  # "N+": open-ended

# Fixed-width types: struct code, size, Python type.
FIXED = {
    "int8": ("b", 1, "int"),
    "int16": ("h", 2, "int"),
    "uint16": ("H", 2, "int"),
    "int32": ("i", 4, "int"),
    "uint32": ("I", 4, "int"),
    "int64": ("q", 8, "int"),
    "float64": ("d", 8, "float"),
    "bool": ("?", 1, "bool"),
}
SCALAR_READERS = {"b": "I8", "h": "I16", "H": "U16", "i": "I32", "I": "U32", "q": "I64", "d": "F64", "?": "BOOL"}
RESERVED = {"write", "read", "encode", "decode"}
# tests/test_rooms.py's bound on a function: the generated ones too.
FUNCTION_LINES_MAX = 100


# --- the schema model --------------------------------------------------------------


@dataclass(frozen=True)
class Range:
    lo: int
    hi: int

    @staticmethod
    def parse(text: str | None) -> Range:
        if text is None or text == "none":
            return Range(1, 0)
        if text.endswith("+"):
            return Range(int(text[:-1]), INF)
        if "-" in text:
            lo, hi = text.split("-")
            return Range(int(lo), int(hi))
        return Range(int(text), int(text))

    @property
    def empty(self) -> bool:
        return self.lo > self.hi

    def __and__(self, other: Range) -> Range:
        return Range(max(self.lo, other.lo), min(self.hi, other.hi))

    def contains(self, version: int) -> bool:
        return self.lo <= version <= self.hi

    def covers(self, other: Range) -> bool:
        return other.empty or (self.lo <= other.lo and other.hi <= self.hi)


@dataclass
class Field:
    name: str  # the schema's, CamelCase
    type: str  # as written: int32, []Foo, Foo, ...
    versions: Range
    nullable: Range
    tagged: Range
    tag: int | None
    ignorable: bool
    default: object
    flexible: Range | None  # a field-level override of the message's flexibleVersions
    struct: Struct | None = None  # the element or value type, when a struct

    @property
    def attr(self) -> str:
        snake = re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", self.name).lower()
        if keyword.iskeyword(snake):
            snake += "_"
        if snake in RESERVED:
            raise SystemExit(f"field {self.name} would shadow a method")
        return snake

    @property
    def is_array(self) -> bool:
        return self.type.startswith("[]")

    @property
    def elem(self) -> str:
        return self.type[2:] if self.is_array else self.type


@dataclass
class Struct:
    cls: str  # the Python class name
    fields: list[Field]
    versions: Range  # the versions the struct can appear in (the message's range, narrowed)
    flexible: Range
    message: Message | None = None  # set on the top-level struct only


@dataclass
class Message:
    name: str
    kind: str  # request, response, header
    api_key: int
    valid: Range
    flexible: Range
    top: Struct = field(init=False)
    structs: list[Struct] = field(default_factory=list)  # post-order: nested before users
    latest_unstable: bool = False
    source: str = "schemas"  # the folder it was read from (for the class docstring)


def load_json(path: Path) -> dict[str, object]:
    # Kafka's schemas carry // comments (its JSON reader allows them)
    text = "\n".join(line for line in path.read_text().splitlines() if not line.lstrip().startswith("//"))
    data: dict[str, object] = json.loads(text)
    return data


def parse_default(raw: object, ftype: str, nullable: Range) -> object:
    if ftype.startswith("[]"):
        return None if raw == "null" else []
    if raw == "null":
        return None
    if ftype in FIXED:
        code = FIXED[ftype][0]
        if raw is None or raw == "":
            return False if code == "?" else (0.0 if code == "d" else 0)
        if code == "?":
            return raw is True or raw == "true"
        if code == "d":
            return float(raw)  # type: ignore[arg-type]
        return int(str(raw), 0)
    if ftype == "string":
        return "" if raw is None else str(raw)
    if ftype == "bytes":
        return b""
    if ftype == "records":
        return None if not nullable.empty else b""
    if ftype == "uuid":
        return "ZERO_UUID"
    return "STRUCT"  # a struct: an instance of defaults


def parse_field(spec: dict[str, object], msg: str, common: dict[str, dict[str, object]],
                message: Message, within: Range) -> Field:
    ftype = str(spec["type"])
    versions = Range.parse(str(spec["versions"]))
    nullable = Range.parse(spec.get("nullableVersions"))  # type: ignore[arg-type]
    tagged = Range.parse(spec.get("taggedVersions"))  # type: ignore[arg-type]
    flex_text = spec.get("flexibleVersions")
    f = Field(
        name=str(spec["name"]), type=ftype, versions=versions, nullable=nullable, tagged=tagged,
        tag=int(spec["tag"]) if "tag" in spec else None,  # type: ignore[call-overload]
        ignorable=bool(spec.get("ignorable", False)),
        default=parse_default(spec.get("default"), ftype, nullable),
        flexible=Range.parse(str(flex_text)) if flex_text is not None else None,
    )
    elem = f.elem
    if elem not in FIXED and elem not in ("string", "bytes", "records", "uuid"):
        if "fields" in spec:
            sub = spec
        else:
            sub = common[elem]
        f.struct = build_struct(msg + elem, sub, msg, common, message, within & versions)
    return f


def build_struct(cls: str, spec: dict[str, object], msg: str, common: dict[str, dict[str, object]],
                 message: Message, within: Range) -> Struct:
    for existing in message.structs:
        if existing.cls == cls:  # a common struct used twice: one class, the widest range
            existing.versions = Range(min(existing.versions.lo, within.lo), max(existing.versions.hi, within.hi))
            return existing
    fields = [parse_field(s, msg, common, message, within) for s in spec.get("fields", [])]  # type: ignore[attr-defined]
    struct = Struct(cls=cls, fields=fields, versions=within, flexible=message.flexible)
    message.structs.append(struct)
    return struct


def load_message(path: Path) -> Message:
    data = load_json(path)
    name = str(data["name"])
    valid = Range.parse(str(data["validVersions"]))
    message = Message(
        name=name, kind=str(data["type"]), api_key=int(data.get("apiKey", -1)),  # type: ignore[call-overload]
        valid=valid, flexible=Range.parse(str(data.get("flexibleVersions", "none"))),
        latest_unstable=bool(data.get("latestVersionUnstable", False)),
    )
    common = {str(c["name"]): c for c in data.get("commonStructs", [])}  # type: ignore[attr-defined]
    message.top = build_struct(name, data, name, common, message, valid)
    message.top.message = message
    message.source = path.parent.name
    return message


def load_all(schema_dirs: tuple[Path, ...] = SCHEMA_DIRS) -> list[Message]:
    """Every schema of every folder, a folder's files in name order, the folders
    in the order given; an api key a later folder's schema reuses is refused
    (an extension may never shadow one of Kafka's apis)."""
    messages: list[Message] = []
    seen: dict[tuple[int, str], str] = {}
    for schema_dir in schema_dirs:
        for path in sorted(schema_dir.glob("*.json")):
            message = load_message(path)
            key = (message.api_key, message.kind)
            if message.api_key >= 0 and key in seen:
                raise SystemExit(f"{schema_dir.name}/{path.name}: api key {message.api_key} ({message.kind}) is "
                                 f"{seen[key]}'s already")
            seen[key] = message.name
            messages.append(message)
    return messages


# --- code generation ------------------------------------------------------------------


def cond(sub: Range, within: Range) -> str | None:
    """The test that ``version`` lies in ``sub``, knowing it lies in ``within`` (None: always)."""
    lo = sub.lo > within.lo
    hi = sub.hi < within.hi
    if lo and hi:
        return f"{sub.lo} <= version <= {sub.hi}" if sub.lo != sub.hi else f"version == {sub.lo}"
    if lo:
        return f"version >= {sub.lo}"
    if hi:
        return f"version <= {sub.hi}"
    return None


def py_type(f: Field) -> str:
    elem = f.elem
    if elem in FIXED:
        base = FIXED[elem][2]
    elif elem == "string":
        base = "str"
    elif elem in ("bytes", "records"):
        base = "BytesLike"
    elif elem == "uuid":
        base = "bytes"
    else:
        if f.struct is None:  # not assert: python -O drops it
            raise InvariantViolation(f"field {f.attr} is a struct but carries none")
        base = f.struct.cls
    if f.is_array:
        base = f"list[{base}]"
    nullable = not f.nullable.empty or f.default is None
    if elem in ("string", "bytes", "records") and not f.is_array:
        return f"{base} | None" if nullable else base
    return f"{base} | None" if nullable else base


def default_expr(f: Field) -> str:
    d = f.default
    if d is None:
        return "None"
    if f.is_array:
        return "[]"
    if d == "ZERO_UUID":
        return "ZERO_UUID"
    if d == "STRUCT":
        if f.struct is None:  # not assert: python -O drops it
            raise InvariantViolation(f"field {f.attr} is a struct but carries none")
        return f"_D_{f.struct.cls}"
    return repr(d)


def field_decl(f: Field) -> str:
    d = f.default
    if f.is_array and d is not None:
        value = "msgspec.field(default_factory=list)"
    elif d == "STRUCT":
        if f.struct is None:  # not assert: python -O drops it
            raise InvariantViolation(f"field {f.attr} is a struct but carries none")
        value = f"msgspec.field(default_factory={f.struct.cls})"
    else:
        value = default_expr(f)
    return f"    {f.attr}: {py_type(f)} = {value}"


def nondefault(f: Field, expr: str) -> str:
    d = f.default
    if d is None:
        return f"{expr} is not None"
    if f.is_array:
        return f"len({expr}) != 0" if f.nullable.empty else f"({expr} is None or len({expr}) != 0)"
    if f.elem in ("bytes", "records"):
        return f"({expr} is None or len({expr}) != 0)" if not f.nullable.empty else f"len({expr}) != 0"
    return f"{expr} != {default_expr(f)}"


def field_segments(f: Field, present: Range, s: Struct) -> list[tuple[Range, bool, bool]]:
    """The versions where the field is on the wire, cut where its encoding changes."""
    none = Range(1, 0)
    scalar = not f.is_array and (f.elem in FIXED or f.elem == "uuid")
    flexible = none if scalar or f.struct is not None and not f.is_array else (
        f.flexible if f.flexible is not None else s.flexible)
    return segments(present, flexible, none if scalar else f.nullable)


def segments(present: Range, flexible: Range, nullable: Range) -> list[tuple[Range, bool, bool]]:
    """``present`` cut where flexibility or nullability changes: (range, flexible, nullable)."""
    cuts = sorted({present.lo, present.hi + 1} | {
        v for v in (flexible.lo, flexible.hi + 1, nullable.lo, nullable.hi + 1) if present.lo < v <= present.hi
    })
    out: list[tuple[Range, bool, bool]] = []
    for lo, nxt in zip(cuts, cuts[1:]):
        variant = (flexible.contains(lo), nullable.contains(lo))
        if out and (out[-1][1], out[-1][2]) == variant:
            out[-1] = (Range(out[-1][0].lo, nxt - 1), *variant)
        else:
            out.append((Range(lo, nxt - 1), *variant))
    return out


class Code:
    """Lines of generated code, each optionally labelled with the field it reads."""

    def __init__(self) -> None:
        self.lines: list[tuple[str, str | None]] = []
        self.label: str | None = None
        self.structs: dict[str, str] = {}  # struct format -> constant name

    def __call__(self, depth: int, text: str) -> None:
        self.lines.append(("    " * depth + text, self.label))

    def packer(self, codes: str) -> str:
        name = self.structs.get(codes)
        if name is None:
            name = self.structs[codes] = f"_S_{codes.replace('?', 'o')}" if len(codes) > 1 else SCALAR_READERS[codes]
        return name


def inline_or_call(code: Code, d: int, test: str, inline: list[str], call: str) -> None:
    """``if test:`` the inline statements (the common case, no Python call),
    ``else:`` the primitive's call, which also raises every error; two lines,
    so that the methods' straight paths stay short enough to read at once."""
    code(d, f"if {test}: {'; '.join(inline)}")
    code(d, f"else: {call}")


def write_value(code: Code, d: int, f: Field, expr: str, out: str, flex: bool, nullable: bool,
                known_set: bool = False) -> None:
    """Statements appending ``expr`` (the field's value) to ``out`` (``known_set``:
    the caller has checked it is not null)."""
    elem = f.elem
    a, v, e = f"_a_{f.attr}", f"_v_{f.attr}", f"_e_{f.attr}"
    c = "c" if flex else ""
    if f.is_array:
        code(d, f"{a} = {expr}")
        if nullable:
            code(d, f"if {a} is None:")
            code(d + 1, f"{out}.append(0)" if flex else f'{out} += b"\\xff\\xff\\xff\\xff"')
            code(d, "else:")
            d += 1
        elif not known_set and (f.default is None or not f.nullable.empty):
            code(d, f"if {a} is None:")
            code(d + 1, f'raise null_error("{f.attr}", version)')
        if flex:  # a count below 127 is one byte: appended here, not by a call
            inline_or_call(code, d, f"len({a}) < 0x7F", [f"{out}.append(len({a}) + 1)"],
                           f"write_uvarint({out}, len({a}) + 1)")
        else:
            code(d, f"{out} += I32.pack(len({a}))")
        if elem in FIXED:
            fc = FIXED[elem][0]
            code(d, f'{out} += struct.pack(">%d{fc}" % len({a}), *{a})')
        elif elem == "string":
            code(d, f"for {e} in {a}:")
            code(d + 1, f"write_{c}str({out}, {e})")
        elif elem == "uuid":
            code(d, f"for {e} in {a}:")
            code(d + 1, f"write_uuid({out}, {e})")
        elif elem in ("bytes", "records"):
            code(d, f"for {e} in {a}:")
            code(d + 1, f"write_{c}bytes({out}, {e})")
        else:
            code(d, f"for {e} in {a}:")
            code(d + 1, f"{e}.write({out}, version)")
        return
    if elem in FIXED:
        code(d, f"{out} += {code.packer(FIXED[elem][0])}.pack({expr})")
    elif elem == "string" and flex:
        # A short ASCII string (below 127 bytes) here; null, longer or
        # non-ASCII ones (and a null where none may be) through the helper.
        code(d, f"{v} = {expr}")
        inline_or_call(code, d, f"{v} is not None and len({v}) < 0x7F and {v}.isascii()",
                       [f"{out}.append(len({v}) + 1)", f"{out} += {v}.encode()"],
                       f"write_{'n' if nullable else ''}{c}str({out}, {v})")
    elif elem == "string":
        code(d, f"write_{'n' if nullable else ''}{c}str({out}, {expr})")
    elif elem in ("bytes", "records"):
        code(d, f"write_{'n' if nullable else ''}{c}bytes({out}, {expr})")
    elif elem == "uuid":
        code(d, f"{v} = {expr}")
        inline_or_call(code, d, f"len({v}) == 16", [f"{out} += {v}"], f"write_uuid({out}, {v})  # the error")
    else:
        code(d, f"{v} = {expr}")
        if nullable:
            code(d, f"if {v} is None:")
            code(d + 1, f'{out} += b"\\xff"')
            code(d, "else:")
            code(d + 1, f"{out}.append(1)")
            code(d + 1, f"{v}.write({out}, version)")
        else:
            if not known_set and (f.default is None or not f.nullable.empty):
                code(d, f"if {v} is None:")
                code(d + 1, f'raise null_error("{f.attr}", version)')
            code(d, f"{v}.write({out}, version)")


def read_value(code: Code, d: int, f: Field, var: str, buf: str, flex: bool, nullable: bool) -> None:
    """Statements reading the field from ``buf`` at ``pos`` into ``var``."""
    elem = f.elem
    c = "c" if flex else ""
    n = "n" if nullable else ""
    if f.is_array:
        if flex:
            # A compact count below 127 is one byte: read here, not by a call
            # (a Python call costs more than the rest of this); else the helper.
            code(d, f"_b = {buf}[pos]")
            inline_or_call(code, d, f"{'' if nullable else '0 < '}_b < 0x80 and _b <= len({buf}) - pos",
                           ["_c = _b - 1", "pos += 1"], f"_c, pos = read_{n}{c}count({buf}, pos)")
        else:
            code(d, f"_c, pos = read_{n}{c}count({buf}, pos)")
        if nullable:
            code(d, "if _c < 0:")
            code(d + 1, f"{var} = None")
            code(d, "else:")
            d += 1
        if elem in FIXED:
            fc, size, _ = FIXED[elem]
            code(d, f'{var} = list(struct.unpack_from(">%d{fc}" % _c, {buf}, pos))')
            code(d, f"pos += {size} * _c")
            return
        code(d, f"{var} = []")
        code(d, "for _ in range(_c):")
        if elem == "string":
            code(d + 1, f"_s_{f.attr}, pos = read_{c}str({buf}, pos)")
        elif elem == "uuid":
            code(d + 1, f"_s_{f.attr}, pos = read_uuid({buf}, pos)")
        elif elem in ("bytes", "records"):
            code(d + 1, f"_s_{f.attr}, pos = read_{c}bytes({buf}, pos)")
        else:
            if f.struct is None:  # not assert: python -O drops it
                raise InvariantViolation(f"field {f.attr} is a struct but carries none")
            code(d + 1, f"_s_{f.attr}, pos = {f.struct.cls}.read({buf}, pos, version)")
        code(d + 1, f"{var}.append(_s_{f.attr})")
        return
    if elem in FIXED:
        fc, size, _ = FIXED[elem]
        code(d, f"{var} = {code.packer(fc)}.unpack_from({buf}, pos)[0]")
        code(d, f"pos += {size}")
    elif elem in ("string", "bytes", "records") and flex:
        # A short compact string or bytes (length below 127: one byte) inline;
        # null, longer ones and every error through the helper.
        kind = "str" if elem == "string" else "bytes"
        value = f"str({buf}[pos + 1:_e], 'utf-8')" if elem == "string" else f"{buf}[pos + 1:_e]"
        code(d, f"_b = {buf}[pos]")
        code(d, f"if 0 < _b < 0x80 and (_e := pos + _b) <= len({buf}):")
        code(d + 1, f"{var} = {value}")
        code(d + 1, "pos = _e")
        if kind == "bytes":  # records mostly: a length below 16 KiB is two bytes, read here too
            code(d, f"elif _b & 0x80 and (_b2 := {buf}[pos + 1]) < 0x80 and _b2 and "
                    f"(_e := pos + 1 + ((_b & 0x7F) | (_b2 << 7))) <= len({buf}):")
            code(d + 1, f"{var} = {buf}[pos + 2:_e]")
            code(d + 1, "pos = _e")
        code(d, "else:")
        code(d + 1, f"{var}, pos = read_{n}c{kind}({buf}, pos)")
    elif elem == "string":
        code(d, f"{var}, pos = read_{n}{c}str({buf}, pos)")
    elif elem in ("bytes", "records"):
        code(d, f"{var}, pos = read_{n}{c}bytes({buf}, pos)")
    elif elem == "uuid":
        inline_or_call(code, d, f"pos + 16 <= len({buf})", [f"{var} = bytes({buf}[pos:pos + 16])", "pos += 16"],
                       f"{var}, pos = read_uuid({buf}, pos)  # the error")
    else:
        if f.struct is None:  # not assert: python -O drops it
            raise InvariantViolation(f"field {f.attr} is a struct but carries none")
        if nullable:
            code(d, f"if {buf}[pos] & 0x80:")
            code(d + 1, f"{var} = None")
            code(d + 1, "pos += 1")
            code(d, "else:")
            code(d + 1, f"{var}, pos = {f.struct.cls}.read({buf}, pos + 1, version)")
        else:
            code(d, f"{var}, pos = {f.struct.cls}.read({buf}, pos, version)")


def regular_plan(s: Struct, within: Range) -> list[list[Field]]:
    """The struct's untagged fields in order, fixed-width neighbours present in
    the same versions of ``within`` grouped so that one ``struct.Struct`` packs them."""
    plan: list[list[Field]] = []
    absent: list[list[Field]] = []  # not on the wire in these versions: no neighbour of anything
    for f in s.fields:
        if f.tag is not None:
            present = f.versions & s.versions
            if not f.tagged.covers(present):
                raise SystemExit(f"{s.cls}.{f.name}: tagged in some of its versions only")
            continue
        if (f.versions & within).empty:
            absent.append([f])
            continue
        fixed = f.elem in FIXED and not f.is_array
        prev = plan[-1] if plan else None
        if (fixed and prev and prev[0].tag is None and prev[0].elem in FIXED and not prev[0].is_array
                and prev[0].versions & within == f.versions & within):
            prev.append(f)
        else:
            plan.append([f])
    return plan + absent


def layouts(s: Struct) -> list[Range]:
    """``s.versions`` cut into runs of versions whose untagged fields are on
    the wire alike (each present or not, each in one encoding), newest run
    first. Each run gets a straight path with no version test inside, its
    fixed-width neighbours packed by one ``struct.Struct``: Fetch's partition,
    six tests and six unpacks at every version, is one unpack at v12+."""
    def layout(v: int) -> tuple[object, ...]:
        out: list[object] = []
        for f in s.fields:
            if f.tag is not None:
                continue
            present = f.versions & s.versions
            out.append(next(((flex, nullable) for seg, flex, nullable in field_segments(f, present, s)
                             if seg.contains(v)), None) if present.contains(v) else None)
        return tuple(out)

    runs: list[Range] = []
    hi = s.versions.hi
    current = layout(hi)
    for v in range(s.versions.hi - 1, s.versions.lo - 1, -1):
        here = layout(v)
        if here != current:
            runs.append(Range(v + 1, hi))
            hi, current = v, here
    runs.append(Range(s.versions.lo, hi))
    return runs


def by_layout(code: Code, s: Struct, d: int, emit: Callable[[Code, Struct, Range, int], None],
              straight: int) -> None:
    """``emit`` the struct's ``straight`` newest layouts (``layouts``) at depth
    ``d``, each under its version test, newest first, then one path for the
    older versions with the tests inside it (``straight`` 0: that path alone)."""
    runs = layouts(s)
    if straight >= len(runs) - 1:
        branches = runs
    elif straight == 0:
        branches = [s.versions]
    else:
        branches = runs[:straight] + [Range(s.versions.lo, runs[straight].hi)]
    if len(branches) == 1:
        emit(code, s, s.versions, d)
        return
    for i, run in enumerate(branches):
        test = cond(Range(run.lo, s.versions.hi), s.versions)
        code(d, "else:" if i == len(branches) - 1 else f"{'if' if i == 0 else 'elif'} {test}:")
        emit(code, s, run, d + 1)


def emit_fitted(code: Code, s: Struct, emit_method: Callable[[Code, Struct, int], None]) -> None:
    """``emit_method`` with as many straight layouts as keep the method within
    FUNCTION_LINES_MAX lines: a generated method is read like any other."""
    for straight in range(len(layouts(s)), 0, -1):
        scratch = Code()
        scratch.structs = dict(code.structs)
        emit_method(scratch, s, straight)
        if len(scratch.lines) <= FUNCTION_LINES_MAX:
            emit_method(code, s, straight)
            return
    emit_method(code, s, 0)


def tagged_fields(s: Struct) -> list[Field]:
    return sorted((f for f in s.fields if f.tag is not None), key=lambda f: f.tag or 0)


def flexible_in(s: Struct) -> Range:
    return s.flexible & s.versions


def emit_write(code: Code, s: Struct, straight: int) -> None:
    code(1, "def write(self, out: bytearray, version: int) -> None:")
    by_layout(code, s, 2, emit_write_regular, straight)
    emit_write_tags(code, s)
    if not code.lines[-1][0].startswith("        "):
        code(2, "pass")


def emit_write_regular(code: Code, s: Struct, within: Range, d0: int) -> None:
    """The untagged fields' writes for a version in ``within``, at depth ``d0``."""
    start = len(code.lines)
    for group in regular_plan(s, within):
        present = group[0].versions & within
        test = cond(present, within)
        d = d0
        if present.empty:
            test = "False"
        elif test is not None:
            code(d0, f"if {test}:")
            d = d0 + 1
        if not present.empty:
            if len(group) > 1:
                codes = "".join(FIXED[f.elem][0] for f in group)
                args = ", ".join(f"self.{f.attr}" for f in group)
                code(d, f"out += {code.packer(codes)}.pack({args})")
            else:
                f = group[0]
                segs = field_segments(f, present, s)
                for i, (seg, flex, nullable) in enumerate(segs):
                    if len(segs) == 1:
                        write_value(code, d, f, f"self.{f.attr}", "out", flex, nullable)
                        continue
                    seg_test = cond(seg, present)
                    last = i == len(segs) - 1
                    code(d, "else:" if last else (f"if {seg_test}:" if i == 0 else f"elif {seg_test}:"))
                    write_value(code, d + 1, f, f"self.{f.attr}", "out", flex, nullable)
        strict = [f for f in group if not f.ignorable]
        if test is not None and strict:
            if test == "False":
                for f in strict:
                    code(d0, f"if {nondefault(f, 'self.' + f.attr)}:")
                    code(d0 + 1, f'raise unsupported("{s.cls}.{f.attr}", version)')
            else:
                code(d0, "else:")
                for f in strict:
                    code(d0 + 1, f"if {nondefault(f, 'self.' + f.attr)}:")
                    code(d0 + 2, f'raise unsupported("{s.cls}.{f.attr}", version)')
    if len(code.lines) == start and d0 > 2:
        code(d0, "pass")


def emit_write_tags(code: Code, s: Struct) -> None:
    flex = flexible_in(s)
    tagged = tagged_fields(s)
    for f in tagged:  # a tagged field set in a version that has no such tag
        present = f.tagged & f.versions & s.versions
        if not f.ignorable and not present.covers(s.versions):
            test = cond(present, s.versions) if not present.empty else "True"
            code(2, f"if not ({test}) and {nondefault(f, 'self.' + f.attr)}:")
            code(3, f'raise unsupported("{s.cls}.{f.attr}", version)')
    if flex.empty:
        return
    test = cond(flex, s.versions)
    d = 2
    if test is not None:
        code(2, f"if {test}:")
        d = 3
    if not tagged:
        code(d, "out.append(0)")
        return
    checks: list[str | None] = []
    for f in tagged:
        present = f.tagged & f.versions & s.versions
        if present.empty:
            checks.append(None)
            continue
        t = cond(present, flex)
        nd = nondefault(f, "self." + f.attr)
        checks.append(f"{t} and {nd}" if t else nd)
    code(d, "_n = 0")
    for check in checks:
        if check:
            code(d, f"if {check}:")
            code(d + 1, "_n += 1")
    code(d, "out.append(_n)")
    for f, check in zip(tagged, checks):
        if not check:
            continue
        present = f.tagged & f.versions & s.versions
        if not (f.nullable.covers(present) or (f.nullable & present).empty):
            raise SystemExit(f"{s.cls}.{f.name}: nullable in some tagged versions only")
        code(d, f"if {check}:")
        code(d + 1, "_t = bytearray()")
        known_set = f.default is None  # the count's test was "is not None"
        nullable = not known_set and not (f.nullable & present).empty
        write_value(code, d + 1, f, f"self.{f.attr}", "_t", True, nullable, known_set)
        code(d + 1, f"write_tagged(out, {f.tag}, _t)")


def emit_read(code: Code, s: Struct, straight: int) -> None:
    code(1, "@classmethod")
    code(1, "def read(cls, buf: memoryview, pos: int, version: int) -> tuple[Self, int]:")
    for f in s.fields:
        present = f.versions & s.versions
        always = f.tag is None and present.covers(s.versions)
        code(2, f"v_{f.attr}: {py_type(f)}" + ("" if always else f" = {fresh_default(f)}"))
    code(2, "try:")
    by_layout(code, s, 3, emit_read_regular, straight)
    emit_read_tags(code, s)
    code.label = None
    code(2, "except KafkaDecodeError:")
    code(3, "raise")
    code(2, "except _FAULTS as exc:")
    code(3, f'raise _fault(exc, "{s.cls}", pos) from None')
    args = ", ".join(f"{f.attr}=v_{f.attr}" for f in s.fields)
    code(2, f"return cls({args}), pos")


def emit_read_regular(code: Code, s: Struct, within: Range, d0: int) -> None:
    """The untagged fields' reads for a version in ``within``, at depth ``d0``."""
    start = len(code.lines)
    for group in regular_plan(s, within):
        present = group[0].versions & within
        if present.empty:
            continue
        test = cond(present, within)
        d = d0
        if test is not None:
            code(d0, f"if {test}:")
            d = d0 + 1
        if len(group) > 1:
            codes = "".join(FIXED[f.elem][0] for f in group)
            size = sum(FIXED[f.elem][1] for f in group)
            code.label = group[0].attr
            names = ", ".join(f"v_{f.attr}" for f in group)
            code(d, f"{names} = {code.packer(codes)}.unpack_from(buf, pos)")
            code(d, f"pos += {size}")
            continue
        f = group[0]
        code.label = f.attr
        segs = field_segments(f, present, s)
        for i, (seg, flex, nullable) in enumerate(segs):
            if len(segs) == 1:
                read_value(code, d, f, f"v_{f.attr}", "buf", flex, nullable)
                continue
            seg_test = cond(seg, present)
            last = i == len(segs) - 1
            code(d, "else:" if last else (f"if {seg_test}:" if i == 0 else f"elif {seg_test}:"))
            read_value(code, d + 1, f, f"v_{f.attr}", "buf", flex, nullable)
    if len(code.lines) == start and d0 > 3:
        code.label = None
        code(d0, "pass")


def fresh_default(f: Field) -> str:
    if f.default == "STRUCT":
        if f.struct is None:  # not assert: python -O drops it
            raise InvariantViolation(f"field {f.attr} is a struct but carries none")
        return f"{f.struct.cls}()"
    return default_expr(f)


def emit_read_tags(code: Code, s: Struct) -> None:
    flex = flexible_in(s)
    if flex.empty:
        if not s.fields:
            code(3, "pass")
        return
    code.label = "(tagged fields)"
    test = cond(flex, s.versions)
    d = 3
    if test is not None:
        code(3, f"if {test}:")
        d = 4
    tagged = [f for f in tagged_fields(s) if not (f.tagged & f.versions & s.versions).empty]
    if not tagged:
        code(d, "if buf[pos]:")
        code(d + 1, "pos = skip_tags(buf, pos)")
        code(d, "else:")
        code(d + 1, "pos += 1")
        return
    code(d, "if buf[pos] == 0:")  # the common case: no tagged field set
    code(d + 1, "pos += 1")
    code(d, "else:")
    d += 1
    code(d, "_n = buf[pos]")
    inline_or_call(code, d, "_n < 0x80 and 2 * _n < len(buf) - pos", ["pos += 1"], "_n, pos = read_tag_count(buf, pos)")
    code(d, "for _ in range(_n):")
    code(d + 1, "_tag = buf[pos]")  # a tag and a size below 127, one byte each: read here
    code(d + 1, "_size = buf[pos + 1]")
    inline_or_call(code, d + 1, "_tag < 0x80 and _size < 0x80 and (_end := pos + 2 + _size) <= len(buf)",
                   ["pos += 2"], "_tag, pos, _end = read_tag(buf, pos)")
    code(d + 1, "_sub = buf[:_end]")
    for i, f in enumerate(tagged):
        present = f.tagged & f.versions & s.versions
        t = cond(present, flex)
        code.label = "(tagged fields)"
        code(d + 1, ("if" if i == 0 else "elif") + f" _tag == {f.tag}" + (f" and {t}:" if t else ":"))
        code.label = f.attr
        read_value(code, d + 2, f, f"v_{f.attr}", "_sub", True, not (f.nullable & present).empty)
        code(d + 2, "if pos != _end:")
        code(d + 3, "check_tag_end(pos, _end, _tag)")
    code.label = "(tagged fields)"
    code(d + 1, "pos = _end")


def emit_class(code: Code, s: Struct) -> None:
    m = s.message
    code(0, f"class {s.cls}(Message, kw_only=True, gc=False):")
    if m is not None:
        key = f"api key {m.api_key}, " if m.api_key >= 0 else ""
        whose = "Kafka's" if m.source == SCHEMA_DIR.name else "metalog's"
        code(1, f'"""{whose} {m.name} ({key}versions {m.valid.lo}-{m.valid.hi}), from {m.source}/{m.name}.json."""')
        code(0, "")
        if m.api_key >= 0:
            code(1, f"API_KEY: ClassVar[int] = {m.api_key}")
    code(1, f"LOWEST_VERSION: ClassVar[int] = {s.versions.lo}")
    code(1, f"HIGHEST_VERSION: ClassVar[int] = {s.versions.hi}")
    code(1, f"FLEXIBLE_MIN_VERSION: ClassVar[int] = {min(s.flexible.lo, INF)}")
    for f in s.fields:
        code(0, field_decl(f))
    code(0, "")
    emit_fitted(code, s, emit_write)
    code(0, "")
    emit_fitted(code, s, emit_read)
    code(0, "")
    code(0, "")
    if s.message is None:
        code(0, f"_D_{s.cls} = {s.cls}()")
        code(0, "")
        code(0, "")


HEADER = '''"""GENERATED by ``python -m metalog.protocol.kafka.generate`` from the JSON
message schemas in schemas/ and schemas_metalog/ ({schemas}): do not edit; change the
generator and regenerate (tests/protocol/kafka checks this file is what the
generator writes).

One msgspec Struct per message and per nested struct (``<Message><Struct>``),
each with ``write``/``read`` (and, from ``Message``, ``encode``/``decode``).
See ``metalog.protocol.kafka`` for the contract. The classes are ``gc=False``
(msgspec: not tracked by the cycle collector, which a decode of many small
structs would otherwise wake): never make a message contain itself.
"""

# fmt: off
from __future__ import annotations

import struct
from types import TracebackType
from typing import ClassVar, Self

import msgspec

from metalog.protocol.kafka.errors import KafkaDecodeError, UnsupportedVersionError
from metalog.protocol.kafka.primitives import (
    BOOL,
    F64,
    I8,
    I16,
    I32,
    I64,
    U16,
    U32,
    ZERO_UUID,
    BytesLike,
    Malformed,
    Message,
    check_tag_end,
    located,
    null_error,
    read_bytes,
    read_cbytes,
    read_ccount,
    read_count,
    read_cstr,
    read_nbytes,
    read_ncbytes,
    read_nccount,
    read_ncount,
    read_ncstr,
    read_nstr,
    read_str,
    read_tag,
    read_tag_count,
    read_uuid,
    skip_tags,
    unsupported,
    uuid_from_str,
    uuid_to_str,
    write_bytes,
    write_cbytes,
    write_cstr,
    write_nbytes,
    write_ncbytes,
    write_ncstr,
    write_nstr,
    write_str,
    write_tagged,
    write_uuid,
    write_uvarint,
)

__all__ = [
    "METALOG_API_KEYS",
    "REQUESTS",
    "RESPONSES",
    "ZERO_UUID",
    "BytesLike",
    "KafkaDecodeError",
    "Message",
    "UnsupportedVersionError",
    "request_header_version",
    "response_header_version",
    "uuid_from_str",
    "uuid_to_str",
]

# What a read can meet in bad bytes besides our own Malformed: a struct past
# the frame's end (struct.error), an index past it, bad UTF-8 (a ValueError).
_FAULTS = (struct.error, IndexError, ValueError, OverflowError, Malformed)

'''

FOOTER = '''

def request_header_version(api_key: int, version: int) -> int:
    """The request header's version: 2 in a flexible version, else 1."""
    return 2 if version >= REQUESTS[api_key].FLEXIBLE_MIN_VERSION else 1


def response_header_version(api_key: int, version: int) -> int:
    """The response header's version: 1 in a flexible version, else 0;
    always 0 for ApiVersions (a client must read it before it knows our versions)."""
    if api_key == 18:
        return 0
    return 1 if version >= RESPONSES[api_key].FLEXIBLE_MIN_VERSION else 0


def _fault(exc: Exception, where: str, pos: int) -> KafkaDecodeError:
    """The decode error naming the field whose read raised ``exc`` (by the
    line of the generated read it came through: free until something fails)."""
    tb: TracebackType | None = exc.__traceback__
    field = _FIELD_AT_LINE.get(tb.tb_lineno, "?") if tb is not None else "?"
    return located(exc, where, field, pos)


'''


def render(messages: list[Message]) -> str:
    code = Code()
    for m in messages:
        for s in m.structs:
            emit_class(code, s)
    reqs = sorted((m.api_key, m.name) for m in messages if m.kind == "request")
    resps = sorted((m.api_key, m.name) for m in messages if m.kind == "response")
    tail = ["REQUESTS: dict[int, type[Message]] = {"]
    tail += [f"    {k}: {n}," for k, n in reqs]
    tail += ["}", "RESPONSES: dict[int, type[Message]] = {"]
    tail += [f"    {k}: {n}," for k, n in resps]
    tail += ["}"]
    ours = sorted({m.api_key for m in messages if m.source != SCHEMA_DIR.name and m.api_key >= 0})
    tail += ["# metalog's extension apis (schemas_metalog/): no Kafka client or tool knows them.",
             f"METALOG_API_KEYS: frozenset[int] = frozenset({{{', '.join(map(str, ours))}}})"]
    names = sorted(m.name for m in messages)
    kafkas = sum(m.source == SCHEMA_DIR.name for m in messages)
    header = HEADER.replace("{schemas}", f"{kafkas} schemas of Apache Kafka 4.3.1\nand {len(messages) - kafkas} "
                                         f"of metalog's own")
    header = header.replace("__all__ = [\n", "__all__ = [\n" + "".join(f'    "{n}",\n' for n in names), 1)
    consts = [f"{name} = struct.Struct(\">{codes}\")" for codes, name in sorted(code.structs.items())
              if len(codes) > 1]
    head_lines = header.splitlines() + consts + ["", ""]
    first = len(head_lines) + 1
    table = {first + i: label for i, (_, label) in enumerate(code.lines) if label is not None}
    body = [text for text, _ in code.lines]
    table_lines = ["_FIELD_AT_LINE: dict[int, str] = {"]
    table_lines += [f"    {line}: {label!r}," for line, label in sorted(table.items())]
    table_lines += ["}"]
    all_lines = head_lines + body + tail + FOOTER.splitlines() + table_lines
    return "\n".join(line.rstrip() for line in all_lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUTPUT, help="where to write (default: messages.py)")
    parser.add_argument("--schemas", type=Path, action="append",
                        help="a folder of schemas, repeatable, read in order (default: schemas/, then "
                             "schemas_metalog/)")
    args = parser.parse_args(argv)
    args.out.write_text(render(load_all(tuple(args.schemas) if args.schemas else SCHEMA_DIRS)))


if __name__ == "__main__":
    main()

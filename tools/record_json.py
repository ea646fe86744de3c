"""One log record as JSON, the way `metalog consume` and `metalog dump
--print-data-log` print it: metadata and control records decoded by storage/'s
decoders (type, version, fields), produced values as UTF-8 text when they are
valid UTF-8, else base64. Shared by the CLI and the Spark job's history table
(a module of its own so that metalog.tools.spark need not import metalog.tools.cli)."""

from __future__ import annotations

import base64

import msgspec

from metalog.storage import control_records as cr
from metalog.storage import metadata_records as r


def value_json(value: bytes) -> dict:
    """A produced value: UTF-8 text when valid, else base64 (the field `encoding` says which)."""
    try:
        text = bytes(value).decode("utf-8")
    except UnicodeDecodeError:
        text = None
    # Control characters (NUL, ESC...) would not read as text: those values go as base64 too.
    if text is not None and not any(ord(c) < 32 and c not in "\t\n\r" for c in text):
        return {"type": "data", "value": text, "encoding": "utf-8"}
    return {"type": "data", "value": base64.b64encode(value).decode(), "encoding": "base64"}


def record_json(offset: int, epoch: int, value: bytes, control: bool, raw: bool = False) -> dict:
    """One record as a JSON-able dict: metadata/control records decoded by storage/'s
    decoders (type, version, fields); any other value as produced data. A control
    record that does not decode is reported as such (it cannot be user data)."""
    out: dict = {"offset": offset, "epoch": epoch}
    if raw:
        out.update(control=control, value=base64.b64encode(value).decode(), encoding="base64")
        return out
    if control:
        try:
            rec = cr.decode_control(bytes(value))
        except cr.ControlRecordError as exc:
            out.update(type="control", error=str(exc), value=base64.b64encode(value).decode(), encoding="base64")
            return out
        out.update(type=type(rec).__name__, control=True, version=int.from_bytes(value[0:2], "big", signed=True),
                   fields=msgspec.to_builtins(msgspec.structs.asdict(rec)))
        return out
    try:
        rec = r.decode_record(value)
    except r.MetadataRecordError:
        # Produced values share the log with metadata records; one that is not a
        # metadata record is shown as data.
        out.update(value_json(value))
        return out
    _key, version, _pos = r.decode_frame(value)
    out.update(type=r.type_name(rec), version=version, fields=r.record_to_dict(rec))
    if type(rec) is r.UnknownRecord:
        out["unmodelled"] = True  # a Kafka record type this build does not model: shown, not applied
    return out

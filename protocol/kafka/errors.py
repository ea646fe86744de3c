"""The Kafka codec's exceptions.

Decoding bytes that came off the wire can fail only with ``KafkaDecodeError``
(or a subclass: the wire module's ``HeaderError``, ``UnsupportedApi``,
``UnsupportedVersion`` and ``RequestBodyError``), whose message names the
message, the field and the byte position, so that a hostile or broken peer
can never raise anything else into a connection's reader. Encoding a value
a version cannot carry raises ``UnsupportedVersionError``, as Kafka's
generated code does.
"""

from __future__ import annotations


class KafkaDecodeError(ValueError):
    """Bytes that do not decode as the expected message at that version."""


class UnsupportedVersionError(ValueError):
    """A message asked of a version outside its range, or a field set to a
    non-default value in a version that cannot carry it (a non-ignorable
    field, as Kafka's generator calls it)."""

"""Kafka's wire protocol: message bodies generated from Kafka's JSON schemas.

* ``schemas/``: Apache Kafka 4.3.1's message schemas, vendored unchanged
  (Apache-2.0; see schemas/NOTICE).
* ``generate.py``: ``python -m metalog.protocol.kafka.generate`` writes
  ``messages.py`` from them (deterministic; a test regenerates and diffs).
* ``messages.py`` (generated, committed): one msgspec Struct per message and
  nested struct, with ``write``/``read``/``encode``/``decode`` per version,
  ``REQUESTS``/``RESPONSES`` by api key, the header-version rules.
* ``primitives.py``: the wire's primitive types the generated code uses.
* ``framing.py``: a byte stream split into frames (``FrameDecoder``, the
  frame-size limit) and the errors of a broken stream (``ProtocolError``).
* ``wire.py``: request/response headers and frames around the bodies, the
  ApiVersions fallback and error answers (sans-IO).
* ``edge.py`` (with ``edge_quorum.py`` and ``edge_client.py``): the sending
  side's mapping between our flat bodies (``metalog.protocol.messages``) and
  Kafka's messages.
* ``errors.py``: ``KafkaDecodeError`` (the only exception bad bytes raise)
  and ``UnsupportedVersionError``.
* ``bench.py``: ``python -m metalog.protocol.kafka.bench`` prints the codec's
  speed on a Produce request and a Fetch response.

Beyond the contract (additions, names kept): ``wire.encode_response_buffer``
(the frame as a bytearray, without ``encode_response``'s final copy, for the
Fetch path); ``wire.read_request_header``; every ``read`` turns a fault into
``KafkaDecodeError`` (not only ``decode``); the wire exceptions are all
``KafkaDecodeError`` subclasses; ``decode_request`` ignores bytes after a
request body as Kafka does (librdkafka sends some), while ``Message.decode``
refuses them. Splitting a byte stream into frames is ``framing.py``'s job.

Kafka's protocol is metalog's only protocol, on both broker ports and every
outbound channel.
"""

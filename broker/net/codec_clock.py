"""How long the Kafka codec takes per request, for the commit profile.

Off (``meter is None``) unless the broker records a commit trace
(``metalog.broker.server.commit_trace``, which only ``metalog bench
--profile-commit`` turns on): then the connections time each decode and
encode of a frame with ``time.perf_counter_ns`` and hand the figure to the
trace. A production broker reads one module global per frame and nothing
else. One meter per process, as there is one trace per broker process.
"""

from __future__ import annotations

from typing import Protocol

# The operations timed, in the order of one request's life.
DECODE_REQUEST = "decode request"   # a broker reads a request frame (header and body)
ENCODE_RESPONSE = "encode answer"   # a broker writes its answer
ENCODE_REQUEST = "encode request"   # a peer channel writes a request (the edge's mapping included)
DECODE_RESPONSE = "decode answer"   # a peer channel reads the answer (the edge's mapping included)


class CodecMeter(Protocol):
    def codec_sample(self, op: str, api_key: int, ns: int) -> None:
        """One encode or decode of api `api_key` took `ns` nanoseconds."""


meter: CodecMeter | None = None


def set_meter(new: CodecMeter | None) -> None:
    """The process's meter (the broker's commit trace), or None: off."""
    global meter
    meter = new

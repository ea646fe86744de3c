"""Writes the fuzz corpus (tests/protocol/kafka/corpus/): valid request and
response frames, for every api at its lowest and highest version, with
values drawn by kio's strategies and encoded by us. Run once; the files are
kept and replayed by test_bad_input.py on every run (rerun to refresh):

    python -m tests.protocol.kafka.make_corpus
"""

from __future__ import annotations

import warnings
from pathlib import Path

import hypothesis.strategies as st
from kio.static.primitive import Records

from metalog.protocol.kafka import messages, wire
from tests.protocol.kafka.kio_bridge import kio_class, to_ours

CORPUS = Path(__file__).parent / "corpus"
FRAME_BYTES_MAX = 2048  # a small corpus: the fuzzer mutates it on every run


def main() -> None:
    st.register_type_strategy(Records, st.binary(max_size=32).map(Records))
    warnings.simplefilter("ignore")  # .example() warns it is meant for exploring: this is a one-off
    CORPUS.mkdir(exist_ok=True)
    for kind, table in (("request", messages.REQUESTS), ("response", messages.RESPONSES)):
        for key, cls in sorted(table.items()):
            for version in sorted({cls.LOWEST_VERSION, cls.HIGHEST_VERSION}):
                header = wire.RequestHeader(key, version, 1000 + key, "corpus")
                for _ in range(50):  # draws until one is small
                    body = to_ours(st.from_type(kio_class(cls, version)).example(), cls)
                    if kind == "request":
                        frame = wire.encode_request(header, body)
                    else:
                        frame = wire.encode_response(header, body)
                    if len(frame) <= FRAME_BYTES_MAX:
                        break
                (CORPUS / f"{cls.__name__}-v{version}.bin").write_bytes(frame[4:])


if __name__ == "__main__":
    main()

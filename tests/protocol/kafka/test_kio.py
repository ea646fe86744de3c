"""The codec judged by code we did not write: kio (Kafka's messages per
version, generated independently from Kafka's schemas, with a native reader).

For every request and response we generate, at every version both codecs
have, hypothesis draws kio entities (kio's own strategies: every field in its
range, nested arrays, tagged fields set and unset) and checks both directions:

* kio's encoding, decoded by us, equals the same values;
* our encoding of the same values, decoded by kio, equals kio's entity.
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings
from kio.static.primitive import Records

from metalog.protocol.kafka import messages
from tests.protocol.kafka.kio_bridge import kio_class, kio_decode, kio_encode, to_ours

# kio declares no strategy for record batches: any bytes do for a codec
st.register_type_strategy(Records, st.binary(max_size=64).map(Records))

CASES = [
    pytest.param(cls, version, id=f"{cls.__name__}-v{version}")
    for table in (messages.REQUESTS, messages.RESPONSES)
    for key, cls in table.items()
    if key not in messages.METALOG_API_KEYS  # metalog's extensions: kio knows Kafka's only (test_extensions.py)
    for version in range(cls.LOWEST_VERSION, cls.HIGHEST_VERSION + 1)
]


def test_every_api_and_version_is_judged():
    """kio has every version of every message we generate: none is left out."""
    assert len(messages.REQUESTS) == len(messages.RESPONSES) == 29 + len(messages.METALOG_API_KEYS)
    for cls, version in [c.values for c in CASES]:
        kio_class(cls, version)


@pytest.mark.parametrize(("cls", "version"), CASES)
@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_both_directions_agree_with_kio(cls, version, data):
    kio_type = kio_class(cls, version)
    entity = data.draw(st.from_type(kio_type))
    ours = to_ours(entity, cls)

    theirs_bytes = kio_encode(entity)
    assert cls.decode(theirs_bytes, version) == ours

    our_bytes = ours.encode(version)
    assert kio_decode(kio_type, our_bytes) == entity

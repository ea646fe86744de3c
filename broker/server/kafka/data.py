"""The data path in Kafka's protocol: Produce, Fetch, ListOffsets,
InitProducerId, OffsetForLeaderEpoch (issue 32 item 3), mapped onto the
broker's own handlers through ``KafkaContext.ask`` (see the package docstring)."""

from __future__ import annotations

from metalog.broker.server.kafka.api import KafkaApi

APIS: dict[int, KafkaApi] = {}

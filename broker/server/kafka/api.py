"""The types every Kafka api handler shares (see the package docstring)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Mapping, NamedTuple, Protocol

if TYPE_CHECKING:
    from metalog.broker.net.kafka_conn import KafkaExchange
from metalog.protocol import messages as m
from metalog.protocol.apis import ApiKey

# Kafka's fixed topic of the metadata log and its fixed topic id
# (Uuid.METADATA_TOPIC_ID, printed AAAAAAAAAAAAAAAAAAAAAQ): partition 0 is our log.
METADATA_TOPIC = "__cluster_metadata"
METADATA_TOPIC_ID = bytes(15) + b"\x01"
METADATA_PARTITION = 0
# Kafka's name of the quorum's listener (``listen``: the voter set's endpoints).
# Only it serves the quorum's own requests (issue 34 item 1): an operator can
# firewall it to the voters and observers and leave the client listener open.
CONTROLLER_LISTENER = "CONTROLLER"


class KafkaContext(Protocol):
    """What a handler may use of the broker."""

    @property
    def node_id(self) -> int: ...

    @property
    def cluster_id(self) -> str: ...

    @property
    def listener_name(self) -> str: ...

    def ask(self, ex: "KafkaExchange", api_key: ApiKey, body: m.Body, on_answer: Callable[[Any], None]) -> None: ...

    def forward(self, ex: "KafkaExchange", node_id: int, api_key: int, body: m.Body,
                on_answer: Callable[[Any], None], fallback: m.Body | None) -> None: ...

    def leader_id(self) -> int: ...  # the leader this node knows of, -1 for none

    def forward_request(self, ex: "KafkaExchange", node_id: int, unreachable: Callable[[], None]) -> None: ...

    def is_forwarded(self, ex: "KafkaExchange") -> bool: ...  # came in an Envelope

    def later(self, delay_s: float, fn: Callable[[], None]) -> None: ...  # fn on the loop after delay_s

    def endpoints(self) -> dict[int, tuple[str, int]]: ...

    def supported(self) -> dict[int, tuple[int, int]]: ...

    def finalized_features(self) -> Mapping[str, int]: ...  # FeatureLevelRecords applied: name -> level


class KafkaApi(NamedTuple):
    request: type  # the generated request class (metalog.protocol.kafka.messages)
    min_version: int
    max_version: int
    handle: Callable[[KafkaContext, "KafkaExchange"], None]

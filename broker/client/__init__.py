"""The client library: produce, read, administer a metalog cluster. Nothing of the server.

    from metalog.broker.client import MetalogClient

    client = MetalogClient.from_config()   # the client.yaml `metalog cluster up` wrote
    offset, epoch = await client.produce([b"hello"])
    records = await client.consumer("earliest").poll()

Modules: ``client`` (MetalogClient: leader tracking, retries, idempotent
produce), ``consumer`` (Consumer: KIP-320 truncation detection, CRC checks),
``errors`` (what the library raises), ``config`` (the client config file and
where it is looked for), ``request_size`` (how records are cut into requests).
The package imports the network layer and the formats, never the server, the
quorum or the controller (the import contract ``client-no-server``).
"""

from metalog.broker.client.client import MetalogClient
from metalog.broker.client.config import ClientConfig, ClientConfigError, find_client_config, load_client_config
from metalog.broker.client.consumer import ConsumedRecord, Consumer
from metalog.broker.client.errors import (
    AuthorizationError,
    ClusterUnavailable,
    CorruptRecordError,
    LogTruncationError,
    MetalogError,
    NoOffsetError,
    OffsetOutOfRangeError,
    TlsFailure,
)

__all__ = [
    "AuthorizationError",
    "ClientConfig",
    "ClientConfigError",
    "ClusterUnavailable",
    "ConsumedRecord",
    "Consumer",
    "CorruptRecordError",
    "LogTruncationError",
    "MetalogClient",
    "MetalogError",
    "NoOffsetError",
    "OffsetOutOfRangeError",
    "TlsFailure",
    "find_client_config",
    "load_client_config",
]

"""The Kafka listener's settings: kafka_listen, kafka_endpoints (a node's own
entry from kafka_listen unless given; a wildcard bind address is not an
address anyone can reach), and errors that name the key."""

from __future__ import annotations

import pytest

from metalog.broker.server.config import ConfigError, Endpoint, config_from_dict

BASE = dict(node_id=2, cluster_id="c", data_dir="/tmp/x", listen="127.0.0.1:9092",
            voters="1@127.0.0.1:9091,2@127.0.0.1:9092", security_protocol="PLAINTEXT")


def test_without_kafka_listen_there_is_no_kafka_listener():
    cfg = config_from_dict(dict(BASE))
    assert (cfg.kafka_endpoint(), cfg.kafka_node_endpoints()) == (None, {})


def test_own_entry_comes_from_kafka_listen_and_the_map_names_the_others():
    cfg = config_from_dict(dict(BASE, kafka_listen="127.0.0.1:11092", kafka_endpoints="1@10.0.0.1:11091"))
    assert cfg.kafka_node_endpoints() == {1: Endpoint("10.0.0.1", 11091), 2: Endpoint("127.0.0.1", 11092)}
    # Advertised differently from where it binds: the map wins.
    cfg = config_from_dict(dict(BASE, kafka_listen="0.0.0.0:11092", kafka_endpoints="2@kafka-2.example:11092"))
    assert cfg.kafka_node_endpoints() == {2: Endpoint("kafka-2.example", 11092)}
    # A wildcard bind with no map entry: nothing to advertise for this node.
    assert config_from_dict(dict(BASE, kafka_listen="0.0.0.0:11092")).kafka_node_endpoints() == {}


@pytest.mark.parametrize("key, value, message", [
    ("kafka_listen", "no-port", "kafka_listen: expected host:port, got 'no-port'"),
    ("kafka_endpoints", "1@h:1,1@h:2", "kafka_endpoints: node id 1 listed twice"),
    ("kafka_endpoints", "x@h:1", "kafka_endpoints: node id must be a number, got 'x'"),
])
def test_a_bad_value_names_its_key(key, value, message):
    with pytest.raises(ConfigError) as err:
        config_from_dict(dict(BASE, **{key: value}))
    assert str(err.value) == message

"""messages.py is what the generator writes from the vendored schemas."""

from __future__ import annotations

import difflib
import subprocess
import sys
from pathlib import Path

from metalog.protocol.kafka import generate, messages

CONTRACT_APIS = """ApiVersions Metadata Produce Fetch ListOffsets InitProducerId OffsetForLeaderEpoch
DescribeCluster DescribeQuorum Vote BeginQuorumEpoch EndQuorumEpoch FetchSnapshot AddRaftVoter
RemoveRaftVoter UpdateRaftVoter UpdateFeatures CreateTopics DeleteTopics CreatePartitions DescribeConfigs
IncrementalAlterConfigs CreateAcls DescribeAcls DeleteAcls BrokerRegistration BrokerHeartbeat""".split()


def test_committed_messages_py_is_what_the_generator_writes(tmp_path: Path):
    out = tmp_path / "messages.py"
    subprocess.run([sys.executable, "-m", "metalog.protocol.kafka.generate", "--out", str(out)], check=True)
    committed = generate.OUTPUT.read_text()
    fresh = out.read_text()
    if fresh != committed:
        diff = "".join(list(difflib.unified_diff(
            committed.splitlines(True), fresh.splitlines(True), "messages.py (committed)", "messages.py (generated)"
        ))[:60])
        raise AssertionError(
            "protocol/kafka/messages.py is not what the generator writes from protocol/kafka/schemas/: "
            "run `python -m metalog.protocol.kafka.generate` and commit the result.\n" + diff
        )


def test_generation_is_deterministic():
    schemas = generate.load_all()
    assert generate.render(schemas) == generate.render(generate.load_all())


def test_every_api_of_the_contract_has_both_bodies():
    names = {cls.__name__ for cls in [*messages.REQUESTS.values(), *messages.RESPONSES.values()]}
    for api in CONTRACT_APIS:
        assert {api + "Request", api + "Response"} <= names, api
    assert messages.RequestHeader.HIGHEST_VERSION == 2 and messages.ResponseHeader.HIGHEST_VERSION == 1


def test_version_ranges_and_flexible_versions_are_kafkas():
    """A few read off Kafka 4.3.1's schemas by hand."""
    assert (messages.FetchRequest.LOWEST_VERSION, messages.FetchRequest.HIGHEST_VERSION) == (4, 18)
    assert messages.FetchRequest.FLEXIBLE_MIN_VERSION == 12
    assert messages.ProduceRequest.FLEXIBLE_MIN_VERSION == 9
    assert messages.VoteRequest.FLEXIBLE_MIN_VERSION == 0
    assert messages.MetadataRequest.API_KEY == 3
    assert messages.request_header_version(1, 11) == 1 and messages.request_header_version(1, 12) == 2
    assert messages.response_header_version(18, 3) == 0  # ApiVersions: always v0
    assert messages.response_header_version(3, 9) == 1 and messages.response_header_version(3, 8) == 0

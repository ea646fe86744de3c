"""The client as a library in someone else's program, against real brokers:
``MetalogClient.from_config()`` finds the cluster the way the CLI does, and
the library prints nothing of its own unless the application configured
logging (then its events go through the application's setup)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

FAST = dict(election_timeout_ms=300, fetch_timeout_ms=800, request_timeout_ms=800, fetch_max_wait_ms=100)

# An application's first lines: no arguments, the config found through $METALOG_CLIENT_CONFIG.
APP = """
import asyncio, logging, sys
from metalog.broker.client import MetalogClient
if sys.argv[1] == "debug":
    logging.basicConfig(level=logging.DEBUG, format="%(name)s %(levelname)s %(message)s")

async def main():
    client = MetalogClient.from_config()
    try:
        offset, _ = await client.produce([b"from-an-app"])
        consumer = client.consumer()
        consumer.seek(offset)
        records = await consumer.poll()
    finally:
        await client.close()
    print(records[0].value.decode())

asyncio.run(main())
"""


def _app(config_path: str, logging_setup: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "METALOG_CLIENT_CONFIG": config_path}
    return subprocess.run([sys.executable, "-c", APP, logging_setup], capture_output=True, text=True,
                          timeout=60, env=env)


async def test_the_client_library_is_silent_unless_the_application_configures_logging(make_cluster):
    cluster = make_cluster(voters=3, **FAST)
    await asyncio.to_thread(cluster.wait_for_leader, 20)
    quiet = await asyncio.to_thread(_app, cluster.client_config_path, "none")
    assert quiet.returncode == 0, quiet.stderr
    assert (quiet.stdout, quiet.stderr) == ("from-an-app\n", "")
    loud = await asyncio.to_thread(_app, cluster.client_config_path, "debug")
    assert loud.returncode == 0, loud.stderr
    assert loud.stdout == "from-an-app\n"
    producer_lines = [line for line in loud.stderr.splitlines() if "producer_id_initialized" in line]
    assert len(producer_lines) == 1, loud.stderr
    assert producer_lines[0].startswith("metalog.client DEBUG producer_id_initialized producer_id=")

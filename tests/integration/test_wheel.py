"""metalog as a user installs it: the built wheel holds one top-level package,
`metalog`, and works in a fresh virtualenv that already has a `tools`
package of someone else's, against a real cluster.

The virtualenv is new and gets the wheel with --no-deps; the third-party
dependencies (aiohttp, msgspec, numpy, ...) come from the test's own
environment through a path line, so the test needs no download. That path
line does not run the editable install's finder (.pth files are only read in
site directories), so every `metalog` module must come from the wheel: the
test checks where each one was loaded from."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import textwrap
import zipfile

import pytest

from metalog.tools.cluster.launcher import REPO_ROOT

pytestmark = pytest.mark.slow

FOREIGN_TOOLS = 'WHO = "an application\'s own tools package"\n'

USE_THE_CLIENT = textwrap.dedent("""
    import asyncio, sys
    import tools
    assert tools.WHO == "an application's own tools package", tools.__file__
    import metalog
    from metalog.broker.client import MetalogClient, load_client_config

    async def main(path):
        cfg = load_client_config(path)
        client = MetalogClient(cfg.endpoints(), cfg.cluster_id, tls=cfg.tls())
        try:
            offset, epoch = await client.produce([b"from-the-wheel"])
            consumer = client.consumer()
            consumer.seek(offset)
            for _ in range(50):  # bounded: each poll waits at most 200 ms for records
                records = await consumer.poll(max_wait_ms=200)
                if records:
                    break
            print("read", records[0].offset == offset, records[0].value.decode())
        finally:
            await client.close()

    asyncio.run(main(sys.argv[1]))
    loaded = sorted({m.__file__.split("site-packages")[0] for n, m in sys.modules.items()
                     if n.startswith("metalog.") and getattr(m, "__file__", None)})
    print("loaded from", loaded)
""")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(out), REPO_ROOT], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (path,) = [str(p) for p in out.glob("metalog-*.whl")]
    return path


def test_the_wheel_installs_only_the_metalog_namespace(wheel):
    with zipfile.ZipFile(wheel) as zf:
        tops = {name.split("/")[0] for name in zf.namelist()}
        names = zf.namelist()
    assert tops == {"metalog", next(t for t in tops if t.endswith(".dist-info"))}, tops
    assert "metalog/broker/quorum/core.py" in names and "metalog/tools/spark/log4j2.properties" in names
    assert not any(n.startswith("metalog/tests/") for n in names)
    entry_points = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "metalog = metalog.tools.cli:main" in entry_points


def test_the_wheel_in_a_fresh_virtualenv_beside_a_foreign_tools_package(wheel, tmp_path, make_cluster):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = str(venv / "bin" / "python")
    site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    os.makedirs(os.path.join(site, "tools"))
    with open(os.path.join(site, "tools", "__init__.py"), "w") as f:
        f.write(FOREIGN_TOOLS)
    with open(os.path.join(site, "borrowed-dependencies.pth"), "w") as f:
        f.write(sysconfig.get_paths()["purelib"] + "\n")
    install = subprocess.run([sys.executable, "-m", "pip", "--python", py, "install", "--no-deps", "-q", wheel],
                             capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stdout + install.stderr

    cluster = make_cluster(voters=3)
    cluster.wait_for_leader(30)
    proc = subprocess.run([py, "-c", USE_THE_CLIENT, cluster.client_config_path], cwd=str(tmp_path),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "read True from-the-wheel"
    assert lines[1] == f"loaded from [{(site.split('site-packages')[0])!r}]"
    # The console script is the wheel's, and it runs from the new environment.
    cli = subprocess.run([str(venv / "bin" / "metalog"), "--help"], capture_output=True, text=True, timeout=120)
    assert cli.returncode == 0 and "produce" in cli.stdout, cli.stderr

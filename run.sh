#!/usr/bin/env bash
# The README's two commands live here.
#   bash run.sh cluster   set up, then start a local multi-broker cluster (3 voters + 1 observer)
#   bash run.sh test      set up, then run the whole test suite
#   bash run.sh setup     only set up (virtualenv, dependencies, Java for Spark, promtool, kcat,
#                         Apache Kafka's jars for tests/kafka, the drill's Porcupine checker,
#                         the Kubernetes manifests' checker)
set -euo pipefail
cd "$(dirname "$0")"

# apt_best_effort COMMAND "PACKAGES" "WHY": install PACKAGES with apt-get when
# COMMAND is missing; on failure say so and go on.
apt_best_effort() {
  local cmd="$1" pkgs="$2" why="$3" SUDO
  if command -v "$cmd" >/dev/null 2>&1 || ! command -v apt-get >/dev/null 2>&1; then
    return 0
  fi
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo -n"; fi
  echo "run.sh: installing $why" >&2
  # shellcheck disable=SC2086  # PACKAGES is a list
  { $SUDO apt-get update -qq && $SUDO env DEBIAN_FRONTEND=noninteractive \
      apt-get install -y -qq --no-install-recommends $pkgs >/dev/null; } \
    || echo "run.sh: could not install $pkgs; the tests that need $cmd will fail" >&2
}

# venv_python: the interpreter the virtualenv is made from. METALOG_PYTHON
# if set; else the distribution's own /usr/bin/python3 when it is 3.11+ with
# venv: Debian and Ubuntu build it with PGO and LTO and link libpython into
# the binary, where a default pyenv or source build has neither (the brokers
# spend about 70% of their CPU in the interpreter: docs/bench.md, "The
# interpreter"); else python3 on PATH.
venv_python() {
  local p
  for p in "${METALOG_PYTHON:-}" /usr/bin/python3 "$(command -v python3 || true)"; do
    if [ -n "$p" ] && [ -x "$p" ] && "$p" -c \
        'import sys, venv, ensurepip; sys.exit(sys.version_info < (3, 11))' >/dev/null 2>&1; then
      echo "$p"
      return 0
    fi
  done
  echo "run.sh: no Python 3.11+ with venv found (set METALOG_PYTHON)" >&2
  return 1
}

# make_venv: .venv from venv_python; an existing one made from another
# interpreter is made again (its packages are reinstalled below).
make_venv() {
  local py want have=""
  py="$(venv_python)"
  want="$("$py" -c 'import os, sys; print(os.path.realpath(sys.executable))')"
  if [ -x .venv/bin/python ]; then
    have="$(.venv/bin/python -c 'import os, sys; print(os.path.realpath(sys._base_executable))' 2>/dev/null || true)"
  fi
  if [ -n "$have" ] && [ "$have" = "$want" ]; then
    return 0
  fi
  if [ -n "$have" ] || [ -e .venv ]; then
    echo "run.sh: .venv was made from ${have:-an unusable interpreter}; making it again from $want" >&2
    rm -rf .venv
  fi
  "$py" -m venv .venv
}

setup() {
  if ! command -v java >/dev/null 2>&1; then
    echo "run.sh: Java not found; installing a JRE for Spark" >&2
    if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
    $SUDO apt-get update -qq
    $SUDO apt-get install -y -qq openjdk-17-jre-headless >/dev/null
  fi
  # Best effort, where apt-get and root or sudo exist; without them the tests
  # that need the tool say so and fail.
  # promtool checks the /metrics text and the Prometheus scrape config.
  apt_best_effort promtool "prometheus" "promtool, for the /metrics checks"
  # kcat (librdkafka's command-line client) reads and consumes over the Kafka listener.
  apt_best_effort kcat "kcat" "kcat, Kafka's command-line client, for tests/kafka_clients"
  # nft makes the drill's packet faults inside network namespaces.
  apt_best_effort nft "nftables iproute2" "nftables, for the drill's packet faults"
  make_venv
  # setuptools with pip, before the project: the editable install and
  # tests/integration/test_wheel.py build with the venv's own setuptools.
  .venv/bin/python -m pip install -q --upgrade pip 'setuptools>=68' >/dev/null
  # Every extra: the test suite runs the Spark job, the drill and the benches.
  # setuptools warns about every editable install (a UserWarning of its build
  # backend): noise for a user of this repo, so it is silenced here only.
  PYTHONWARNINGS="ignore::UserWarning" .venv/bin/python -m pip install -q -e '.[dev,spark,bench]'
  kafka_setup
  porcupine_setup
  kubecheck_setup
}

# metalog-porcupine (tools/drill/porcupine): Porcupine, a linearizability
# checker we did not write, over the drill's history; Go appears only here.
# Built into .bin (git-ignored) at every setup (seconds once Go's build cache
# is warm); the module comes from the Go module proxy into Go's module cache
# (go.sum pins it), so no network is needed afterwards. Best effort: without
# it metalog drill and tests/drill say so and fail.
porcupine_setup() {
  local go
  go="$(command -v go || true)"
  if [ -z "$go" ] && [ -x /usr/local/go/bin/go ]; then go=/usr/local/go/bin/go; fi
  if [ -z "$go" ]; then
    echo "run.sh: go not found: the drill's checker .bin/metalog-porcupine was not built, so metalog drill and tests/drill will fail (install Go, then bash run.sh setup)" >&2
    return 0
  fi
  (cd tools/drill/porcupine && GOFLAGS=-mod=readonly "$go" build -trimpath -o ../../../.bin/metalog-porcupine .) \
    || echo "run.sh: could not build .bin/metalog-porcupine (Porcupine from the Go module proxy); metalog drill and tests/drill will fail" >&2
}

# metalog-kubecheck (tools/deploy/kubecheck): decodes the Kubernetes manifests
# strictly into k8s.io/api's types and checks what ties them together
# (tests/deploy). Built like metalog-porcupine: Go, the Go module proxy, go.sum.
kubecheck_setup() {
  local go
  go="$(command -v go || true)"
  if [ -z "$go" ] && [ -x /usr/local/go/bin/go ]; then go=/usr/local/go/bin/go; fi
  if [ -z "$go" ]; then
    echo "run.sh: go not found: .bin/metalog-kubecheck was not built, so tests/deploy will fail (install Go, then bash run.sh setup)" >&2
    return 0
  fi
  (cd tools/deploy/kubecheck && GOFLAGS=-mod=readonly "$go" build -trimpath -o ../../../.bin/metalog-kubecheck .) \
    || echo "run.sh: could not build .bin/metalog-kubecheck (k8s.io/api from the Go module proxy); tests/deploy will fail" >&2
}

# Apache Kafka, the judge of our files (tests/kafka, metalog.tools.kafka): the
# release pinned in tools/kafka/pom.xml, its jars copied by Maven into
# .kafka/lib (git-ignored). Fetched once: skipped while the pinned version's
# jars are there, so no network is needed after the first setup.
kafka_setup() {
  local version lib=.kafka/lib
  version="$(sed -n 's:.*<kafka.version>\(.*\)</kafka.version>.*:\1:p' tools/kafka/pom.xml)"
  if [ -f "$lib/kafka-shell-$version.jar" ] && [ -f "$lib/kafka-tools-$version.jar" ]; then
    return 0
  fi
  if ! command -v mvn >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo -n"; fi
    echo "run.sh: installing maven (to fetch Apache Kafka's jars)" >&2
    { $SUDO apt-get update -qq && $SUDO env DEBIAN_FRONTEND=noninteractive \
        apt-get install -y -qq --no-install-recommends maven >/dev/null; } || true
  fi
  if ! command -v mvn >/dev/null 2>&1; then
    echo "run.sh: mvn not found: Apache Kafka's jars were not fetched, so tests/kafka will fail (install Maven, then bash run.sh setup)" >&2
    return 0
  fi
  if ! command -v java >/dev/null 2>&1; then
    echo "run.sh: java not found: Apache Kafka's tools cannot run, so tests/kafka will fail (install Java 17, then bash run.sh setup)" >&2
    return 0
  fi
  echo "run.sh: fetching Apache Kafka $version's jars into $lib (Maven)" >&2
  rm -rf "$lib.part" "$lib"
  mvn -q -B -f tools/kafka/pom.xml dependency:copy-dependencies -DincludeScope=runtime \
    -DoutputDirectory="$PWD/$lib.part"
  mv "$lib.part" "$lib"
}

cmd="${1:-}"
shift || true
case "$cmd" in
  setup)
    setup
    ;;
  test)
    setup
    # The etcd comparison test runs against a real etcd when there is one (it
    # checks the "no etcd" message otherwise): install it where we can.
    if ! command -v etcd >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
      if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo -n"; fi
      echo "run.sh: installing etcd-server for the etcd comparison test" >&2
      { $SUDO apt-get update -qq && $SUDO apt-get install -y -qq etcd-server >/dev/null; } \
        || echo "run.sh: could not install etcd-server; the bench test checks the no-etcd path" >&2
    fi
    # pytest exits 5 when it collected no test: for us that is always a mistake.
    set +e
    .venv/bin/python -m pytest "$@"
    rc=$?
    set -e
    if [ "$rc" = 5 ]; then echo "run.sh: pytest collected no tests" >&2; exit 1; fi
    exit "$rc"
    ;;
  cluster)
    setup
    exec .venv/bin/metalog cluster up "$@"
    ;;
  *)
    echo "usage: bash run.sh {cluster|test|setup} [args...]" >&2
    exit 2
    ;;
esac

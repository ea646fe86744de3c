"""Requests to the other voters: the core's ``SendRequest`` actions, and where
the peers are.

A request is written at once if its connection is up (a follower's next
Fetch leaves before the loop turn applies committed records or answers
anyone else), and its answer steps the core with ``ResponseReceived`` from
the read that brings it (``PeerChannel.request_now``); a failure steps it
with ``RequestFailed`` a loop turn later (api rule 4: exactly one of them
per request). A request whose connection is not up is connected, written
and awaited by a background task.

The peers' addresses start as the config's voters and follow the core: a
voter set in the log (KIP-853) names each voter's listeners, and a leader
says where it listens (BeginQuorumEpoch).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable, Coroutine, Protocol

from metalog.broker.net.channel import NetError, PeerPool
from metalog.broker.net.tls import INSECURE_DETAIL
from metalog.broker.quorum import api as qa
from metalog.broker.quorum.voters import VoterSet
from metalog.broker.server.clocks import now_ms
from metalog.broker.server.commit_trace import CommitTrace
from metalog.broker.server.config import BrokerConfig, Endpoint
from metalog.broker.server.gate import Gate
from metalog.protocol import messages as m
from metalog.protocol.apis import REQUEST_API_KEY, ApiKey
from metalog.protocol.errors import Errors
from metalog.protocol.invariants import InvariantViolation
from metalog.protocol.kafka.errors import KafkaDecodeError
from metalog.protocol.kafka.framing import ProtocolError

# What a peer's request may fail with (timeouts, refused connections, resets,
# a peer's garbled answer): the core hears RequestFailed. Anything else is a bug.
_PEER_FAILURES = (NetError, ProtocolError, KafkaDecodeError, OSError, asyncio.TimeoutError)


def tls_files(cfg: BrokerConfig, log: Any) -> Any:
    """The certificate files of TLS mode (TlsFiles), or None in insecure mode (logged)."""
    if not cfg.tls_enabled:
        log.warning("insecure_mode", security_protocol=cfg.security.security_protocol, detail=INSECURE_DETAIL)
        return None
    from metalog.broker.net.tls import TlsFiles

    # Raises TlsConfigError (a ValueError: "refusing to start") for unreadable or mismatched files.
    return TlsFiles(cfg.tls_paths(), check_interval_s=cfg.security.ssl_reload_check_ms / 1000, logger=log)


def peer_pool(cfg: BrokerConfig, voters: dict[int, Endpoint], tls: Any) -> PeerPool:
    """Channels to every other voter of the config (more join from the log's voter set)."""
    return PeerPool(
        {nid: (ep.host, ep.port) for nid, ep in voters.items() if nid != cfg.node_id},
        client_id=f"metalog-{cfg.node_id}", max_frame_bytes=cfg.network.max_frame_bytes,
        connect_timeout_ms=cfg.network.connect_timeout_ms,
        reconnect_backoff_max_ms=cfg.network.reconnect_backoff_max_ms, tls=tls)


class PeerCore(Protocol):
    """What the outbound side reads of the quorum core."""

    @property
    def voter_set(self) -> VoterSet: ...

    @property
    def leader_endpoints(self) -> tuple[int, int, tuple[tuple[str, str, int], ...]] | None: ...

    @property
    def log_end_offset(self) -> int: ...


class Outbound:
    def __init__(self, core: PeerCore, peers: PeerPool, node_id: int, gate: Gate, trace: CommitTrace | None,
                 logger: Any, *, step: Callable[[qa.Event], None],
                 spawn: Callable[[Coroutine[Any, Any, None]], None],
                 fail: Callable[[str, str, BaseException | None], None]):
        self._core = core
        self._peers = peers
        self._node_id = node_id
        self._gate = gate  # its voter-only RPCs follow the voter set
        self._trace = trace
        self._log = logger
        self._step = step  # steps the core with an event
        self._spawn = spawn  # runs a background task whose failure is fatal
        self._fail = fail  # fail-stop (cause, reason, exc): a bug met while stepping with an answer
        self._stopped = False  # stopping, past the drain: answers are dropped (see stop)
        self._voter_set_seen: VoterSet | None = None  # the voter set the peers and the gate were last given
        self._leader_endpoints_seen: Any = None  # the leader_endpoints last applied to the peers

    # ------------------------------------------------------------ requests
    def send_now(self, a: qa.SendRequest) -> None:
        """Write the request now if its connection is up, its answer stepping
        the core in the turn that reads it; otherwise a background task
        connects, writes and awaits it."""
        api_key = REQUEST_API_KEY[type(a.request)]
        trace = self._trace
        fetch = a.request if trace is not None and isinstance(a.request, m.FetchRequest) else None
        if trace is not None and fetch is not None:
            trace.mark("fetch_action", fetch.fetch_offset, a.destination)
        try:
            channel = self._peers.channel(a.destination)
        except KeyError:
            self._spawn(self._await_answer(a, None))
            return

        def on_answer(response: m.Body | None, exc: BaseException | None) -> None:
            if self._stopped:
                return
            try:
                self._answered(a, response, exc)
            except Exception as err:  # noqa: BLE001 - as a background task's failure: fatal
                self._fail("task_failed", f"answer to {type(a.request).__name__} from node {a.destination} "
                           f"failed: {type(err).__name__}: {err}", err)

        # (a task per request cost a follower ~3% of its CPU and a loop turn per Fetch answer)
        if channel.request_now(api_key, a.request, a.timeout_ms, on_answer):
            if trace is not None and fetch is not None:
                trace.mark("fetch_sent", fetch.fetch_offset, a.destination)
            return
        self._spawn(self._await_answer(a, channel.request(api_key, a.request, a.timeout_ms)))

    def stop(self) -> None:
        """The broker is stopping, past its drain: answers still coming (the
        channels' close fails those in flight) no longer step the core, as
        the background tasks awaiting the others are cancelled."""
        self._stopped = True

    async def _await_answer(self, a: qa.SendRequest, answer: Any) -> None:
        if answer is None:
            # A voter the log names without an endpoint we know: nothing to send
            # to, as if it were unreachable (the core retries or gives up).
            self._step(qa.RequestFailed(now_ms(), a.request_id, a.destination,
                                        f"no address known for node {a.destination}"))
            return
        try:
            response = await answer
        except _PEER_FAILURES as exc:
            self._answered(a, None, exc)
            return
        self._answered(a, response, None)

    def _answered(self, a: qa.SendRequest, response: m.Body | None, exc: BaseException | None) -> None:
        """Step the core with the request's one answer (api rule 4)."""
        step = self._step
        if exc is not None:
            if not isinstance(exc, _PEER_FAILURES):
                raise exc  # anything else is a bug: fatal
            step(qa.RequestFailed(now_ms(), a.request_id, a.destination, f"{type(exc).__name__}: {exc}"))
            return
        if isinstance(response, m.ErrorResponse) and response.error_code != Errors.UNSUPPORTED_VERSION:
            # (UNSUPPORTED_VERSION reaches the core: a peer of an older build
            # refusing Vote v2 makes a prospective stand at once, KIP-996.)
            step(qa.RequestFailed(now_ms(), a.request_id, a.destination,
                                  f"peer answered error {response.error_code}: {response.error_message}"))
            return
        if response is None:
            raise InvariantViolation(f"no answer and no error for request {a.request_id}")
        trace = self._trace
        if trace is not None and type(response) is m.FetchResponse and response.records:
            received_ns = time.monotonic_ns()
            step(qa.ResponseReceived(now_ms(), a.request_id, a.destination, response))
            trace.mark("fetch_resp", self._core.log_end_offset, a.destination, ns=received_ns)
            return
        step(qa.ResponseReceived(now_ms(), a.request_id, a.destination, response))

    # ------------------------------------------------------ peer addresses
    def follow_core(self) -> None:
        """After each step: the peers' addresses follow the core's voter set and its leader's word."""
        core = self._core
        if core.voter_set is not self._voter_set_seen:
            self._on_voter_set(core.voter_set)
            self._leader_endpoints_seen = None  # the set's endpoints were just applied: re-apply the leader's
        hint = core.leader_endpoints
        if hint is not None and hint is not self._leader_endpoints_seen:
            # KIP-853: our leader told us where it listens (BeginQuorumEpoch);
            # its entry in our voter set may still name an old address.
            self._leader_endpoints_seen = hint
            leader_id, _epoch, endpoints = hint
            if leader_id != self._node_id and endpoints:
                _name, host, port = endpoints[0]
                self._peers.set_endpoint(leader_id, host, port)

    def _on_voter_set(self, voter_set: VoterSet) -> None:
        """KIP-853: the core's voter set changed (or is first seen). Voters
        named by a VotersRecord are reached at the first endpoint it gives
        them; the gate's voter-only RPCs follow the set."""
        self._voter_set_seen = voter_set
        for nid, endpoints in voter_set.endpoints.items():
            if nid != self._node_id and endpoints:
                _name, host, port = endpoints[0]
                self._peers.set_endpoint(nid, host, port)
        self._gate.voters = frozenset(voter_set.ids)
        self._gate.voters_in_log = voter_set.kraft_version == 1
        if voter_set.kraft_version > 0:
            self._log.info("voter_set", voters=list(voter_set.ids), kraft_version=voter_set.kraft_version,
                           directory_ids=dict(voter_set.directory_ids),
                           endpoints={nid: [f"{name}={host}:{port}" for name, host, port in eps]
                                      for nid, eps in voter_set.endpoints.items()})

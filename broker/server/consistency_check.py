"""The leader's side of the cross-replica consistency check (asyncio).

Every ``consistency_check_interval_ms`` the leader asks each voter for the
digests of a committed range both hold (``metalog.broker.server.consistency`` computes and
compares them) and raises the divergence alarm on a mismatch: one
``divergence_detected`` error event, ``metalog_divergence_detected_total``
and /health "degraded" with the reason.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

from metalog.broker.net.channel import NetError, PeerPool
from metalog.broker.quorum.progress import ReplicaProgress
from metalog.broker.server.config import BrokerConfig
from metalog.broker.server.consistency import LogDigest, compare
from metalog.broker.server.metrics import BrokerMetrics
from metalog.protocol import messages as m
from metalog.protocol.apis import ApiKey
from metalog.protocol.errors import Errors
from metalog.protocol.kafka.edge import ResponseDecodeError
from metalog.protocol.kafka.framing import ProtocolError
from metalog.storage.segments import SegmentedLog


class Running(Protocol):
    """Whether the broker still runs (the check stops with it)."""

    @property
    def stopping(self) -> bool: ...

    @property
    def fatal(self) -> str | None: ...


class CheckedCore(Protocol):
    """What the check reads of the quorum core."""

    @property
    def is_leader(self) -> bool: ...

    @property
    def epoch(self) -> int: ...

    @property
    def high_watermark(self) -> int: ...

    @property
    def replica_states(self) -> dict[int, ReplicaProgress]: ...


class ConsistencyChecker:
    def __init__(self, running: Running, cfg: BrokerConfig, core: CheckedCore, digest: LogDigest, peers: PeerPool,
                 seg_log: SegmentedLog, metrics: BrokerMetrics, logger: Any, health_problems: dict[str, str]):
        self._running = running
        self._interval_ms = cfg.storage.consistency_check_interval_ms
        self._request_timeout_ms = cfg.quorum.request_timeout_ms
        self._node_id = cfg.node_id
        self._cluster_id = cfg.cluster_id
        self._voters = sorted(cfg.voter_endpoints())  # the config's voters (a voter set in the log is not asked)
        self._core = core
        self._digest = digest
        self._peers = peers
        self._seg_log = seg_log
        self._metrics = metrics
        self._log = logger
        self._health_problems = health_problems  # /health's reasons, shared with the driver

    async def run(self) -> None:
        """Every consistency_check_interval_ms while leader, until the broker stops."""
        running = self._running
        interval_s = self._interval_ms / 1000
        while not running.stopping:
            await asyncio.sleep(interval_s)
            if running.fatal is None and not running.stopping and self._core.is_leader:
                await self.check_all()

    async def check_all(self) -> dict[int, str]:
        """Leader: compare the committed prefix both hold with every voter.
        Returns voter -> match | mismatch | skipped | failed."""
        results: dict[int, str] = {}
        for voter in self._voters:
            if voter == self._node_id or not self._core.is_leader:
                continue
            results[voter] = result = await self._check_voter(voter)
            self._metrics.consistency_checks.labels(result=result).inc()
        return results

    async def _check_voter(self, voter: int) -> str:
        core, d = self._core, self._digest
        st = core.replica_states.get(voter)
        hw = core.high_watermark
        if st is None or hw <= 0 or st.log_end_offset <= 0:
            return "skipped"
        start = d.first_base
        end = d.floor_boundary(min(hw, st.log_end_offset))
        if end <= start:
            return "skipped"
        req = m.ConsistencyCheckRequest(cluster_id=self._cluster_id, leader_id=self._node_id,
                                        leader_epoch=core.epoch, start_offset=start, end_offset=end)
        try:
            resp = await self._peers.channel(voter).request(ApiKey.CONSISTENCY_CHECK, req, self._request_timeout_ms)
        except (NetError, ProtocolError, ResponseDecodeError, OSError, asyncio.TimeoutError) as exc:
            self._log.info("consistency_check_failed", replica=voter, error=f"{type(exc).__name__}: {exc}")
            return "failed"
        if not isinstance(resp, m.ConsistencyCheckResponse) or resp.error_code != Errors.NONE:
            self._log.info("consistency_check_skipped", replica=voter, error_code=getattr(resp, "error_code", None),
                           error=getattr(resp, "error_message", None))
            return "skipped"
        if (resp.start_offset < d.first_base or resp.end_offset > min(d.end_offset, core.high_watermark)
                or not d.boundary(resp.start_offset) or not d.boundary(resp.end_offset)):
            # Our log moved (log start advanced) or the voter's boundaries are not
            # ours: a different batch boundary inside the range shows as a mismatch.
            return "skipped"
        mine = d.digest_chunks(resp.start_offset, resp.end_offset, req.chunks)
        bad = compare(mine, resp.chunks)
        if bad is None:
            self._log.debug("consistency_check_passed", replica=voter, start_offset=resp.start_offset,
                            end_offset=resp.end_offset)
            return "match"
        self._divergence(voter, bad, mine, resp)
        return "mismatch"

    def _divergence(self, voter: int, bad: m.ConsistencyChunk, mine: list[m.ConsistencyChunk],
                    resp: m.ConsistencyCheckResponse) -> None:
        ours = next((c for c in mine if c.start_offset == bad.start_offset), None)
        bases = [base for base in self._seg_log.segment_base_offsets if base <= bad.start_offset]
        segment = f"{bases[-1]:020d}.log" if bases else None
        reason = (f"voter {voter} holds different committed data than this leader in offsets "
                  f"[{bad.start_offset}, {bad.end_offset}) (leader segment {segment})")
        self._metrics.divergence_detected.labels(replica=str(voter)).inc()
        self._health_problems[f"divergence_replica_{voter}"] = reason
        self._log.error("divergence_detected", replica=voter, first_diverging_start_offset=bad.start_offset,
                        first_diverging_end_offset=bad.end_offset, leader_segment=segment,
                        leader_digest=ours.digest if ours else None, replica_digest=bad.digest,
                        checked_start_offset=resp.start_offset, checked_end_offset=resp.end_offset,
                        reason=reason, action="compare the range on both replicas (metalog dump); "
                        "the replica whose copy is wrong must be wiped and re-replicated")


"""The leader's side of the cross-replica consistency check (asyncio).

Every ``consistency_check_interval_ms`` the leader asks each voter for the
digests of a committed range both hold (``metalog.broker.server.consistency`` computes and
compares them) and raises the divergence alarm on a mismatch: one
``divergence_detected`` error event, ``metalog_divergence_detected_total``
and /health "degraded" with the reason.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from metalog.broker.server.consistency import compare
from metalog.broker.net.channel import NetError
from metalog.protocol import messages as m
from metalog.protocol.apis import ApiKey
from metalog.protocol.codec import ProtocolError
from metalog.protocol.errors import Errors

if TYPE_CHECKING:  # the runtime imports this module: no cycle at run time
    from metalog.broker.server.runtime import Broker


class ConsistencyChecker:
    def __init__(self, broker: "Broker"):
        self.broker = broker

    async def run(self) -> None:
        """Every consistency_check_interval_ms while leader, until the broker stops."""
        b = self.broker
        interval_s = b.cfg.storage.consistency_check_interval_ms / 1000
        while not b.stopping:
            await asyncio.sleep(interval_s)
            if b.fatal is None and not b.stopping and b.core.is_leader:
                await self.check_all()

    async def check_all(self) -> dict[int, str]:
        """Leader: compare the committed prefix both hold with every voter.
        Returns voter -> match | mismatch | skipped | failed."""
        b = self.broker
        core = b.core
        results: dict[int, str] = {}
        for voter in sorted(b.voters):
            if voter == b.cfg.node_id or str(core.role) != "leader":
                continue
            results[voter] = result = await self._check_voter(voter)
            b.metrics.consistency_checks.labels(result=result).inc()
        return results

    async def _check_voter(self, voter: int) -> str:
        b = self.broker
        core = b.core
        st = core.replica_states.get(voter)
        hw = core.high_watermark
        if st is None or hw <= 0 or st.log_end_offset <= 0:
            return "skipped"
        start = b.digest.first_base
        end = b.digest.floor_boundary(min(hw, st.log_end_offset))
        if end <= start:
            return "skipped"
        req = m.ConsistencyCheckRequest(cluster_id=b.cfg.cluster_id, leader_id=b.cfg.node_id,
                                        leader_epoch=core.epoch, start_offset=start, end_offset=end)
        try:
            resp = await b.peers.channel(voter).request(ApiKey.CONSISTENCY_CHECK, req,
                                                        b.cfg.quorum.request_timeout_ms)
        except (NetError, ProtocolError, OSError, asyncio.TimeoutError) as exc:
            b.log.info("consistency_check_failed", replica=voter, error=f"{type(exc).__name__}: {exc}")
            return "failed"
        if not isinstance(resp, m.ConsistencyCheckResponse) or resp.error_code != Errors.NONE:
            b.log.info("consistency_check_skipped", replica=voter, error_code=getattr(resp, "error_code", None),
                       error=getattr(resp, "error_message", None))
            return "skipped"
        d = b.digest
        if (resp.start_offset < d.first_base or resp.end_offset > min(d.end_offset, core.high_watermark)
                or not d.boundary(resp.start_offset) or not d.boundary(resp.end_offset)):
            # Our log moved (log start advanced) or the voter's boundaries are not
            # ours: a different batch boundary inside the range shows as a mismatch.
            return "skipped"
        mine = d.digest_chunks(resp.start_offset, resp.end_offset, req.chunks)
        bad = compare(mine, resp.chunks)
        if bad is None:
            b.log.debug("consistency_check_passed", replica=voter, start_offset=resp.start_offset,
                        end_offset=resp.end_offset)
            return "match"
        self._divergence(voter, bad, mine, resp)
        return "mismatch"

    def _divergence(self, voter: int, bad: m.ConsistencyChunk, mine: list[m.ConsistencyChunk],
                    resp: m.ConsistencyCheckResponse) -> None:
        b = self.broker
        ours = next((c for c in mine if c.start_offset == bad.start_offset), None)
        bases = [base for base in b.seg_log.segment_base_offsets if base <= bad.start_offset]
        segment = f"{bases[-1]:020d}.log" if bases else None
        reason = (f"voter {voter} holds different committed data than this leader in offsets "
                  f"[{bad.start_offset}, {bad.end_offset}) (leader segment {segment})")
        b.metrics.divergence_detected.labels(replica=str(voter)).inc()
        b.health_problems[f"divergence_replica_{voter}"] = reason
        b.log.error("divergence_detected", replica=voter, first_diverging_start_offset=bad.start_offset,
                    first_diverging_end_offset=bad.end_offset, leader_segment=segment,
                    leader_digest=ours.digest if ours else None, replica_digest=bad.digest,
                    checked_start_offset=resp.start_offset, checked_end_offset=resp.end_offset,
                    reason=reason, action="compare the range on both replicas (metalog dump); "
                    "the replica whose copy is wrong must be wiped and re-replicated")


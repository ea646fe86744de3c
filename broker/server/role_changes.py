"""What follows a change of the quorum core's role, epoch or leader.

The runtime calls ``RoleChanges.observe`` after every step; when the
(role, epoch, leader) it sees differs from the last, this logs
``role_changed``, updates the role metrics and lets the event-loop thread's
scheduler slice follow the role (``metalog.broker.server.leader_slice``).
"""

from __future__ import annotations

from typing import Any, Protocol

from metalog.broker.server.leader_slice import LeaderSlice
from metalog.broker.server.metrics import BrokerMetrics


class CoreRole(Protocol):
    """What is read of the quorum core."""

    @property
    def role(self) -> Any: ...

    @property
    def epoch(self) -> int: ...

    @property
    def leader_id(self) -> int: ...

    @property
    def high_watermark(self) -> int | None: ...

    @property
    def is_leader(self) -> bool: ...


class RoleChanges:
    def __init__(self, logger: Any, metrics: BrokerMetrics, leader_slice: LeaderSlice):
        self._log = logger
        self._metrics = metrics
        self._slice = leader_slice
        self._last: tuple[Any, int, int] | None = None

    def observe(self, core: CoreRole) -> None:
        exposed = (core.role, core.epoch, core.leader_id)  # (str(role) only when it changed)
        if exposed == self._last:
            return
        self._last = exposed
        role = str(exposed[0])
        self._log.info("role_changed", role=role, epoch=core.epoch, leader_id=core.leader_id,
                       high_watermark=core.high_watermark)
        self._metrics.set_role(role, core.epoch)
        self._metrics.raft.on_role(role)
        self._slice.apply(core.is_leader)

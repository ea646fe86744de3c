"""Kafka brokers' lifecycle at the controller: BrokerRegistration (api 62)
and BrokerHeartbeat (api 63), as Kafka's active controller answers them
(ClusterControlManager.registerBroker, ReplicationControlManager
.processBrokerHeartbeat, BrokerHeartbeatManager), and the fencing of a broker
whose heartbeats stopped.

Sans-IO, as the rest of the controller: each function takes the controller
(its applied state), the leader's ``BrokerSessions`` and the time, and returns
the records to append and the answer's fields. The command queue
(``commands.py``) runs them on the leader against a state that holds every
record in the log, so ``write_offset`` -- the log end -- is the offset the
first returned record will take.

Rules (Kafka's):

* Registration: a live broker id (a valid session) with another incarnation
  id -> DUPLICATE_BROKER_REGISTRATION. The broker's feature ranges must hold
  every finalized level (metadata.version first; a broker sending none is
  taken to support only 3.0-IV1) -> UNSUPPORTED_VERSION. At metadata.version
  3.7-IV2 or later the log dirs must be given, not reserved, not repeated and
  no other broker's -> INVALID_REGISTRATION. The same incarnation id amends
  the registration (same epoch, same fenced state); a new one registers
  fenced with a new broker epoch = the offset of its RegisterBrokerRecord
  (after fencing the old incarnation if it was unfenced: Kafka's unclean
  shutdown cleanup), preceded by a FeatureLevelRecord of the finalized
  metadata.version: a Kafka controller writes one when it bootstraps the log,
  a metalog cluster is born at its level without one, and a Kafka broker's
  metadata loader cannot publish a log that has none.
* Heartbeat: unknown broker -> BROKER_ID_NOT_REGISTERED, another epoch ->
  STALE_BROKER_EPOCH. Caught up = the broker's metadata offset has reached
  its registration's offset (our broker epochs are those offsets). Fenced and
  not wanting to be, caught up -> unfenced (BrokerRegistrationChangeRecord
  fenced=-1, what Kafka writes from metadata.version 3.3, plus a leader for
  every offline partition whose ISR holds it); unfenced and wanting fence or
  shutdown -> fenced (fenced=1, plus the ISR and leader changes). Kafka's
  controlled shutdown (keep serving until leaderships moved) is not modelled:
  a broker asking to shut down is fenced at once and told to shut down.
* Sessions: a broker that registered through BrokerRegistration (its record
  has log dirs) and sent nothing for ``session_timeout_ms`` is fenced, one
  broker per check as Kafka does. A new leader starts every such unfenced
  broker's session at its first check. Brokers registered by our CLI's
  ``register_broker`` command (no log dirs, no heartbeats) have no session.
"""

from __future__ import annotations

from typing import Any, Mapping

from metalog.broker.controller.state import CommandError, Controller
from metalog.protocol.errors import Errors
from metalog.storage import metadata_records as r

# Kafka's default broker.session.timeout.ms.
SESSION_TIMEOUT_MS_DEFAULT = 9000
# How often the leader looks for stale sessions (Kafka checks on its event queue, ~every 100 ms).
SESSION_CHECK_INTERVAL_MS = 250
# metadata.version levels (Kafka's MetadataVersion feature levels).
MV_MINIMUM_KRAFT = 1  # 3.0-IV1: what a broker sending no metadata.version range supports
MV_DIRECTORY_ASSIGNMENT = 17  # 3.7-IV2: registrations carry log dirs
ZERO_DIR = "00000000-0000-0000-0000-000000000000"
# Kafka's reserved directory ids (DirectoryId.UNASSIGNED, LOST, MIGRATING): 0..2 in the low bits.
RESERVED_DIRS = frozenset({ZERO_DIR, "00000000-0000-0000-0000-000000000001",
                           "00000000-0000-0000-0000-000000000002"})


class BrokerSessions:
    """The leader's view of which brokers are alive: the last contact of each
    broker that registered through BrokerRegistration. In memory only, as
    Kafka's BrokerHeartbeatManager: a new leader (``adopt``) starts a full
    session for every unfenced such broker. Bounded by the registered brokers
    (entries of brokers no longer registered are dropped at each check)."""

    def __init__(self, session_timeout_ms: int = SESSION_TIMEOUT_MS_DEFAULT):
        if session_timeout_ms <= 0:
            raise ValueError(f"session_timeout_ms must be > 0, got {session_timeout_ms}")
        self.session_timeout_ms = session_timeout_ms
        self._last_contact_ms: dict[int, int] = {}
        self._leader_epoch = -1
        self._next_check_ms = 0

    def adopt(self, leader_epoch: int, brokers: Mapping[int, r.RegisterBroker], now_ms: int) -> None:
        """Called on the leader before each use: a new leader epoch starts over."""
        if leader_epoch == self._leader_epoch:
            return
        self._leader_epoch = leader_epoch
        self._last_contact_ms = {bid: now_ms for bid, br in brokers.items() if br.log_dirs and not br.fenced}
        self._next_check_ms = now_ms

    def touch(self, broker_id: int, now_ms: int) -> None:
        self._last_contact_ms[broker_id] = now_ms

    def forget(self, broker_id: int) -> None:
        self._last_contact_ms.pop(broker_id, None)

    def is_live(self, broker_id: int, now_ms: int) -> bool:
        last_ms = self._last_contact_ms.get(broker_id)
        return last_ms is not None and now_ms - last_ms < self.session_timeout_ms

    def check_due(self, now_ms: int) -> bool:
        return now_ms >= self._next_check_ms

    def stale_broker(self, brokers: Mapping[int, r.RegisterBroker], now_ms: int) -> int | None:
        """The unfenced broker whose session expired longest ago (None if none); drops gone brokers."""
        self._next_check_ms = now_ms + SESSION_CHECK_INTERVAL_MS
        stale, oldest_ms = None, now_ms - self.session_timeout_ms
        for bid in list(self._last_contact_ms):  # bounded by the registered brokers
            br = brokers.get(bid)
            if br is None:
                del self._last_contact_ms[bid]
                continue
            last_ms = self._last_contact_ms[bid]
            if not br.fenced and last_ms <= oldest_ms:
                stale, oldest_ms = bid, last_ms
        return stale


def _change(br: r.RegisterBroker, fenced: int) -> bytes:
    return r.encode_record(r.BrokerRegistrationChange(br.broker_id, br.broker_epoch, fenced, 0))


def fence_records(controller: Controller, broker_id: int) -> list[bytes]:
    """Fence an unfenced broker as Kafka does at our metadata.version:
    BrokerRegistrationChangeRecord fenced=1 and the partition changes."""
    br = controller.state.brokers[broker_id]
    return [_change(br, 1)] + controller.fence_broker(broker_id)[1:]


def unfence_records(controller: Controller, broker_id: int) -> list[bytes]:
    """Unfence: BrokerRegistrationChangeRecord fenced=-1 and a leader for every
    offline partition whose ISR holds the broker."""
    br = controller.state.brokers[broker_id]
    return [_change(br, -1)] + controller.unfence_broker(broker_id)[1:]


def _check_features(features: Mapping[str, int], offered: Mapping[str, tuple[int, int]]) -> None:
    """Every finalized feature level within the broker's range (Kafka's processRegistrationFeature)."""
    offered = dict(offered)
    offered.setdefault(r.METADATA_VERSION, (MV_MINIMUM_KRAFT, MV_MINIMUM_KRAFT))
    for name, (low, high) in sorted(offered.items()):
        level = features.get(name, 0)
        if not low <= level <= high:
            raise CommandError(f"unable to register: the broker does not support finalized level {level} of "
                               f"{name} (it supports {low}-{high})", Errors.UNSUPPORTED_VERSION)
    for name, level in sorted(features.items()):
        if level != 0 and name not in offered:
            raise CommandError(f"unable to register: the broker does not support finalized level {level} of "
                               f"{name} (it supports 0-0)", Errors.UNSUPPORTED_VERSION)


def _check_log_dirs(controller: Controller, broker_id: int, log_dirs: tuple[str, ...]) -> None:
    if not log_dirs:
        raise CommandError("no directories specified in the registration", Errors.INVALID_REGISTRATION)
    if any(d in RESERVED_DIRS for d in log_dirs):
        raise CommandError("reserved directory id in the registration", Errors.INVALID_REGISTRATION)
    if len(set(log_dirs)) != len(log_dirs):
        raise CommandError("duplicate directory id in the registration", Errors.INVALID_REGISTRATION)
    for bid, br in controller.state.brokers.items():  # bounded by the registered brokers
        taken = set(br.log_dirs).intersection(log_dirs) if bid != broker_id else ()
        if taken:
            raise CommandError(f"broker {bid} is already registered with directory {min(taken)}",
                               Errors.INVALID_REGISTRATION)


def _endpoints(listeners: Any) -> tuple[r.Endpoint, ...]:
    out = []
    for name, host, port, protocol in listeners:
        if not 0 < int(port) < 65536:
            raise CommandError(f"listener {name!r}: port {port} out of range 1..65535")
        out.append(r.Endpoint(str(name), str(host), int(port), int(protocol)))
    return tuple(out)


def register(controller: Controller, sessions: BrokerSessions, args: Mapping[str, Any], *,
             write_offset: int, now_ms: int) -> tuple[list[bytes], dict[str, Any]]:
    """BrokerRegistration: (records, {"broker_epoch": epoch}); CommandError with Kafka's code if refused.
    `args`: broker_id, incarnation_id (uuid text), listeners [[name, host, port, security protocol]],
    features {name: [min, max]}, rack, log_dirs [uuid text]."""
    broker_id = int(args["broker_id"])
    incarnation = str(args["incarnation_id"])
    if broker_id < 0:
        raise CommandError(f"broker id must be >= 0, got {broker_id}")
    r.uuid_bytes(incarnation)  # ValueError: INVALID_REQUEST
    existing = controller.state.brokers.get(broker_id)
    if existing is not None and existing.incarnation_id != incarnation and sessions.is_live(broker_id, now_ms):
        raise CommandError(f"another broker is registered with id {broker_id}", Errors.DUPLICATE_BROKER_REGISTRATION)
    features = controller.state.features
    _check_features(features, {str(n): (int(lo), int(hi)) for n, (lo, hi) in dict(args.get("features", {})).items()})
    log_dirs = tuple(str(d) for d in args.get("log_dirs", ()))
    for d in log_dirs:
        r.uuid_bytes(d)
    if features.get(r.METADATA_VERSION, 0) >= MV_DIRECTORY_ASSIGNMENT:
        _check_log_dirs(controller, broker_id, log_dirs)
    rack = args.get("rack")
    endpoints = _endpoints(args.get("listeners", ()))
    records: list[bytes] = []
    if existing is not None and existing.incarnation_id == incarnation:  # amended: same epoch and state
        epoch, fenced = existing.broker_epoch, existing.fenced
    else:
        # metalog's log holds no metadata.version record until a snapshot (the cluster is born
        # at a level); a Kafka broker's metadata loader refuses a log without one ("Unknown
        # metadata version for FeaturesImage"): its registration carries the finalized level.
        records.append(r.encode_record(r.FeatureLevel(r.METADATA_VERSION, features.get(r.METADATA_VERSION, r.METADATA_VERSION_LEVEL))))
        if existing is not None and not existing.fenced:  # the old incarnation died unfenced
            records += fence_records(controller, broker_id)
        epoch, fenced = write_offset + len(records), True
        sessions.forget(broker_id)
    records.append(r.encode_record(r.RegisterBroker(broker_id, incarnation, epoch, endpoints,
                                                    None if rack is None else str(rack), fenced, log_dirs)))
    sessions.touch(broker_id, now_ms)
    return records, {"broker_epoch": epoch}


def heartbeat(controller: Controller, sessions: BrokerSessions, args: Mapping[str, Any], *,
              now_ms: int) -> tuple[list[bytes], dict[str, Any]]:
    """BrokerHeartbeat: (records, {"is_caught_up", "is_fenced", "should_shut_down"}).
    `args`: broker_id, broker_epoch, current_metadata_offset, want_fence, want_shut_down."""
    broker_id, epoch = int(args["broker_id"]), int(args["broker_epoch"])
    br = controller.state.brokers.get(broker_id)
    if br is None:
        raise CommandError(f"broker {broker_id} is not registered", Errors.BROKER_ID_NOT_REGISTERED)
    if br.broker_epoch != epoch:
        raise CommandError(f"broker {broker_id}: epoch {epoch} is not the registered epoch {br.broker_epoch}",
                           Errors.STALE_BROKER_EPOCH)
    caught_up = int(args.get("current_metadata_offset", -1)) >= br.broker_epoch
    want_fence, want_shut_down = bool(args.get("want_fence")), bool(args.get("want_shut_down"))
    records: list[bytes] = []
    fenced, shut_down = br.fenced, False
    if br.fenced:
        if want_shut_down:
            shut_down = True
        elif not want_fence and caught_up:
            records, fenced = unfence_records(controller, broker_id), False
    elif want_fence or want_shut_down:
        records, fenced, shut_down = fence_records(controller, broker_id), True, want_shut_down
    sessions.touch(broker_id, now_ms)
    return records, {"is_caught_up": caught_up, "is_fenced": fenced, "should_shut_down": shut_down}


def fence_stale(controller: Controller, sessions: BrokerSessions, now_ms: int) -> tuple[int, list[bytes]] | None:
    """(broker id, fence records) for one broker whose session expired, or None."""
    brokers = controller.state.brokers
    stale = sessions.stale_broker(brokers, now_ms)
    if stale is None:
        return None
    sessions.forget(stale)
    return stale, fence_records(controller, stale)

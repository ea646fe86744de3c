"""Controller commands: the table of commands and the queue that runs them.

A ControllerCommand request names a command (``create_topic``,
``add_acl`` ...) and its arguments. ``Command`` lists them; ``BUILDERS``
maps each writing command to the ``Controller`` builder that turns its
arguments into records (``CommandError`` if the state refuses it);
``READERS`` answers the read-only ones (``list_acls``, ``describe_configs``)
from the applied state. A writing command whose args hold
``validate_only: true`` is validated and answered, and writes nothing.

``LIFECYCLE`` are Kafka brokers' registration and heartbeats
(``broker_registration``, ``broker_heartbeat``: ``brokers.py``, served as
Kafka's BrokerRegistration and BrokerHeartbeat on the controller listener)
and their blocks of producer ids (``allocate_producer_ids``:
``producer_blocks.py``, Kafka's AllocateProducerIds):
they need the leader's broker sessions and the time, and answer fields
(the broker epoch; caught up, fenced, shut down) besides their records.

``CommandQueue`` runs queued commands one at a time on the leader, each
validated against a state that reflects every record in the log (so two
commands never both pass against the same stale state). It also fences a
broker whose session expired (``sessions_due``; one per check). It is
sans-IO: it returns the answers to send and the records to append, and the
runtime sends and appends them.
"""

from __future__ import annotations

import collections
import enum
from dataclasses import dataclass
from typing import Any, Callable

from metalog.broker.controller import brokers, producer_blocks, views
from metalog.broker.controller.state import CommandError, Controller
from metalog.protocol import messages as m
from metalog.protocol.errors import Errors
from metalog.protocol.invariants import invariant
from metalog.storage.metadata_records import (METADATA_VERSION, METADATA_VERSION_LEVEL, RESOURCE_BROKER,
                                              RESOURCE_TOPIC, FeatureLevel, encode_record)

MAX_QUEUED_COMMANDS = 1024
# An argument of any writing command: validate against the state, answer, write nothing
# (Kafka's validate_only of CreateTopics, CreatePartitions, IncrementalAlterConfigs).
VALIDATE_ONLY = "validate_only"


class Command(enum.StrEnum):
    CREATE_TOPIC = "create_topic"
    DELETE_TOPIC = "delete_topic"
    REGISTER_BROKER = "register_broker"
    UNREGISTER_BROKER = "unregister_broker"
    FENCE_BROKER = "fence_broker"
    UNFENCE_BROKER = "unfence_broker"
    ADD_ACL = "add_acl"
    REMOVE_ACL = "remove_acl"
    SET_CONFIG = "set_config"
    CREATE_PARTITIONS = "create_partitions"
    LIST_ACLS = "list_acls"  # read-only: answered from the applied state, no records, a page at a time
    DESCRIBE_CONFIGS = "describe_configs"  # read-only: one resource's configs, a page at a time
    BROKER_REGISTRATION = "broker_registration"  # Kafka's BrokerRegistration (brokers.register)
    BROKER_HEARTBEAT = "broker_heartbeat"  # Kafka's BrokerHeartbeat (brokers.heartbeat)
    ALLOCATE_PRODUCER_IDS = "allocate_producer_ids"  # Kafka's AllocateProducerIds (producer_blocks.allocate)


# Commands run with the leader's broker sessions and the time (brokers.py).
LIFECYCLE = frozenset({Command.BROKER_REGISTRATION, Command.BROKER_HEARTBEAT, Command.ALLOCATE_PRODUCER_IDS})


def _register_broker(c: Controller, args: dict) -> list[bytes]:
    endpoints = [(str(n), str(h), int(p)) for n, h, p in args.get("endpoints", [])]
    return c.register_broker(int(args["broker_id"]), endpoints, args.get("rack"))


def _set_config(c: Controller, args: dict) -> list[bytes]:
    value = args.get("value")
    return c.set_config(int(args["resource_type"]), str(args["resource_name"]), str(args["name"]),
                        None if value is None else str(value))


BUILDERS: dict[Command, Callable[[Controller, dict], list[bytes]]] = {
    Command.CREATE_TOPIC: lambda c, a: c.create_topic(str(a["name"]), int(a["partitions"]),
                                                      int(a["replication_factor"]), topic_id=a.get("topic_id")),
    Command.DELETE_TOPIC: lambda c, a: c.delete_topic(str(a["name"])),
    Command.CREATE_PARTITIONS: lambda c, a: c.create_partitions(str(a["name"]), int(a["count"])),
    Command.REGISTER_BROKER: _register_broker,
    Command.UNREGISTER_BROKER: lambda c, a: c.unregister_broker(int(a["broker_id"])),
    Command.FENCE_BROKER: lambda c, a: c.fence_broker(int(a["broker_id"])),
    Command.UNFENCE_BROKER: lambda c, a: c.unfence_broker(int(a["broker_id"])),
    Command.ADD_ACL: lambda c, a: c.add_acl(a),
    Command.REMOVE_ACL: lambda c, a: c.remove_acl(a),
    Command.SET_CONFIG: _set_config,
}


def parse_command(name: str) -> Command:
    try:
        return Command(name)
    except ValueError:
        raise CommandError(f"unknown controller command {name!r}") from None


def list_acls_page(controller: Controller, args: dict) -> dict:
    """list_acls: {"acls": [...], "next": id or None}, at most ``limit``
    (default and most: views.PAGE_LIMIT_MAX) ACLs by id after ``after``, so
    no answer holds every ACL; CommandError for a bad argument."""
    after, limit = args.get("after"), args.get("limit", views.PAGE_LIMIT_MAX)
    if after is not None and not isinstance(after, str):
        raise CommandError(f"after must be an ACL id (text), got {after!r}")
    if type(limit) is not int or not 1 <= limit <= views.PAGE_LIMIT_MAX:
        raise CommandError(f"limit must be an integer between 1 and {views.PAGE_LIMIT_MAX}, got {limit!r}")
    page = views.acls_page(controller.state, after or None, limit)
    return {"acls": page["acls"], "next": page["next"]}


def describe_configs_page(controller: Controller, args: dict) -> dict:
    """describe_configs: {"configs": {name: value}, "next": name or None} of
    one resource (``resource_type`` 2 topic / 4 broker, ``resource_name``),
    at most PAGE_LIMIT_MAX after ``after``; CommandError for an unknown topic
    (UNKNOWN_TOPIC_OR_PARTITION) or resource type."""
    rtype, name, after = args.get("resource_type"), args.get("resource_name"), args.get("after")
    if not isinstance(name, str) or (after is not None and not isinstance(after, str)):
        raise CommandError(f"resource_name and after must be text, got {name!r}, {after!r}")
    state = controller.state
    if rtype == RESOURCE_TOPIC and name not in state.topic_ids:
        raise CommandError(f"unknown topic {name!r}", Errors.UNKNOWN_TOPIC_OR_PARTITION)
    if rtype not in (RESOURCE_TOPIC, RESOURCE_BROKER):
        raise CommandError(f"unknown config resource type {rtype!r} (2 = topic, 4 = broker)")
    configs, cursor = views.configs_page(state, rtype, name, after or None, views.PAGE_LIMIT_MAX)
    return {"configs": configs, "next": cursor}


# Read-only commands: answered from the applied state, no records.
READERS: dict[str, Callable[[Controller, dict], dict]] = {
    Command.LIST_ACLS: list_acls_page,
    Command.DESCRIBE_CONFIGS: describe_configs_page,
}
invariant(set(BUILDERS) == set(Command) - set(READERS) - LIFECYCLE, "every writing command needs a builder")


def build_command(controller: Controller, command: str, args: dict) -> list[bytes]:
    """Records for one writing controller command; CommandError if the state
    refuses it or the command is unknown (or read-only)."""
    return build_command_records(controller, command, args)[0]


def build_command_records(controller: Controller, command: str, args: dict) -> tuple[list[bytes], int]:
    """``build_command``'s records and how many of them come before the
    command's own (the quorum's metadata.version record, on a log without
    one): the command's answer names the offset of its own first record."""
    cmd = parse_command(command)
    builder = BUILDERS.get(cmd)
    if builder is None:
        raise CommandError(f"controller command {command!r} writes nothing")
    records = builder(controller, args)
    state = controller.state
    if records and not state.metadata_version_logged:
        # Kafka's log holds metadata.version before any metadata record (its controller's
        # bootstrap); a Kafka controller or broker replaying ours stops without it.
        level = state.features.get(METADATA_VERSION, METADATA_VERSION_LEVEL)
        records.insert(0, encode_record(FeatureLevel(METADATA_VERSION, level)))
        return records, 1
    return records, 0


class CommandToken:
    """The core's token for a command's append: its answer goes to the queue."""

    __slots__ = ("conn", "correlation_id")

    def __init__(self, conn: Any, correlation_id: int):
        self.conn = conn
        self.correlation_id = correlation_id


@dataclass(frozen=True, slots=True)
class LeaderView:
    """What the queue needs of the core at one moment."""

    is_leader: bool
    leader_id: int  # m.NO_LEADER if unknown
    epoch: int
    log_end_offset: int
    now_ms: int = 0  # the leader's monotonic clock: broker sessions


class _SessionFence:
    """The 'connection' of a fence the queue starts itself (an expired broker
    session): the answer reports the fenced broker to `on_fenced`."""

    def __init__(self, broker_id: int, on_fenced: Callable[[int, int], None]):
        self._broker_id = broker_id
        self._on_fenced = on_fenced

    def send_response(self, _correlation_id: int, response: m.ControllerCommandResponse) -> bool:
        self._on_fenced(self._broker_id, response.error_code)
        return True


Answer = tuple[CommandToken, m.ControllerCommandResponse]


class CommandQueue:
    def __init__(self, max_queued: int = MAX_QUEUED_COMMANDS,
                 session_timeout_ms: int = brokers.SESSION_TIMEOUT_MS_DEFAULT,
                 on_session_fenced: Callable[[int, int], None] = lambda _broker_id, _error_code: None):
        if max_queued <= 0:
            raise ValueError(f"max_queued must be > 0, got {max_queued}")
        self.max_queued = max_queued
        self._queue: collections.deque[tuple[CommandToken, m.ControllerCommandRequest]] = collections.deque()
        self.in_flight: CommandToken | None = None
        self._in_flight_result: Any = None  # a lifecycle command's answer fields, sent once its records commit
        self._in_flight_skip = 0  # records before the in-flight command's own (metadata.version)
        self.sessions = brokers.BrokerSessions(session_timeout_ms)
        self._on_session_fenced = on_session_fenced  # (broker id, error code of the fence's append)

    def offer(self, conn: Any, correlation_id: int,
              body: m.ControllerCommandRequest) -> m.ControllerCommandResponse | None:
        """Queue a command; the answer to send at once if the queue is full."""
        if len(self._queue) >= self.max_queued:
            return m.ControllerCommandResponse(error_code=Errors.REQUEST_TIMED_OUT,
                                               error_message="controller command queue is full")
        self._queue.append((CommandToken(conn, correlation_id), body))
        return None

    @property
    def runnable(self) -> bool:
        return bool(self._queue) and self.in_flight is None

    def sessions_due(self, is_leader: bool, now_ms: int) -> bool:
        """Whether the leader should look for an expired broker session now (then pump)."""
        return is_leader and self.in_flight is None and self.sessions.check_due(now_ms)

    def _fence_stale(self, controller: Controller, core: LeaderView) -> tuple[CommandToken, list[bytes]] | None:
        sessions = self.sessions
        sessions.adopt(core.epoch, controller.state.brokers, core.now_ms)
        if not sessions.check_due(core.now_ms):
            return None
        found = brokers.fence_stale(controller, sessions, core.now_ms)
        if found is None:
            return None
        broker_id, records = found
        self.in_flight = CommandToken(_SessionFence(broker_id, self._on_session_fenced), 0)
        self._in_flight_result = None
        return self.in_flight, records

    def _run_lifecycle(self, controller: Controller, body: m.ControllerCommandRequest,
                       core: LeaderView) -> tuple[list[bytes], dict[str, Any]]:
        self.sessions.adopt(core.epoch, controller.state.brokers, core.now_ms)
        if body.command == Command.ALLOCATE_PRODUCER_IDS:
            try:
                return producer_blocks.allocate(controller.state, body.args)
            except producer_blocks.BlockError as exc:
                raise CommandError(str(exc), exc.error_code) from None
        if body.command == Command.BROKER_REGISTRATION:
            return brokers.register(controller, self.sessions, body.args, write_offset=core.log_end_offset,
                                    now_ms=core.now_ms)
        return brokers.heartbeat(controller, self.sessions, body.args, now_ms=core.now_ms)

    def pump(self, controller: Controller,
             core: LeaderView) -> tuple[list[Answer], tuple[CommandToken, list[bytes]] | None]:
        """Run queued commands until one needs an append (at most one in flight).
        Returns the answers to send, in order, and the (token, records) to
        append, which the core answers later through `done`."""
        answers: list[Answer] = []
        while self._queue and self.in_flight is None:
            if not core.is_leader:
                leader = m.LeaderIdAndEpoch(core.leader_id, core.epoch)
                answers += [(token, m.ControllerCommandResponse(error_code=Errors.NOT_LEADER_OR_FOLLOWER,
                                                                current_leader=leader))
                            for token, _body in self._queue]
                self._queue.clear()
                break
            if controller.applied_offset < core.log_end_offset:
                break  # earlier records not applied yet: pumped again after the next step
            fence = self._fence_stale(controller, core)
            if fence is not None:
                return answers, fence
            token, body = self._queue.popleft()
            reader = READERS.get(body.command)
            if reader is not None:
                try:
                    page = reader(controller, body.args)
                except CommandError as exc:
                    answers.append((token, m.ControllerCommandResponse(error_code=exc.error_code,
                                                                       error_message=str(exc))))
                    continue
                answers.append((token, m.ControllerCommandResponse(
                    base_offset=controller.applied_offset, leader_epoch=core.epoch, result=page)))
                continue
            result = None
            skip = 0
            try:
                if body.command in LIFECYCLE:
                    records, result = self._run_lifecycle(controller, body, core)
                else:
                    records, skip = build_command_records(controller, body.command, body.args)
            except CommandError as exc:
                answers.append((token, m.ControllerCommandResponse(error_code=exc.error_code,
                                                                   error_message=str(exc))))
                continue
            except (KeyError, TypeError, ValueError) as exc:
                answers.append((token, m.ControllerCommandResponse(
                    error_code=Errors.INVALID_REQUEST,
                    error_message=f"bad arguments for {body.command!r}: {type(exc).__name__}: {exc}")))
                continue
            if not records or body.args.get(VALIDATE_ONLY) is True:  # validated, nothing to write
                answers.append((token, m.ControllerCommandResponse(base_offset=core.log_end_offset,
                                                                   leader_epoch=core.epoch, result=result)))
                continue
            self.in_flight = token
            self._in_flight_result = result
            self._in_flight_skip = skip
            return answers, (token, records)
        if not self._queue and self.in_flight is None and core.is_leader \
                and controller.applied_offset >= core.log_end_offset:
            return answers, self._fence_stale(controller, core)
        return answers, None

    def done(self, token: CommandToken, response: m.ProduceResponse) -> Answer:
        """The core answered the in-flight command's append."""
        invariant(token is self.in_flight, "an answer for a command that is not in flight")
        self.in_flight = None
        result, self._in_flight_result = self._in_flight_result, None
        skip, self._in_flight_skip = self._in_flight_skip, 0
        base_offset = response.base_offset + skip if response.error_code == Errors.NONE else response.base_offset
        return token, m.ControllerCommandResponse(
            error_code=response.error_code, error_message=response.error_message,
            base_offset=base_offset, leader_epoch=response.leader_epoch,
            current_leader=response.current_leader, result=None if response.error_code else result)

    def fail_all(self, error_code: int, message: str) -> list[Answer]:
        """Answer the in-flight command and every queued one with an error."""
        tokens = ([self.in_flight] if self.in_flight is not None else []) + [t for t, _b in self._queue]
        self.in_flight = None
        self._in_flight_result = None
        self._queue.clear()
        return [(t, m.ControllerCommandResponse(error_code=error_code, error_message=message)) for t in tokens]

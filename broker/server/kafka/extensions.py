"""metalog's own apis in Kafka's framing (``protocol/kafka/schemas_metalog/``):
the serving side of the two extension messages Kafka has no counterpart for,
each mapped onto the flat request of ``metalog.protocol.messages`` and asked
of the broker's request router (``KafkaContext.ask``), as the other handler
modules do. The sending side is ``metalog.protocol.kafka.edge_client``.

* ControllerCommand (1000): the command by name, its arguments a JSON
  object in a string (anything else is INVALID_REQUEST, said in the
  message). The client's own cluster id goes to the router, which checks it.
  A node that does not lead forwards the command to the leader for its
  client (``admin.run_command``: the client's principal and host travel in
  ``forwarded_for``, the leader's gate judges them); a command already
  forwarded is not forwarded again. The answer keeps our codes
  (NOT_LEADER_OR_FOLLOWER with the current leader, not Kafka's
  NOT_CONTROLLER: our client follows the hint) and carries the result as JSON.
* ConsistencyCheck (1001): the leader's digest request to a voter, as is.
"""

from __future__ import annotations

import json
from typing import Any

from metalog.broker.net.kafka_conn import KafkaExchange
from metalog.broker.server.kafka.admin import COMMAND_TIMEOUT_MS_MAX, run_command
from metalog.broker.server.kafka.api import KafkaApi, KafkaContext
from metalog.protocol import messages as m
from metalog.protocol.apis import ApiKey
from metalog.protocol.errors import Errors
from metalog.protocol.kafka import messages as km

# Bytes of a command's arguments: JSON this large is no controller command.
ARGS_BYTES_MAX = 1 << 20


def _args(text: str) -> dict[str, Any] | str:
    """The arguments as a dict, or why they are not one."""
    if len(text) > ARGS_BYTES_MAX:
        return f"args of {len(text)} characters (at most {ARGS_BYTES_MAX})"
    try:
        args = json.loads(text)
    except ValueError as exc:
        return f"args are not JSON: {exc}"
    if not isinstance(args, dict):
        return f"args must be a JSON object, got {type(args).__name__}"
    return args


def _command_response(resp: m.ControllerCommandResponse) -> km.ControllerCommandResponse:
    out = km.ControllerCommandResponse(error_code=resp.error_code, error_message=resp.error_message,
                                       base_offset=resp.base_offset, leader_epoch=resp.leader_epoch,
                                       result=None if resp.result is None else json.dumps(resp.result))
    if resp.current_leader is not None:
        out.current_leader = km.ControllerCommandResponseLeaderIdAndEpoch(
            leader_id=resp.current_leader.leader_id, leader_epoch=resp.current_leader.leader_epoch)
    return out


def controller_command(ctx: KafkaContext, ex: KafkaExchange) -> None:
    req = ex.body
    args = _args(req.args)
    if isinstance(args, str):
        ex.respond(km.ControllerCommandResponse(error_code=Errors.INVALID_REQUEST,
                                                error_message=f"{req.command}: {args}"))
        return
    body = m.ControllerCommandRequest(cluster_id=req.cluster_id, command=req.command, args=args,
                                      timeout_ms=min(max(req.timeout_ms, 1), COMMAND_TIMEOUT_MS_MAX))
    run_command(ctx, ex, body, lambda resp: ex.respond(_command_response(resp)))


def consistency_check(ctx: KafkaContext, ex: KafkaExchange) -> None:
    req = ex.body
    body = m.ConsistencyCheckRequest(cluster_id=req.cluster_id, leader_id=req.leader_id,
                                     leader_epoch=req.leader_epoch, start_offset=req.start_offset,
                                     end_offset=req.end_offset, chunks=req.chunks)

    def answer(resp: m.ConsistencyCheckResponse) -> None:
        ex.respond(km.ConsistencyCheckResponse(
            error_code=resp.error_code, error_message=resp.error_message, start_offset=resp.start_offset,
            end_offset=resp.end_offset, chunks=[km.ConsistencyCheckResponseConsistencyChunk(
                start_offset=c.start_offset, end_offset=c.end_offset, digest=c.digest) for c in resp.chunks]))

    ctx.ask(ex, ApiKey.CONSISTENCY_CHECK, body, answer)


APIS: dict[int, KafkaApi] = {
    ApiKey.CONTROLLER_COMMAND: KafkaApi(km.ControllerCommandRequest, 0, 0, controller_command),
    ApiKey.CONSISTENCY_CHECK: KafkaApi(km.ConsistencyCheckRequest, 0, 0, consistency_check),
}

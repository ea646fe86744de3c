"""Kafka's protocol at the broker's edge (issue 32): the dispatch of the
Kafka listener (``metalog.broker.net.kafka_conn``) to the handlers of each
api, and those handlers.

The shape, for whoever adds an api:

* ``api.py``: the shared types. ``KafkaApi(request, min_version,
  max_version, handle)``: `request` is the generated request class
  (``metalog.protocol.kafka.messages``), the versions are the ones we serve
  (within the class's LOWEST/HIGHEST_VERSION), and ``handle(ctx, ex)`` is a
  plain function: `ctx` a ``KafkaContext``, `ex` a
  ``metalog.broker.net.kafka_conn.KafkaExchange`` (``ex.header``,
  ``ex.body`` the decoded Kafka request, ``ex.version``;
  ``ex.respond(kafka_response)`` once, ``ex.respond_nothing()`` for acks=0,
  ``ex.fail(error_code)`` for Kafka's error answer). Answers leave in
  request order whatever order the handlers answer in.
* ``ctx.ask(ex, api_key, internal_body, on_answer)`` runs one request of
  our own flat protocol (``metalog.protocol.messages``, e.g.
  ``m.ProduceRequest(cluster_id=ctx.cluster_id, records=[...])``) through
  the broker's existing ``RequestRouter``: the same refusals (failed disk,
  failed broker), the same authorization gate (our ACLs, the principal from
  the client's certificate), the same cluster-id check and the same
  handlers (produce path, core). `on_answer(internal_response)` is called
  once, on the loop, when the router answers; it maps the answer back to
  Kafka's nesting and calls ``ex.respond``. An exception in it answers the
  request UNKNOWN_SERVER_ERROR (logged), never reaches the router. A Kafka
  request may ask several times (one per partition, say) and respond once.
* ``ctx.endpoints()``: every node's Kafka listener {node id: (host, port)};
  ``ctx.listener_name``: its name (the security protocol, Kafka's default).
* ``cluster.py``: ApiVersions, Metadata, DescribeCluster, DescribeQuorum.
  ``data.py``: the data path (Produce, Fetch, ListOffsets, InitProducerId,
  OffsetForLeaderEpoch). Each module exports ``APIS: dict[int, KafkaApi]``;
  ``dispatch.py`` merges them into the served table and routes each
  exchange to its handler (ApiVersions reports the merged table).

Kafka's topic/partition nesting and its UUIDs are mapped here, at the edge;
the logic stays in the existing handlers (docs/kafka-listener.md).
"""

"""The broker, room by room: ``quorum`` (the pure replication and election
core), ``controller`` (the pure metadata state machine), ``net`` (request
server, peer channels, TLS), ``client`` (the client library) and ``server``
(the broker process that drives them)."""

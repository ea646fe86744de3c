"""The network: the request server (``server``), outbound peer channels
(``channel``), TLS contexts (``tls``), principals (``principal``), the retry
back-off (``backoff``) and the logger of code that runs inside an
application (``library_logging``). Knows nothing of the quorum, the
controller, the server process or the client (the import contract
``net-alone``)."""

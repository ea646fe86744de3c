"""The quorum core: KRaft's replication and election rules as a pure state
machine. Events in (requests, answers, ticks, flushes), actions out
(persist, append, flush, send, respond); no sockets, files, clocks or
randomness of its own (api.py is the contract, docs/quorum-core.md the guide)."""

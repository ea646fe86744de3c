"""The controller state machine: metadata records in, state out. Pure: no asyncio, sockets or files beyond snapshot reads."""

"""The deterministic simulator: the production quorum core in a fake world.

Seeded scheduler, fake clock, simulated network (drops, delays, partitions)
and disk (lost unflushed writes, corruption), and the invariant checker. Used
by the tests in tests/sim and by ``python -m metalog.tools.simulate``. It may import
only the pure core (metalog.broker.quorum), storage and protocol."""

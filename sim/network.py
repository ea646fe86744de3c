"""SimNetwork: who can reach whom, and how long a message takes.

The network decides the fate of one message at send time: dropped (random
loss, an isolated node, a one-way cut) or delivered after ``delay + jitter``
milliseconds. Jitter alone reorders messages. A cut made while a message is in
flight also drops it on arrival (``reachable`` is asked again at delivery).
All randomness comes from the ``random.Random`` handed in.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass
class NetworkConfig:
    delay_ms: int = 1
    jitter_ms: int = 4
    drop_probability: float = 0.0


@dataclass
class SimNetwork:
    rng: random.Random
    config: NetworkConfig = field(default_factory=NetworkConfig)
    isolated: set[int] = field(default_factory=set)
    cuts: set[tuple[int, int]] = field(default_factory=set)  # (src, dst): src's messages to dst are lost

    def reachable(self, src: int, dst: int) -> bool:
        if src == dst:
            return True
        if src in self.isolated or dst in self.isolated:
            return False
        return (src, dst) not in self.cuts

    def transit_ms(self, src: int, dst: int) -> int | None:
        """Delivery delay for one message, None if it is lost."""
        if not self.reachable(src, dst):
            return None
        if self.config.drop_probability and self.rng.random() < self.config.drop_probability:
            return None
        jitter = self.rng.randint(0, self.config.jitter_ms) if self.config.jitter_ms else 0
        return self.config.delay_ms + jitter

    def isolate(self, node: int) -> None:
        self.isolated.add(node)

    def cut(self, src: int, dst: int) -> None:
        self.cuts.add((src, dst))

    def heal(self, node: int | None = None) -> None:
        """Heal one node's partitions and cuts, or everything."""
        if node is None:
            self.isolated.clear()
            self.cuts.clear()
            return
        self.isolated.discard(node)
        self.cuts = {c for c in self.cuts if node not in c}

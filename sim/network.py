"""SimNetwork: who can reach whom, how long a message takes, and what the wire
does to the bytes of a fetch answer.

The network decides the fate of one message at send time: dropped (random
loss, an isolated node, a one-way cut) or delivered after ``delay + jitter``
milliseconds. Jitter alone reorders messages. A cut made while a message is in
flight also drops it on arrival (``reachable`` is asked again at delivery).
The timing randomness comes from the ``random.Random`` handed in as ``rng``.

Wire corruption (``fetch_flip_probability``): a fetch answer that carries
records may arrive with one bit flipped in one of its batches, the fault the
follower's CRC check exists for (the core drops that batch and what follows
and fetches it again: ``FetchedBatchCorrupt``). The bit is chosen where the
batch's own checks see it, from the magic byte to the end (magic, the CRC,
and the CRC-covered attributes, counts and records). A flip in the base
offset, length or leader epoch is outside the CRC in Kafka's format as in
ours (TCP's checksum and TLS's MAC are what guard those): injecting it would
test the format, not the code. Its dice are a stream of their own
(``rng_wire``), never ``rng``: a seed whose answers are never flipped replays
exactly as it did before the fault existed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import msgspec

from metalog.protocol import messages as m
from metalog.storage.batch import CRC_OFFSET, iter_batches

MAGIC_POSITION = CRC_OFFSET - 1  # the byte before the CRC: the first one a batch's checks cover


@dataclass
class NetworkConfig:
    delay_ms: int = 1
    jitter_ms: int = 4
    drop_probability: float = 0.0
    # Per fetch answer carrying records: the chance that one bit of it flips on the wire.
    fetch_flip_probability: float = 0.0


@dataclass(frozen=True)
class WireFlip:
    """One bit flipped in a fetch answer: which batch, where, and its bytes as they arrive."""

    base_offset: int  # of the damaged batch (the flip never touches this field)
    batch_epoch: int
    byte_position: int  # in the batch
    bit: int
    corrupt_batch: bytes  # the damaged batch, as the follower receives it


@dataclass
class SimNetwork:
    rng: random.Random
    config: NetworkConfig = field(default_factory=NetworkConfig)
    isolated: set[int] = field(default_factory=set)
    cuts: set[tuple[int, int]] = field(default_factory=set)  # (src, dst): src's messages to dst are lost
    # The wire-corruption dice (see the module docstring); the cluster seeds it from the seed.
    rng_wire: random.Random = field(default_factory=lambda: random.Random(0))

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
        jitter_ms = self.rng.randint(0, self.config.jitter_ms) if self.config.jitter_ms else 0
        return self.config.delay_ms + jitter_ms

    def maybe_flip(self, body: m.Body | None) -> tuple[m.FetchResponse, WireFlip] | None:
        """By the configured chance, `body` (a fetch answer with records) as it
        arrives with one bit flipped, and where; None: it arrives intact. Draws
        nothing for any other message, nor when the chance is 0."""
        p = self.config.fetch_flip_probability
        if not p or not isinstance(body, m.FetchResponse) or not body.records:
            return None
        if self.rng_wire.random() >= p:
            return None
        return self.flip(body)

    def flip(self, body: m.FetchResponse) -> tuple[m.FetchResponse, WireFlip]:
        """`body` with one bit flipped in one of its batches (chosen by rng_wire)."""
        batches = [(pos, h) for pos, h in iter_batches(body.records)]
        if not batches:
            raise ValueError("a fetch answer without a whole batch has nothing to flip")
        pos, h = self.rng_wire.choice(batches)
        byte_position = self.rng_wire.randrange(MAGIC_POSITION, h.size)
        bit = self.rng_wire.randrange(8)
        records = bytearray(body.records)
        records[pos + byte_position] ^= 1 << bit
        flip = WireFlip(h.base_offset, h.leader_epoch, byte_position, bit, bytes(records[pos:pos + h.size]))
        return msgspec.structs.replace(body, records=bytes(records)), flip

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

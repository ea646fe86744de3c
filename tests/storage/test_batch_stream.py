"""metalog.storage.batch.BatchStream: whole batches out of pieces cut anywhere (a
snapshot download's chunks), the same batches iter_batches finds in the
whole, and a damaged one reported where it is in the stream."""

import random

import pytest

from metalog.storage import batch as b


def stream_bytes() -> bytes:
    out = bytearray()
    for i in range(12):
        out += b.encode_batch(len(out), 1, [bytes([i]) * (7 * i + 1)] * (i + 1), 0)
    return bytes(out)


@pytest.mark.parametrize("seed", range(20))
def test_pieces_cut_anywhere_give_the_batches_of_the_whole(seed):
    data = stream_bytes()
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(data)), rng.randrange(1, 30)))
    stream = b.BatchStream()
    got = []
    for a, z in zip([0] + cuts, cuts + [len(data)]):
        got += [(pos, h, bytes(view)) for pos, h, view in stream.feed(data[a:z])]
        assert stream.position <= z and (not got or stream.position == got[-1][0] + got[-1][1].size)
    want = [(pos, h, data[pos:pos + h.size]) for pos, h in b.iter_batches(data)]
    assert got == want and stream.position == len(data)


def test_a_bad_crc_is_reported_at_its_stream_position_after_the_good_batches():
    data = bytearray(stream_bytes())
    batches = list(b.iter_batches(bytes(data)))
    bad_pos, bad_h = batches[5]
    data[bad_pos + bad_h.size - 1] ^= 0x01  # the last byte of batch 5's records
    stream = b.BatchStream()
    got = []
    with pytest.raises(b.CorruptBatchError) as e:
        for a in range(0, len(data), 100):
            got += [pos for pos, _, _ in stream.feed(bytes(data[a:a + 100]))]
    assert got == [pos for pos, _ in batches[:5]]
    assert e.value.position == bad_pos and "crc" in str(e.value).lower()
    # Unchecked (a scan that only reads control batches): the same batches, no error.
    loose = b.BatchStream(verify=False)
    assert [pos for pos, _, _ in loose.feed(bytes(data))] == [pos for pos, _ in batches]


@pytest.mark.parametrize("field_at, value, message", [
    (16, 1, "bad magic 1 (expected 2)"),  # magic
    (8, 10, "bad batch length 10"),  # length: shorter than a header
    (8, (64 << 20) + 1, f"bad batch length {(64 << 20) + 1}"),  # past MAX_BATCH_BYTES
    (57, 0, "bad record count 0 / last offset delta 0"),  # records count
    (23, 5, "bad record count 1 / last offset delta 5"),  # last offset delta
])
def test_a_header_that_cannot_be_believed_says_which_field(field_at, value, message):
    """decode_header checks magic, length and record count before anything
    trusts the header, and says which one is wrong, where."""
    import struct

    good = b.encode_batch(40, 3, [b"v"], 0)
    assert b.decode_header(good) == b.BatchHeader(*b.HEADER.unpack_from(good, 0))
    width = {16: ">b", 8: ">i", 57: ">i", 23: ">i"}[field_at]
    bad = bytearray(b"pad" + good)
    struct.pack_into(width, bad, 3 + field_at, value)
    with pytest.raises(b.CorruptBatchError) as e:
        b.decode_header(bytes(bad), 3)
    assert str(e.value) == message and e.value.position == 3 and e.value.base_offset == 40


def _detailed_verdict(data: bytes) -> bool:
    """What decode_header and verify_crc say of `data` as whole batches."""
    pos = 0
    try:
        while pos < len(data):
            if len(data) - pos < b.HEADER_SIZE:
                return False
            h = b.decode_header(data, pos)
            if pos + h.size > len(data):
                return False
            b.verify_crc(data, pos, h)
            pos += h.size
    except b.CorruptBatchError:
        return False
    return True


@pytest.mark.parametrize("seed", range(10))
def test_batches_sound_agrees_with_decode_header_and_verify_crc(seed):
    """The log's read check (SegmentedLog._verify_read) asks batches_sound
    first: a damaged byte anywhere, a cut tail or extra bytes must make it say
    False exactly where the detailed check raises."""
    data = stream_bytes()
    assert b.batches_sound(data) and _detailed_verdict(data)
    rng = random.Random(seed)
    for _ in range(300):
        bad = bytearray(data)
        what = rng.randrange(3)
        if what == 0:
            bad[rng.randrange(len(bad))] ^= 1 << rng.randrange(8)  # one flipped bit anywhere
        elif what == 1:
            bad = bad[:rng.randrange(len(bad))]  # a torn tail
        else:
            bad += bytes(rng.randrange(1, 80))  # zeros after the last batch
        # (A flip in a base offset or leader epoch passes both: Kafka's CRC
        # leaves them out; the log's offset and epoch checks catch those.)
        assert b.batches_sound(bytes(bad)) == _detailed_verdict(bytes(bad))

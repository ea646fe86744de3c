"""metalog.broker.server.consistency.LogDigest: per-batch digests that follow the log through
appends, truncation, log-start moves and snapshot installs, and locate the
first range where two replicas differ although every CRC is valid."""

from metalog.broker.server.consistency import LogDigest, compare
from metalog.protocol import messages as m
from metalog.protocol.errors import Errors
from metalog.storage.batch import encode_batch


def batches(values_by_batch, epoch=1, base=0) -> bytes:
    out = b""
    for values in values_by_batch:
        out += encode_batch(base, epoch, values, 0)
        base += len(values)
    return out


def two_replicas(n_batches=100, differ_at=None):
    a, b = LogDigest(), LogDigest()
    for k in range(n_batches):
        va = [b"r%d-%d" % (k, i) for i in range(3)]
        vb = list(va)
        if k == differ_at:
            vb[1] = b"R%d-1" % k  # same length, same offsets, valid CRC: different bytes
        a.append(encode_batch(3 * k, 1, va, 0))
        b.append(encode_batch(3 * k, 1, vb, 0))
    return a, b


def test_equal_logs_have_equal_chunk_digests():
    a, b = two_replicas()
    assert a.end_offset == 300 and a.digest(0, 300) == b.digest(0, 300)
    assert compare(a.digest_chunks(0, 300, 8), b.digest_chunks(0, 300, 8)) is None


def test_a_rewritten_batch_with_a_valid_crc_is_found_and_located():
    a, b = two_replicas(differ_at=57)
    chunks_a, chunks_b = a.digest_chunks(0, 300, 16), b.digest_chunks(0, 300, 16)
    bad = compare(chunks_a, chunks_b)
    assert bad is not None and bad.start_offset <= 57 * 3 < bad.end_offset
    assert bad.end_offset - bad.start_offset <= 3 * 7  # 100 batches in 16 chunks: 7 batches per chunk
    # Below the bad batch the prefixes still agree.
    assert a.digest(0, bad.start_offset) == b.digest(0, bad.start_offset)


def test_truncation_and_log_start_moves_keep_the_digest_in_step_with_the_log():
    a, _ = two_replicas(10)  # batches at 0, 3, ..., 27
    a.truncate(15)
    assert a.end_offset == 15
    fresh = LogDigest()
    fresh.append(batches([[b"r%d-%d" % (k, i) for i in range(3)] for k in range(5)]))
    assert a.digest(0, 15) == fresh.digest(0, 15)
    a.advance_start(6)
    assert (a.first_base, a.end_offset) == (6, 15)
    assert a.digest(6, 15) == fresh.digest(6, 15)
    a.reset(40)
    assert (a.first_base, a.end_offset) == (40, 40)


def test_a_voter_answers_only_what_it_holds_on_batch_boundaries():
    a, _ = two_replicas(10)
    ok = a.answer(m.ConsistencyCheckRequest(cluster_id="c", leader_id=1, leader_epoch=1,
                                            start_offset=0, end_offset=12, chunks=2))
    assert ok.error_code == 0 and (ok.start_offset, ok.end_offset) == (0, 12)
    assert [(c.start_offset, c.end_offset) for c in ok.chunks] == [(0, 6), (6, 12)]
    bad = a.answer(m.ConsistencyCheckRequest(cluster_id="c", leader_id=1, leader_epoch=1,
                                             start_offset=1, end_offset=12))
    assert bad.error_code == Errors.OFFSET_OUT_OF_RANGE and "[0, 30)" in bad.error_message

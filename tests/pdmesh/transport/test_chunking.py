import numpy as np
import pytest

from pdmesh.errors import ChecksumMismatch, InvalidRequest
from pdmesh.kv.checksum import block_checksum
from pdmesh.transport.chunking import BlockAssembler, iter_block_chunks, iter_chunks, receive_runs, rows_of


def _payload(nbytes: int) -> bytes:
    return bytes((i * 31 + 7) % 251 for i in range(nbytes))


def test_block_splits_into_chunks_of_at_most_chunk_size_and_reassembles():
    payload = _payload(10_000)
    chunks = list(iter_block_chunks(3, payload, b"h" * 16, chunk_nbytes=4096))
    assert [len(c.data) for c in chunks] == [4096, 4096, 1808]
    assert [c.offset for c in chunks] == [0, 4096, 8192]
    assert [c.last for c in chunks] == [False, False, True]
    assert chunks[-1].checksum == block_checksum(payload) and chunks[0].checksum == 0
    assembler = BlockAssembler(max_block_nbytes=10_000)
    results = [assembler.add(c) for c in chunks]
    assert results[:2] == [[], []]
    (block,) = results[2]
    assert (block.block_index, bytes(block.payload), block.block_hash) == (3, payload, b"h" * 16)
    assert not assembler.in_progress


def test_block_smaller_than_a_chunk_is_one_chunk():
    chunks = list(iter_block_chunks(0, _payload(100), b"", chunk_nbytes=4096))
    assert len(chunks) == 1 and chunks[0].last and chunks[0].block_nbytes == 100


def test_consecutive_blocks_reassemble_independently():
    assembler = BlockAssembler(max_block_nbytes=5000)
    blocks = []
    for index, size in [(0, 5000), (1, 1234)]:
        for chunk in iter_block_chunks(index, _payload(size), b"", chunk_nbytes=2000):
            blocks += assembler.add(chunk)
    assert [(b.block_index, len(b.payload)) for b in blocks] == [(0, 5000), (1, 1234)]


@pytest.mark.parametrize("bit", [0, 7, 8 * 4095, 8 * 9999 + 3])
def test_a_flipped_bit_is_rejected(bit):
    chunks = list(iter_block_chunks(0, _payload(10_000), b"", chunk_nbytes=4096))
    byte, within = divmod(bit, 8)
    chunk = chunks[byte // 4096]
    data = bytearray(chunk.data)
    data[byte % 4096] ^= 1 << within
    chunk.data = bytes(data)
    assembler = BlockAssembler(max_block_nbytes=10_000)
    with pytest.raises(ChecksumMismatch, match="block 0: checksum"):
        for c in chunks:
            assembler.add(c)


def test_out_of_order_chunk_is_rejected():
    chunks = list(iter_block_chunks(0, _payload(10_000), b"", chunk_nbytes=4096))
    assembler = BlockAssembler(max_block_nbytes=10_000)
    assembler.add(chunks[0])
    with pytest.raises(InvalidRequest, match="out of order"):
        assembler.add(chunks[2])


def test_block_larger_than_the_layout_allows_is_rejected():
    chunk = next(iter_block_chunks(0, _payload(2048), b"", chunk_nbytes=4096))
    with pytest.raises(InvalidRequest, match=r"size 2048 outside \(0, 1024\]"):
        BlockAssembler(max_block_nbytes=1024).add(chunk)


def test_new_block_before_last_chunk_of_previous_is_rejected():
    first = list(iter_block_chunks(0, _payload(5000), b"", chunk_nbytes=4096))
    second = next(iter_block_chunks(1, _payload(10), b""))
    assembler = BlockAssembler(max_block_nbytes=5000)
    assembler.add(first[0])
    with pytest.raises(InvalidRequest, match="block 0 ended without its last chunk"):
        assembler.add(second)


def _rows(num_blocks: int, block_nbytes: int) -> np.ndarray:
    return np.frombuffer(_payload(num_blocks * block_nbytes), dtype=np.uint8).reshape(num_blocks, block_nbytes)


def test_small_blocks_go_as_runs_and_large_ones_as_pieces():
    rows = _rows(5, 1000)
    chunks = list(iter_chunks([4, 0, 2, 1, 3], rows, [b"a", b"b", b"c", b"d", b"e"], chunk_nbytes=2500))
    assert [list(c.run_block_indexes) for c in chunks] == [[4, 0], [2, 1], [3]]
    assembler = BlockAssembler(max_block_nbytes=1000)
    blocks = [b for c in chunks for b in assembler.add(c)]
    assert [(b.block_index, b.block_hash) for b in blocks] == [(4, b"a"), (0, b"b"), (2, b"c"), (1, b"d"), (3, b"e")]
    assert [bytes(b.payload) for b in blocks] == [row.tobytes() for row in rows]
    blocks[0].payload[0] ^= 1  # writable: it lands in torch tensors
    big = list(iter_chunks([7], _rows(1, 3000), [b"z"], chunk_nbytes=2500))
    assert [(c.run_block_indexes, len(c.data), c.last) for c in big] == [([], 2500, False), ([], 500, True)]


def test_a_run_with_a_flipped_bit_or_a_wrong_length_is_rejected():
    chunk = next(iter_chunks([0, 1], _rows(2, 1000), [b"", b""], chunk_nbytes=2000))
    short = type(chunk)()
    short.CopyFrom(chunk)
    short.data = chunk.data[:-1]
    with pytest.raises(InvalidRequest, match="1999 bytes, 2 checksums and 2 hashes for 2 blocks"):
        BlockAssembler(max_block_nbytes=1000).add(short)
    data = bytearray(chunk.data)
    data[1500] ^= 0x80
    chunk.data = bytes(data)
    with pytest.raises(ChecksumMismatch, match="block 1: checksum"):
        BlockAssembler(max_block_nbytes=1000).add(chunk)


def test_receive_runs_yields_each_message_s_blocks_and_their_rows_without_a_copy():
    rows = _rows(5, 1000)
    chunks = list(iter_chunks([0, 1, 2, 3, 4], rows, [b""] * 5, chunk_nbytes=2000))
    chunks += list(iter_block_chunks(5, _payload(1000), b"", chunk_nbytes=600))  # a block in pieces
    runs = list(receive_runs(chunks, 1000, 6, "test"))
    assert [[b.block_index for b in run] for run in runs] == [[0, 1], [2, 3], [4], [5]]
    assert np.array_equal(rows_of(runs[1]), rows[2:4])
    rows_of(runs[0])[0, 0] ^= 1  # a view of the blocks' own (writable) buffer
    assert runs[0][0].payload[0] == rows[0, 0] ^ 1
    assert bytes(rows_of(runs[3])) == _payload(1000)
    with pytest.raises(ValueError, match="not one run"):
        rows_of(runs[0][:1])

import threading

import pytest

from mpidag._ids import IdGenerator, counter_bits_for, rank_bits_for


def test_rank_bits_grow_with_the_world():
    assert rank_bits_for(1) == 16
    assert rank_bits_for(65_536) == 16
    assert rank_bits_for(65_537) == 17
    assert rank_bits_for(1_000_000) == 20
    assert rank_bits_for(2**20) == 20


def test_small_worlds_use_torchs_layout_and_large_ones_stay_positive():
    assert counter_bits_for(4) == 48 and counter_bits_for(32_768) == 48
    assert counter_bits_for(32_769) == 47 and counter_bits_for(2**20) == 43
    gen = IdGenerator(3, 4)
    i = gen.next()
    assert i >> 48 == 3 and i == (3 << 48) + 1           # as torch's ids decode
    top = IdGenerator(32_767, 32_768)
    assert 0 < top.next() < 2**63


def test_ids_at_two_to_the_twenty_ranks():
    world = 2**20
    gens = [IdGenerator(r, world) for r in (0, 1, world // 2, world - 1)]
    ids = [g.next() for g in gens for _ in range(2)]
    assert len(set(ids)) == len(ids)
    for g in gens:
        i = g.next()
        assert g.creator(i) == g.rank and 0 < i < 2**63


def test_ids_decode_to_their_creator_and_are_unique_across_ranks():
    world = 70_000  # wider than torch's 16-bit worker field
    gens = [IdGenerator(r, world) for r in (0, 1, 65_535, 69_999)]
    ids = [g.next() for g in gens for _ in range(3)]
    assert len(set(ids)) == len(ids)
    for g in gens:
        i = g.next()
        assert g.creator(i) == g.rank
        assert 0 < i < 2**63


def test_ids_unique_under_threads():
    gen = IdGenerator(5, 8)
    out: list[int] = []

    def take():
        out.extend(gen.next() for _ in range(10_000))

    threads = [threading.Thread(target=take) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(out)) == 40_000


def test_counter_overflow_raises():
    gen = IdGenerator(0, 2)
    gen.max_counter = 2
    gen.next()
    gen.next()
    with pytest.raises(OverflowError, match="exhausted"):
        gen.next()


def test_bad_rank_rejected():
    with pytest.raises(ValueError, match="outside the world"):
        IdGenerator(4, 4)

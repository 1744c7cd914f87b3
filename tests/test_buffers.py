"""The receive-buffer cache: reuse, lifetime through views, the size limit."""

import gc

import torch

from mpidag.transport.buffers import MIN_CACHED, ReceiveBufferCache


def test_small_buffers_bypass_the_cache():
    cache = ReceiveBufferCache()
    t = cache.empty(MIN_CACHED - 1)
    assert t.numel() == MIN_CACHED - 1 and cache.misses == 0 and cache.hits == 0


def test_freed_block_is_reused_and_views_keep_it_alive():
    cache = ReceiveBufferCache()
    t = cache.empty(3 << 20).view(torch.float32)
    t.fill_(7.0)
    view = t[10:20]
    del t
    gc.collect()
    assert cache.free_bytes == 0  # the view still uses the block
    other = cache.empty(3 << 20)  # so a new block is made
    assert cache.misses == 2
    assert torch.equal(view, torch.full((10,), 7.0))
    del view, other
    gc.collect()
    cache.empty(3 << 20)
    assert cache.hits == 1


def test_typed_tensors_come_from_the_cache_when_large_and_from_torch_when_small():
    cache = ReceiveBufferCache()
    small = cache.empty_tensor((3, 4), torch.float64, 96)
    assert small.shape == (3, 4) and small.dtype == torch.float64 and small.is_contiguous()
    assert cache.misses == 0  # torch.empty of the shape itself
    big = cache.empty_tensor((512, 1024), torch.int32, 2 << 20)
    assert big.shape == (512, 1024) and big.dtype == torch.int32 and cache.misses == 1
    big.fill_(3)
    del big
    gc.collect()
    again = cache.empty_tensor((1 << 19,), torch.float32, 2 << 20)
    assert cache.hits == 1 and again.shape == (1 << 19,)
    assert ReceiveBufferCache(limit=0).empty_tensor((1 << 20,), torch.uint8, 1 << 20).shape \
        == (1 << 20,)


def test_cache_keeps_at_most_its_limit():
    cache = ReceiveBufferCache(limit=4 << 20)
    blocks = [cache.empty(1 << 20) for _ in range(5)]  # 2 MiB size class each
    del blocks
    gc.collect()
    assert cache.free_bytes == 4 << 20
    cache.clear()
    assert cache.free_bytes == 0


def test_repeated_reuse_stays_cheap():
    cache = ReceiveBufferCache()
    for _ in range(5000):
        cache.empty(1 << 20)
    assert cache.hits == 4999
    # not a speed assertion: the bookkeeping must not grow with the number of reuses
    assert len(cache._lru) == 1 and sum(len(v) for v in cache._free.values()) == 1

"""The receive-buffer cache: reuse, lifetime through views, the size limit; on both pools,
the C++ one (``_mpidag_torch.ReceivePool``, where built) and the Python one."""

import gc
import os
import threading

import pytest
import torch

from mpidag.transport.buffers import MIN_CACHED, ReceiveBufferCache
from mpidag.transport.torch_native import problem, torch_module


@pytest.fixture(params=["native", "python"])
def make_cache(request):
    native = request.param == "native"
    if native and torch_module() is None:
        if os.environ.get("CI") == "true":  # set-up builds it in CI; a silent fallback is a bug
            pytest.fail(problem())
        pytest.skip(problem())

    def make(**kwargs) -> ReceiveBufferCache:
        cache = ReceiveBufferCache(native=native, **kwargs)
        assert (cache.pool is not None) == native
        return cache

    return make


def test_small_buffers_bypass_the_cache(make_cache):
    cache = make_cache()
    t = cache.empty(MIN_CACHED - 1)
    assert t.numel() == MIN_CACHED - 1 and cache.misses == 0 and cache.hits == 0


def test_freed_block_is_reused_and_views_keep_it_alive(make_cache):
    cache = make_cache()
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


def test_typed_tensors_come_from_the_cache_when_large_and_from_torch_when_small(make_cache):
    cache = make_cache()
    small = cache.empty_tensor((3, 4), torch.float64, 96)
    assert small.shape == (3, 4) and small.dtype == torch.float64 and small.is_contiguous()
    assert cache.misses == 0  # torch.empty of the shape itself
    big = cache.empty_tensor((512, 1024), torch.int32, 2 << 20)
    assert big.shape == (512, 1024) and big.dtype == torch.int32 and cache.misses == 1
    big.fill_(3)
    assert int(big.sum()) == 3 * 512 * 1024
    del big
    gc.collect()
    again = cache.empty_tensor(torch.Size([1 << 19]), torch.float32, 2 << 20)
    assert cache.hits == 1 and again.shape == (1 << 19,)
    assert make_cache(limit=0).empty_tensor((1 << 20,), torch.uint8, 1 << 20).shape \
        == (1 << 20,)


def test_cache_keeps_at_most_its_limit(make_cache):
    cache = make_cache(limit=4 << 20)
    blocks = [cache.empty(1 << 20) for _ in range(5)]  # 2 MiB size class each
    del blocks
    gc.collect()
    assert cache.free_bytes == 4 << 20
    cache.clear()
    assert cache.free_bytes == 0


def test_repeated_reuse_keeps_one_block(make_cache):
    cache = make_cache()
    for _ in range(5000):
        cache.empty(1 << 20)
    assert cache.hits == 4999 and cache.misses == 1
    # not a speed assertion: the bookkeeping must not grow with the number of reuses
    assert cache.free_bytes == 2 << 20


def test_a_tensor_freed_in_another_thread_or_after_the_cache_is_gone_is_safe(make_cache):
    cache = make_cache()
    tensors = [cache.empty_tensor((1 << 18,), torch.float32, 1 << 20) for _ in range(4)]
    for t in tensors:
        t.fill_(1.0)
    del t
    threads = [threading.Thread(target=tensors.pop) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    gc.collect()
    assert cache.free_bytes == 4 * (2 << 20)
    survivor = cache.empty_tensor((1 << 18,), torch.float32, 1 << 20)
    survivor.fill_(2.0)
    del cache
    gc.collect()
    assert float(survivor.sum()) == 2.0 * (1 << 18)  # its block outlives the cache
    del survivor
    gc.collect()

"""How a gradient message carries its gradients (``mpidag.dist_autograd.engine._compact``
and ``_expand_back``): what each kind of gradient travels as, and that expanding it back
on arrival gives the same tensor. The whole round trip, against local autograd, is in
tests/contract/test_dist_autograd.py."""

from __future__ import annotations

import pytest
import torch

from mpidag.dist_autograd.engine import COMPACT_MIN_NUMEL, _compact, _expand_back
from mpidag.dist_autograd.native import records_module
from mpidag.transport.frames import is_plain


@pytest.mark.parametrize("grad, distinct", [
    (torch.ones(()).expand(64, 128), (1, 1)),                      # a sum()'s gradient
    (torch.arange(128.0).expand(64, 128), (1, 128)),               # broadcast along dim 0
    (torch.arange(64.0).view(64, 1).expand(64, 128), (64, 1)),     # along dim 1
    (torch.arange(64.0).view(64, 1).expand(64, 128).t(), (1, 64)),  # and transposed
    (torch.arange(8.0).view(1, 8, 1).expand(4, 8, 512), (1, 8, 1)),
])
def test_a_broadcast_gradient_travels_as_its_distinct_elements(grad, distinct):
    sent, shape = _compact(grad)
    assert tuple(sent.shape) == distinct and sent.is_contiguous()
    assert shape == tuple(grad.shape) and is_plain(shape)
    (arrived,) = _expand_back((sent, shape))
    assert torch.equal(arrived, grad) and arrived.stride() == grad.stride()


def test_other_gradients_travel_whole_and_contiguous():
    dense = torch.rand(64, 128)
    assert _compact(dense) == (dense, None)                        # as it is, no copy
    sent, shape = _compact(dense.t())
    assert shape is None and sent.is_contiguous() and torch.equal(sent, dense.t())
    small = torch.ones(()).expand(COMPACT_MIN_NUMEL - 1)            # whole: one call, few bytes
    sent, shape = _compact(small)
    assert shape is None and sent.is_contiguous() and torch.equal(sent, small)
    deep = torch.ones(()).expand(*[2] * 12)                         # a shape over 8 dims
    sent, shape = _compact(deep)                                    # is not a plain value
    assert shape is None and sent.is_contiguous() and sent.shape == deep.shape
    sparse = torch.eye(3).to_sparse()
    assert _compact(sparse) == (sparse, None)
    assert _compact(None) == (None, None)


NATIVE = records_module()


class _Subclass(torch.Tensor):
    pass


@pytest.mark.skipif(NATIVE is None, reason="the C++ records module is not built")
def test_the_cpp_compaction_sends_what_the_python_one_does():
    grads = [torch.ones(()).expand(64, 128), torch.arange(128.0).expand(64, 128),
             torch.arange(64.0).view(64, 1).expand(64, 128).t(), torch.rand(64, 128),
             torch.rand(64, 128).t(), torch.ones(()).expand(COMPACT_MIN_NUMEL - 1),
             torch.ones(()).expand(*[2] * 12), torch.eye(3).to_sparse(), None]
    sent, shapes = NATIVE.compact_grads(grads, COMPACT_MIN_NUMEL)
    assert len(sent) == len(shapes) == len(grads)
    for grad, got, shape in zip(grads, sent, shapes, strict=True):
        want, want_shape = _compact(grad)
        assert shape == want_shape
        if grad is None or grad.is_sparse or grad.is_contiguous():
            assert got is grad  # as it is, no copy
        else:
            assert got.is_contiguous() and torch.equal(got, want)
    dense = [torch.rand(3), torch.ones(()).expand(5)]
    sent, shapes = NATIVE.compact_grads(dense, COMPACT_MIN_NUMEL)
    assert shapes is None and sent[0] is dense[0] and torch.equal(sent[1], torch.ones(5))
    assert NATIVE.compact_grads((), COMPACT_MIN_NUMEL) == ([], None)
    # a tensor subclass is the Python function's (its __torch_function__ may matter)
    assert NATIVE.compact_grads([torch.ones(2).as_subclass(_Subclass)], 1) is None
    with pytest.raises(TypeError, match=r"compact_grads\(grads: list, min_numel: int\)"):
        NATIVE.compact_grads(torch.ones(2), 1)


@pytest.mark.skipif(NATIVE is None, reason="the C++ records module is not built")
@pytest.mark.parametrize("grad", [
    torch.ones(()).expand(64),                                   # a sum()'s, gathered in C++
    torch.arange(12.0).view(3, 4).t(),
    torch.arange(40.0, dtype=torch.float64).view(5, 8)[1:, ::2],  # an offset and a step
    torch.arange(24).view(2, 3, 4).permute(2, 0, 1),              # int64, three dimensions
    torch.tensor([True, False, True]).expand(4, 3),
    torch.randn(6, 5, dtype=torch.complex64).t(),
    torch.randn(256, 256).t(),                                    # large: torch's copy kernel
    torch.randn(4, 3, dtype=torch.complex64).t().conj(),          # conjugated: the kernel
])
def test_the_cpp_compaction_copies_strided_gradients_exactly(grad):
    (sent,), shapes = NATIVE.compact_grads([grad], COMPACT_MIN_NUMEL)
    assert shapes is None and sent.is_contiguous() and sent.dtype == grad.dtype
    assert torch.equal(sent, grad.contiguous()) and sent.data_ptr() != grad.data_ptr()

"""How a gradient message carries its gradients (``mpidag.dist_autograd.engine._compact``
and ``_expand_back``): what each kind of gradient travels as, and that expanding it back
on arrival gives the same tensor. The whole round trip, against local autograd, is in
tests/contract/test_dist_autograd.py."""

from __future__ import annotations

import pytest
import torch

from mpidag.dist_autograd.engine import COMPACT_MIN_NUMEL, _compact, _expand_back
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

"""How tensors and flat buffers are cut into buckets (GradSync, Replicas and the benchmark share it)."""

from __future__ import annotations

import pytest
import torch

from distlib.parallel.buckets import bounds, group_tensors

MB = 2**20


def test_group_tensors_small_first_bucket_then_caps_and_dtypes():
    f32 = [torch.empty(MB // 4 // 2) for _ in range(3)]  # 0.5 MB each
    f64 = [torch.empty(MB // 8, dtype=torch.float64)]  # 1 MB
    big = [torch.empty(3 * MB // 4)]  # 3 MB: over the cap, alone
    groups = group_tensors(f32 + f64 + big + f32, bucket_bytes=2 * MB, first_bucket_bytes=MB)
    # the first holds 1 MB (two tensors); the next up to 2 MB but stops at the dtype change
    assert groups == [[0, 1], [2], [3], [4], [5, 6, 7]]


def test_bounds_cut_a_flat_buffer_like_the_buckets():
    mb = MB // 4  # fp32 elements in a MB
    assert bounds(60 * mb, 4, 25 * MB, MB) == [(0, mb), (mb, 26 * mb), (26 * mb, 51 * mb), (51 * mb, 60 * mb)]
    assert bounds(10, 4, 16) == [(0, 4), (4, 8), (8, 10)]  # no first size: all equal
    assert bounds(3, 4, 1) == [(0, 1), (1, 2), (2, 3)]  # a cap below one element still advances
    with pytest.raises(ValueError, match="bucket sizes must be > 0"):
        bounds(10, 4, 0)

"""One flat buffer per dtype with a view per tensor that keeps the tensor's layout."""

from __future__ import annotations

import torch

from distlib.parallel.flat_buffers import FlatBuffers


def test_views_keep_layout_and_live_in_the_flat_buffer():
    conv = torch.randn(8, 3, 3, 3).to(memory_format=torch.channels_last)
    bias, counts = torch.randn(8), torch.zeros(2, dtype=torch.int64)
    fb = FlatBuffers([conv, counts, bias], "cpu")
    v_conv, v_counts, v_bias = fb.views
    assert v_conv.stride() == conv.stride() and v_conv.shape == conv.shape
    assert v_counts.dtype == torch.int64 and fb.offsets == [0, 0, conv.numel()]
    v_conv.copy_(conv)
    v_bias.copy_(bias)
    # the views are the flat buffer: one op on it reaches every tensor of that dtype
    # channels_last: the buffer holds the weight in NHWC order, as the weight's own memory does
    torch.testing.assert_close(fb.flat[torch.float32][: conv.numel()], conv.permute(0, 2, 3, 1).reshape(-1))
    fb.flat[torch.float32].mul_(2)
    torch.testing.assert_close(v_bias, bias * 2)
    assert torch.equal(fb.span(0, 2), fb.flat[torch.float32])
    fb.zero_()
    assert not v_conv.any()


def test_alignment_pads_each_slot():
    fb = FlatBuffers([torch.empty(3), torch.empty(70)], "cpu", align=64)
    assert fb.offsets == [0, 64] and fb.flat[torch.float32].numel() == 64 + 128

"""Pieces of a parameter held reshaped (an expert gate_up_proj [E, 2F, H] held as
[E, 2, F, H]): a box of the view is one box of the module's tensor per gate/up index, and
cutting them out of the module's tensor and stacking them gives the view's piece."""

from __future__ import annotations

import pytest
import torch

from nnscaler.checkpoint.pieces import model_boxes
from nnscaler.errors import CheckpointError
from nnscaler.runtime.module import AttrMeta


def test_a_box_of_the_view_is_a_box_per_gate_and_up_index():
    full = torch.arange(4 * 12 * 8.0).reshape(4, 12, 8)  # E=4, F=6, H=8
    index = ((1, 3), (0, 2), (3, 6), (0, 8))  # experts 1-2, gate and up rows 3-5
    boxes, d = model_boxes((4, 2, 6, 8), (4, 12, 8), index)
    assert d == 1 and boxes == [((1, 3), (3, 6), (0, 8)), ((1, 3), (9, 12), (0, 8))]
    meta = AttrMeta(attr="w", kind="parameter", orig_name="w", names=("w",),
                    shape=(4, 2, 6, 8), index=index, dtype=torch.float32,
                    model_shape=(4, 12, 8))
    piece = torch.stack([full[tuple(slice(a, b) for a, b in box)] for box in boxes], dim=d)
    assert torch.equal(piece, meta.take(full))  # from the module's shape
    assert torch.equal(piece, meta.take(full.view(4, 2, 6, 8)))  # from the view
    # only the up rows: one box
    assert model_boxes((4, 2, 6, 8), (4, 12, 8), ((0, 4), (1, 2), (0, 6), (0, 8)))[0] == [
        ((0, 4), (6, 12), (0, 8))]


def test_a_record_that_is_no_view_of_its_tensor_is_refused():
    with pytest.raises(CheckpointError, match=r"does not split one of its dims in two"):
        model_boxes((4, 2, 6, 8), (4, 13, 8), ((0, 4), (0, 2), (0, 6), (0, 8)))

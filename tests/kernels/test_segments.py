"""kernels.segments.token_rows: the row map of every token, and the maps it keeps for offsets seen again."""

from __future__ import annotations

import torch

from kernels.segments import token_positions, token_rows


def _reference(offsets: torch.Tensor) -> torch.Tensor:
    lengths = offsets[1:] - offsets[:-1]
    return torch.repeat_interleave(torch.arange(lengths.numel()), lengths)


def test_rows_match_the_reference_with_empty_rows_and_the_longest_row():
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(0, 6, (40,), generator=generator)
    lengths[[0, 7, 39]] = 0  # empty rows first, inside and last
    lengths[12] = 50  # the longest row
    offsets = torch.zeros(41, dtype=torch.int64)
    offsets[1:] = lengths.cumsum(0)
    rows = token_rows(offsets, int(offsets[-1]))
    assert torch.equal(rows, _reference(offsets))
    assert torch.equal(token_positions(offsets, rows), torch.cat([torch.arange(int(n)) for n in lengths]))


def test_a_map_is_kept_for_the_same_offsets_and_redone_when_they_change():
    offsets = torch.tensor([0, 2, 2, 5])
    first = token_rows(offsets, 5)
    assert token_rows(offsets, 5) is first  # the same offsets, unchanged: the kept map
    assert token_rows(torch.tensor([0, 2, 2, 5]), 5) is not first  # equal values, another tensor: computed
    offsets[1:] = torch.tensor([1, 4, 5])  # changed in place
    again = token_rows(offsets, 5)
    assert again is not first and again.tolist() == [0, 1, 1, 1, 2]
    assert first.tolist() == [0, 0, 2, 2, 2]  # a map handed out before is not changed


def test_a_map_made_in_inference_mode_is_not_handed_to_autograd_code():
    offsets = torch.tensor([0, 3, 4])
    with torch.inference_mode():
        inside = token_rows(offsets, 4)
    outside = token_rows(offsets, 4)
    assert inside.is_inference() and not outside.is_inference()
    assert torch.equal(inside, outside)
    values = torch.ones(4, 2, requires_grad=True)
    # Indexing with the map saves it for backward: an inference tensor there would raise.
    values.index_select(0, outside).sum().backward()
    assert values.grad is not None


def test_offsets_made_in_inference_mode_get_a_map_each_time():
    with torch.inference_mode():
        offsets = torch.tensor([0, 1, 3])
        first = token_rows(offsets, 3)
        offsets[1:] = torch.tensor([2, 3])  # no version counter to tell this change: nothing is kept
        assert first.tolist() == [0, 1, 1] and token_rows(offsets, 3).tolist() == [0, 0, 1]

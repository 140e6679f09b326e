"""Token-to-row index maps for jagged tensors (pure PyTorch): the one segment-id helper, used by
the reference twins and the trainer's models.

Shape letters: B batch size, T total tokens, offsets (B+1,) int64.
"""

import threading
import weakref

import torch

_recent = threading.local()
"""Per thread, the last few (offsets, its in-place version, T, inference mode) -> rows of :func:`token_rows`."""

_RECENT_MAPS = 4


def token_rows(offsets: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """``(T,) int64`` row index of every token: row i repeated L_i times.

    The maps of the last few ``offsets`` tensors seen (by identity, unchanged in place since) are kept and handed
    out again: one layer of a model asks for the same offsets' map in its truncation, attention, softmax and
    pooling (4-5 times per layer of GEM's sequence encoder). token_rows was 5 % of the continuous trainer's CPU
    on the freshness lake (py-spy); keeping the maps took a gem_small B=512 training step from 84.8 to 79.3
    CPU-ms (same process, alternating, best of three, the same losses). Not under ``torch.compile``, which
    traces the computation instead, nor for offsets made under ``torch.inference_mode`` (no version counter).
    Each thread keeps its own maps (the prefetch thread builds batches).
    """
    # An inference tensor has no version counter to tell an in-place change: its map is not kept.
    keeps = not torch.compiler.is_compiling() and not offsets.is_inference()
    recent: list = []
    if keeps:
        key = (offsets._version, num_tokens, torch.is_inference_mode_enabled())
        if not hasattr(_recent, "maps"):
            _recent.maps = []
        recent = _recent.maps
        for ref, seen, rows in recent:
            if ref() is offsets and seen == key:
                return rows
    # searchsorted, not repeat_interleave: the latter's parallel path was measured stalling on a
    # busy CPU (8 ms of a 65 ms GEM step for B=64, vs ~0.05 ms here); empty rows share an
    # offset value, and right=True skips them to the last row starting at or before the token.
    positions = torch.arange(num_tokens, device=offsets.device, dtype=torch.int64)
    rows = torch.searchsorted(offsets[1:], positions, right=True)
    if keeps:
        recent.insert(0, (weakref.ref(offsets), key, rows))
        del recent[_RECENT_MAPS:]
    return rows


def token_positions(offsets: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``(T,) int64`` position of every token inside its row (0 .. L_i - 1)."""
    return torch.arange(rows.numel(), device=offsets.device, dtype=torch.int64) - offsets[rows]

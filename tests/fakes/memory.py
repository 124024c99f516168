"""The room the fakes serve: three owners' memory, and what a decode's should hold after."""

from __future__ import annotations

import numpy as np

from tests.wire_helpers import LAYOUT

ROOM = 42
PAGE = 8  # bytes of one page of one layer in the fake memory
NUM_PAGES = LAYOUT.num_pages
LAYERS = LAYOUT.layer_num
SPANS = {0: range(0, 3), 1: range(3, 5), 2: range(5, 7)}  # as tests.wire_helpers.rank_descriptor
FP = LAYOUT.fingerprint


def source_memory(cp: int) -> np.ndarray:
    """An owner's pages, [layer, page, byte]: each page says whose, which layer, which page."""
    layer, page, byte = np.indices((LAYERS, NUM_PAGES, PAGE))
    mem = (cp * 97 + layer * 31 + page * 7 + byte * 3 + 1) % 251
    mem[..., 0], mem[..., 1], mem[..., 2] = cp, layer[..., 0], page[..., 0]
    return mem.astype(np.uint8)


SOURCE = {cp: source_memory(cp) for cp in SPANS}


def expected(dst: np.ndarray, src_of: dict[int, np.ndarray]) -> np.ndarray:
    """The decode's memory after a fetch of every layer: each owner's src pages in dst."""
    mem = np.zeros((LAYERS, NUM_PAGES, PAGE), np.uint8)
    for cp, span in SPANS.items():
        for layer in span:
            mem[layer, dst] = SOURCE[cp][layer, src_of[cp]]
    return mem

"""Deterministic stand-in KV content: what a prefill without weights writes.

Each token's bytes derive from a 64-bit hash of (seed, layer, token), so a page moved to
the wrong place, a layer swapped with another or a stale page from an earlier request
shows up as a byte mismatch. Generated and compared in per-thread scratch buffers that
are reused (fresh arrays cost more in page faults than the arithmetic): 41 GB of the main
job's KV are written and checked byte for byte at several GB/s a core.
"""

from __future__ import annotations

import ctypes
import threading

import numpy as np
import torch

from pdkv.buffers import byte_rows, index_key_view, index_scale_view
from pdkv.layout import KVLayout
from pdkv.pages import PageAllocator
from pdkv.pool import DSAKVPool

_M1, _M2 = 0x5851F42D4C957F2D, 0x14057B7EF767814F  # odd 64-bit mixing constants
_STEP = np.uint64(_M2 | 1)  # what a token's next 64-bit word adds


_scratch = threading.local()


def _buffer(name: str, shape: tuple[int, ...], dtype: type) -> np.ndarray:
    """A reused per-thread array of `shape` (its contents are whatever was left there)."""
    size = int(np.prod(shape))
    buf = getattr(_scratch, name, None)
    if buf is None or buf.size < size or buf.dtype != dtype:
        buf = np.empty(max(size, 1), dtype=dtype)
        setattr(_scratch, name, buf)
    return buf[:size].reshape(shape)


def token_bytes(
    seed: int, layer_id: int, tokens: torch.Tensor, width: int, salt: int = 0, scratch: bool = False
) -> torch.Tensor:
    """(tokens, width) uint8, a function of (seed, layer, token position, salt) alone.

    With `scratch` the result lives in this thread's scratch for (salt, width), valid
    until the next such call on this thread: for bytes consumed at once.
    """
    h = _token_hash(seed, layer_id, tokens.reshape(-1).cpu().numpy(), salt)
    with np.errstate(over="ignore"):
        words = -(-width // 8)
        # 64-bit words: one add per 8 output bytes; word j of a token is h + (j + 1) * _STEP.
        shape = (len(h), words)
        out = _buffer(f"words_{salt}_{width}", shape, np.uint64) if scratch else np.empty(shape, np.uint64)
        np.add(h[:, None], np.arange(1, words + 1, dtype=np.uint64)[None, :] * _STEP, out=out)
    return torch.from_numpy(out.view(np.uint8)[:, :width])


def _token_hash(seed: int, layer_id: int, positions: np.ndarray, salt: int) -> np.ndarray:
    """The 64-bit hash each token's words derive from (see `token_bytes`)."""
    key = np.uint64((seed * _M1 + layer_id * _M2 + salt * 0x9E3779B97F4A7C15) & (2**64 - 1))
    with np.errstate(over="ignore"):
        h = positions.astype(np.uint64) * np.uint64(_M1) + key
        h ^= h >> np.uint64(29)
        h *= np.uint64(_M2)
        h ^= h >> np.uint64(32)
    return h


def _word_sum(h: np.ndarray, words: int) -> np.ndarray:
    """Per token, the sum (mod 2**64) of its first `words` words: words * h + _STEP * (1 + ... + words)."""
    with np.errstate(over="ignore"):
        return h * np.uint64(words) + _STEP * np.uint64(words * (words + 1) // 2)


class SyntheticLayer:
    """The latent KV row bytes and the indexer key and scale of some tokens of one layer."""

    def __init__(self, layout: KVLayout, seed: int, layer_id: int, tokens: torch.Tensor, scratch: bool = False) -> None:
        """`scratch`: the bytes live in this thread's scratch (see `token_bytes`)."""
        self.layout = layout
        self.kv = token_bytes(seed, layer_id, tokens, layout.kv_token_bytes, salt=1, scratch=scratch)
        self.index = token_bytes(seed, layer_id, tokens, layout.index_token_bytes, salt=2, scratch=scratch)

    @property
    def index_k(self) -> torch.Tensor:
        return self.index[:, : self.layout.index_head_dim].contiguous()

    @property
    def index_scale(self) -> torch.Tensor:
        return self.index[:, self.layout.index_head_dim :].contiguous().view(torch.float32)

    def kv_rows(self, layout: KVLayout) -> torch.Tensor:
        """The latent rows in the model dtype, as `set_kv_buffer` takes them."""
        return self.kv.view(layout.torch_store_dtype).view(layout.torch_dtype)


def token_locations(layout: KVLayout, pages: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Token slots of positions 0..num_tokens-1 of a request stored in `pages`, in order."""
    pos = torch.arange(num_tokens)
    return pages.long()[pos // layout.page_size] * layout.page_size + pos % layout.page_size


class RequestContent:
    """The KV a stand-in prefill writes for one request: a function of its seeds alone.

    The first `prefix_tokens` positions carry a shared prefix's content (seeded by the
    prefix), the rest the request's own.
    """

    def __init__(self, seed: int, num_tokens: int, prefix_seed: int = 0, prefix_tokens: int = 0) -> None:
        self.seed, self.num_tokens = seed, num_tokens
        self.prefix_seed, self.prefix_tokens = prefix_seed, min(prefix_tokens, num_tokens)

    def layer(self, layout: KVLayout, layer_id: int, start: int = 0, scratch: bool = False) -> SyntheticLayer:
        """Content of positions [start, num_tokens); `scratch`: see `token_bytes`."""
        pos = torch.arange(start, self.num_tokens)
        if self.prefix_tokens <= start:
            return SyntheticLayer(layout, self.seed, layer_id, pos, scratch)
        head = SyntheticLayer(layout, self.prefix_seed, layer_id, pos[pos < self.prefix_tokens])
        tail = SyntheticLayer(layout, self.seed, layer_id, pos[pos >= self.prefix_tokens])
        for name in ("kv", "index"):
            setattr(head, name, torch.cat([getattr(head, name), getattr(tail, name)]))
        return head

    def write_layer(self, pool: DSAKVPool, layer: int, pages: np.ndarray) -> None:
        """Store this content's latent and indexer bytes of `layer` in `pages` of `pool`'s own
        buffers: what `set_kv_buffer` and `set_index_k_and_scale` would store, written in
        place a run of consecutive pages at a time (no token rows built, no scatter: 2.5x
        the one-core rate on the 2-core machine). Host pools of a summable layout (see
        `summable`) only; the caller notes the write (`invalidate_layer`)."""
        layout, ps, n = pool.layout, pool.layout.page_size, self.num_tokens
        local = layer - layout.start_layer
        kv = byte_rows(pool.kv_buffer[local]).numpy().view(np.uint64)  # (rows, token words)
        keys = index_key_view(pool.index_buffer[local], layout).numpy().view(np.uint64)  # (pages, ps, key words)
        scales = index_scale_view(pool.index_buffer[local], layout).numpy().view(np.uint32)[..., 0]  # (pages, ps)
        pos = np.arange(n)
        hk, hi = self._hashes(layer, 1, pos), self._hashes(layer, 2, pos)
        kv_steps = np.arange(1, kv.shape[1] + 1, dtype=np.uint64) * _STEP
        key_steps = np.arange(1, keys.shape[2] + 1, dtype=np.uint64) * _STEP
        with np.errstate(over="ignore"):
            scale = (hi + _STEP * np.uint64(keys.shape[2] + 1)).astype(np.uint32)  # the low half of the next word
        used = pages[: -(-n // ps)]
        for i0, i1 in _runs(used):
            p0, t0, t1 = int(used[i0]), i0 * ps, min(i1 * ps, n)  # pages p0.. hold tokens t0..t1
            np.add(hk[t0:t1, None], kv_steps, out=kv[p0 * ps : p0 * ps + t1 - t0])
            full = (t1 - t0) // ps
            if full:
                np.add(hi[t0 : t0 + full * ps].reshape(full, ps, 1), key_steps, out=keys[p0 : p0 + full])
                scales[p0 : p0 + full] = scale[t0 : t0 + full * ps].reshape(full, ps)
            tail = t1 - t0 - full * ps
            if tail:  # the request's partial last page: its other slots stay as they were
                np.add(hi[t1 - tail : t1, None], key_steps, out=keys[p0 + full, :tail])
                scales[p0 + full, :tail] = scale[t1 - tail : t1]

    def mismatched_layers(self, pool: DSAKVPool, pages: torch.Tensor, layers: range | None = None) -> list[int]:
        """Layers of `pool`'s own buffers whose bytes in `pages` differ from this content.

        Every byte of every token counts. On the host, with a layout of whole 64-bit words,
        each full page is summed as 64-bit words, in place, and set against its expected sum,
        which follows from the tokens' hashes without making their bytes; the last, partial
        page is compared byte for byte. A page moved, swapped, stale or from another layer
        or room changes its sum, as does any single changed byte; only corruptions that
        cancel out in one page's 64-bit sum would pass. Elsewhere every byte is compared.
        """
        layers = pool.owned if layers is None else layers
        page_ids = pages.reshape(-1).long().cpu().numpy()
        if summable(pool):
            return [layer for layer in layers if not self._layer_sums_match(pool, layer, page_ids)]
        return [layer for layer in layers if not self._layer_matches(pool, layer, page_ids)]

    def _hashes(self, layer_id: int, salt: int, positions: np.ndarray) -> np.ndarray:
        """Token hashes of `positions` (ascending), the shared prefix's seed below its end."""
        cut = int(np.searchsorted(positions, self.prefix_tokens))
        head = _token_hash(self.prefix_seed, layer_id, positions[:cut], salt)
        return np.concatenate([head, _token_hash(self.seed, layer_id, positions[cut:], salt)])

    def _layer_sums_match(self, pool: DSAKVPool, layer: int, page_ids: np.ndarray) -> bool:
        layout, ps = pool.layout, pool.layout.page_size
        full = self.num_tokens // ps
        if len(page_ids) * ps < self.num_tokens:
            return False
        local = layer - layout.start_layer
        kv_pages = pool.kv_buffer[local].view(torch.uint8).reshape(-1, layout.kv_page_bytes)
        index_pages = pool.index_buffer[local].view(torch.uint8).reshape(-1, layout.index_page_bytes)
        if full:
            pos = np.arange(full * ps)
            hi = self._hashes(layer, 2, pos)
            want_kv = self._latent_sums(layout, layer, full)
            with np.errstate(over="ignore"):
                keys = _word_sum(hi, layout.index_head_dim // 8).reshape(full, ps).sum(axis=1)
                # A token's 4 scale bytes are the low half of its word after the key's;
                # a page keeps them after its keys, two tokens to a 64-bit word.
                scale = (hi + _STEP * np.uint64(layout.index_head_dim // 8 + 1)) & np.uint64(0xFFFFFFFF)
                pairs = scale.reshape(full, ps // 2, 2)
                want_index = keys + (pairs[:, :, 0] + (pairs[:, :, 1] << np.uint64(32))).sum(axis=1)
            if not np.array_equal(_page_sums(kv_pages, page_ids[:full]), want_kv):
                return False
            if not np.array_equal(_page_sums(index_pages, page_ids[:full]), want_index):
                return False
        if self.num_tokens == full * ps:
            return True
        return self._last_page_matches(pool, layer, int(page_ids[full]), full * ps)

    def _latent_sums(self, layout: KVLayout, layer: int, full: int) -> np.ndarray:
        """The expected 64-bit word sum of each of the first `full` pages' latent rows."""
        ps = layout.page_size
        hk = self._hashes(layer, 1, np.arange(full * ps))
        with np.errstate(over="ignore"):
            return _word_sum(hk, layout.kv_token_bytes // 8).reshape(full, ps).sum(axis=1)

    def latent_matches(self, layout: KVLayout, kv: torch.Tensor, layer: int, pages: np.ndarray) -> bool:
        """Whether `kv` (one layer's latent buffer, as `get_key_buffer` returns it) holds
        this content's latent rows in `pages`: every byte, by page sums on the host where
        the content fills whole pages of whole words (see `mismatched_layers`), else compared."""
        ps, n = layout.page_size, self.num_tokens
        if kv.device.type == "cpu" and layout.kv_token_bytes % 8 == 0 and n % ps == 0:
            view = kv.view(torch.uint8).reshape(-1, layout.kv_page_bytes)
            return np.array_equal(_page_sums(view, pages[: n // ps]), self._latent_sums(layout, layer, n // ps))
        loc = token_locations(layout, torch.from_numpy(pages), n)
        got = kv[loc].reshape(n, -1).contiguous().view(torch.uint8).cpu()
        return torch.equal(got, self.layer(layout, layer).kv)

    def _last_page_matches(self, pool: DSAKVPool, layer: int, page: int, start: int) -> bool:
        """The partial last page, byte for byte (its unused rows hold anything)."""
        layout = pool.layout
        want = self.layer(layout, layer, start=start)
        local, n = layer - layout.start_layer, self.num_tokens - start
        kv = byte_rows(pool.kv_buffer[local])[page * layout.page_size : page * layout.page_size + n]
        if not _same_bytes(np.ascontiguousarray(kv.numpy()), want.kv):
            return False
        got = pool.index_buffer[local].view(torch.uint8).reshape(-1, layout.index_page_bytes)[page].numpy()
        return _index_pages_match(got[None, :], want.index.numpy(), layout)

    def _layer_matches(self, pool: DSAKVPool, layer: int, page_ids: np.ndarray) -> bool:
        layout, n, ps = pool.layout, self.num_tokens, pool.layout.page_size
        want = self.layer(layout, layer, scratch=True)
        local = layer - layout.start_layer
        kv = byte_rows(pool.kv_buffer[local])
        kv_pages = kv[: kv.shape[0] // ps * ps].reshape(-1, ps * kv.shape[1])
        if kv_pages.device.type == "cpu" and want.kv.is_contiguous():
            if not _pages_equal(kv_pages, page_ids, want.kv.numpy()):
                return False
        else:
            got_kv = _take_pages(kv_pages, page_ids, "got_kv").reshape(-1, kv.shape[1])[:n]
            if not _same_bytes(got_kv, want.kv):
                return False
        idx = _take_pages(pool.index_buffer[local], page_ids, "got_index")
        return _index_pages_match(idx, want.index.numpy(), layout)


def _index_pages_match(got: np.ndarray, want: np.ndarray, layout: KVLayout) -> bool:
    """Indexer pages (keys of a page's tokens, then their scales) against per-token rows
    of key and scale bytes: full pages by one memcmp against the rows laid out as pages."""
    ps, hd, n = layout.page_size, layout.index_head_dim, want.shape[0]
    full, kb = n // ps, ps * hd
    if full:
        expect = _buffer("want_index", (full, got.shape[1]), np.uint8)
        # Views that split a contiguous axis: these assignments write into `expect`.
        expect[:, :kb].reshape(full, ps, hd)[...] = want[: full * ps, :hd].reshape(full, ps, hd)
        expect[:, kb:].reshape(full, ps, -1)[...] = want[: full * ps, hd:].reshape(full, ps, -1)
        if not _same_bytes(got[:full], torch.from_numpy(expect)):
            return False
    tail = want[full * ps :]
    if len(tail) == 0:
        return True
    last = got[full]
    return np.array_equal(last[: len(tail) * hd], tail[:, :hd].reshape(-1)) and np.array_equal(
        last[kb : kb + tail[:, hd:].size], tail[:, hd:].reshape(-1)
    )


def summable(pool: DSAKVPool) -> bool:
    """Whether pages can be checked by their 64-bit word sums: host memory, tokens and
    indexer keys of whole words, 4 scale bytes a token, pages of an even token count."""
    layout = pool.layout
    return (
        pool.device.type == "cpu"
        and layout.kv_token_bytes % 8 == 0
        and layout.index_head_dim % 8 == 0
        and layout.index_token_bytes - layout.index_head_dim == 4
        and layout.page_size % 2 == 0
    )


def _runs(page_ids: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) index spans of `page_ids` whose ids are consecutive: one numpy call each."""
    breaks = (np.flatnonzero(np.diff(page_ids) != 1) + 1).tolist()
    return list(zip([0, *breaks], [*breaks, len(page_ids)]))


def _page_sums(pages_view: torch.Tensor, page_ids: np.ndarray) -> np.ndarray:
    """The 64-bit word sum (mod 2**64) of each of `page_ids`'s pages, in place: one numpy
    sum per run of consecutive page ids (no gathered copy)."""
    words = pages_view.numpy().view(np.uint64)
    out = np.empty(len(page_ids), dtype=np.uint64)
    for a, b in _runs(page_ids):
        first = int(page_ids[a])
        words[first : first + b - a].sum(axis=1, out=out[a:b])
    return out


def _pages_equal(pages_view: torch.Tensor, page_ids: np.ndarray, want: np.ndarray) -> bool:
    """Pages `page_ids` of a host (pages, page_bytes) view against `want`'s bytes laid end
    to end (the last page may be partial): one memcmp a page, in place (no gathered copy)."""
    page_bytes, total = pages_view.shape[1], want.nbytes
    base, expect = pages_view.data_ptr(), want.ctypes.data
    if len(page_ids) * page_bytes < total:
        return False
    for i, page in enumerate(page_ids.tolist()):
        offset = i * page_bytes
        if offset >= total:
            break
        if _memcmp(base + page * page_bytes, expect + offset, min(page_bytes, total - offset)):
            return False
    return True


def _take_pages(pages_view: torch.Tensor, page_ids: np.ndarray, name: str) -> np.ndarray:
    """Whole pages `page_ids` of a (pages, page_bytes) view, on the host, as numpy (in
    this thread's scratch `name`)."""
    if pages_view.device.type != "cpu":
        return pages_view[torch.from_numpy(page_ids).to(pages_view.device)].cpu().numpy()
    out = _buffer(name, (len(page_ids), pages_view.shape[1]), np.uint8)
    return np.take(pages_view.numpy(), page_ids, axis=0, out=out, mode="clip")  # ids checked; "raise" buffers


_memcmp = ctypes.CDLL(None).memcmp
_memcmp.restype = ctypes.c_int
_memcmp.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]


def _same_bytes(got: np.ndarray, want: torch.Tensor) -> bool:
    """Byte equality of two equally shaped arrays, at memcmp speed where both are contiguous."""
    w = want.numpy()
    if got.shape != w.shape:
        return False
    if got.flags.c_contiguous and w.flags.c_contiguous:
        return _memcmp(got.ctypes.data, w.ctypes.data, got.nbytes) == 0
    return np.array_equal(got, w)


def request_seed(engine_id: str, room: int) -> int:
    """A seed from (engine, room): two engines' rooms with one id carry different KV."""
    import zlib

    return (zlib.crc32(engine_id.encode()) << 32) ^ room


def prefix_seed(prefix_id: int) -> int:
    return (0x7F4A7C15 << 32) ^ prefix_id


def fragmented_page_order(pages: np.ndarray, rng: np.random.Generator, mean_run: float = 4.0) -> np.ndarray:
    """`pages` cut into runs of geometric length (mean `mean_run`), runs shuffled.

    What a paged allocator's free list looks like after some churn: consecutive pages
    come in short runs, and the runs come in no order.
    """
    if mean_run < 1:
        raise ValueError(f"mean_run must be >= 1, got {mean_run}")
    lengths = rng.geometric(1.0 / mean_run, size=len(pages))
    cuts = np.cumsum(lengths)
    cuts = cuts[cuts < len(pages)]
    runs = np.split(pages, cuts)
    order = rng.permutation(len(runs))
    return np.concatenate([runs[i] for i in order]) if runs else pages


def fragmented_allocator(num_pages: int, seed: int) -> PageAllocator:
    """An allocator whose free list looks like a busy pool's (see `fragmented_page_order`)."""
    return PageAllocator(num_pages, fragmented_page_order(np.arange(1, num_pages), np.random.default_rng(seed)))

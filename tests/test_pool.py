import numpy as np
import pytest
import torch

from pdkv import DSAKVPool, LayerSplitDSAKVPool, PageRangeError, ShardPlan, dsa_v32, tiny
from pdkv.buffers import gather_index_k, gather_index_scale
from transfer.app.synthetic import SyntheticLayer

# The same tests run on CUDA where a GPU is present (scripts/gpu_check.sh); CI has none.
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


def _fill(pool, seed, pages):
    ps = pool.layout.page_size
    loc = (torch.as_tensor(pages)[:, None] * ps + torch.arange(ps)).reshape(-1)
    for layer in range(pool.layout.layer_num):
        d = SyntheticLayer(pool.layout, seed, layer, loc)
        pool.set_kv_buffer(layer, loc, d.kv_rows(pool.layout))
        pool.set_index_k_and_scale(layer, loc, d.index_k, d.index_scale)
    return loc


def _assert_holds(pool, seed, src_tokens, at_tokens, pages):
    for layer in pool.owned:
        want = SyntheticLayer(pool.layout, seed, layer, src_tokens)
        got = pool.kv_buffer[layer][at_tokens].reshape(at_tokens.numel(), -1).contiguous()
        assert torch.equal(got.view(torch.uint8).cpu(), want.kv)
        # Straight from the owned buffer: the pool's read API is collective on a CP group.
        k = gather_index_k(pool.index_buffer[layer], pool.layout, at_tokens.numel(), torch.as_tensor(pages))
        s = gather_index_scale(pool.index_buffer[layer], pool.layout, at_tokens.numel(), torch.as_tensor(pages))
        assert torch.equal(k.cpu(), want.index_k)
        assert torch.equal(s.cpu().view(torch.float32).reshape(-1), want.index_scale.reshape(-1))


def test_layer_split_buffer_infos_cover_owned_layers_only(device):
    layout = tiny(device=device, layer_num=10)
    plan = ShardPlan(1, 3, 10)  # owns [4, 7)
    pool = LayerSplitDSAKVPool(layout, plan, broadcaster=_NoBroadcast())
    kv, idx = pool.get_contiguous_buf_infos(), pool.get_state_buf_infos()
    assert kv.layer_ids == idx.layer_ids == (4, 5, 6)
    assert pool.layer_shard_start == 4
    for i, layer in enumerate(kv.layer_ids):
        assert kv.data_ptrs[i] == pool.kv_buffer[layer].data_ptr()
        assert kv.data_lens[i] == layout.kv_rows * layout.kv_token_bytes
        assert kv.item_lens[i] == layout.kv_page_bytes == pool.kv_buffer[layer][0].nbytes * layout.page_size
        assert idx.data_ptrs[i] == pool.index_buffer[layer].data_ptr()
        assert idx.data_lens[i] == layout.index_num_pages * layout.index_page_bytes
        assert idx.item_lens[i] == layout.index_page_bytes == 4 * 132
    # Owned layers are one slab, layer after layer, each its latent then its indexer.
    slab = pool.registered_buffers()
    assert len(slab) == 1 and slab[0].is_contiguous()
    start, end = slab[0].data_ptr(), slab[0].data_ptr() + slab[0].nbytes
    for i in range(3):
        assert start <= kv.data_ptrs[i] < kv.data_ptrs[i] + kv.data_lens[i] <= idx.data_ptrs[i]
        assert idx.data_ptrs[i] + idx.data_lens[i] <= (kv.data_ptrs[i + 1] if i < 2 else end)
    assert all(pool.kv_buffer[layer].shape[0] == 0 for layer in (0, 3, 7, 9))


def test_dsa_v32_geometry(device):
    layout = dsa_v32(size=64 * 64, device=device)
    assert layout.kv_page_bytes == 41_984 and layout.index_page_bytes == 8_448
    assert layout.fingerprint == dsa_v32(size=128 * 64).fingerprint  # size is per process
    assert layout.fingerprint != layout.replace(page_size=32).fingerprint


def test_cpu_offload_round_trip_restores_owned_layers(device):
    layout = tiny(device=device, layer_num=6)
    pool = LayerSplitDSAKVPool(layout, ShardPlan(0, 2, 6), broadcaster=_NoBroadcast())
    pages = [5, 2, 8]
    loc = _fill(pool, 7, pages)
    copy = pool.get_cpu_copy(loc)
    assert [c is None for c in copy.kv] == [False] * 3 + [True] * 3
    _fill(pool, 8, pages)  # overwrite
    pool.load_cpu_copy(copy, loc)
    _assert_holds(pool, 7, loc, loc, pages)


def test_move_kv_cache_moves_latent_and_index_tokens(device):
    pool = DSAKVPool(tiny(device=device, layer_num=3))
    src_pages, dst_pages = [4, 9], [11, 1]
    src = _fill(pool, 3, src_pages)
    ps = pool.layout.page_size
    dst = (torch.tensor(dst_pages)[:, None] * ps + torch.arange(ps)).reshape(-1)
    pool.move_kv_cache(dst, src)
    _assert_holds(pool, 3, src, dst, dst_pages)


def test_set_mla_kv_buffer_concatenates_nope_and_rope(device):
    pool = DSAKVPool(dsa_v32(size=256, device=device))
    loc = torch.tensor([0, 5, 64])
    nope = torch.randint(0, 255, (3, 528), dtype=torch.uint8)
    rope = torch.randn(3, 64).to(torch.bfloat16)
    pool.set_mla_kv_buffer(2, loc, nope, rope)
    row = pool.kv_buffer[2][loc, 0].cpu()
    assert torch.equal(row[:, :528], nope)
    assert torch.equal(row[:, 528:], rope.view(torch.uint8))
    assert pool.get_value_buffer(2).shape[-1] == 512


@pytest.mark.parametrize(
    "call",
    [
        lambda p: p.set_kv_buffer(0, torch.tensor([p.layout.kv_rows]), torch.zeros(1, 24, dtype=torch.bfloat16)),
        lambda p: p.set_kv_buffer(0, torch.tensor([-1]), torch.zeros(1, 24, dtype=torch.bfloat16)),
        lambda p: p.get_key_buffer(p.layout.layer_num),
        lambda p: p.get_key_buffer(-1),
        lambda p: p.get_index_k(0, 4, torch.tensor([p.layout.index_num_pages])),
        lambda p: p.get_index_k(0, 9, torch.tensor([1, 2])),
        lambda p: p.move_kv_cache(torch.tensor([1]), torch.tensor([10_000])),
        lambda p: p.set_index_k_and_scale(0, torch.tensor([10_000]), torch.zeros(1, 128), torch.zeros(1)),
    ],
)
def test_out_of_range_raises_page_range_error(call, device):
    pool = DSAKVPool(tiny(device=device, layer_num=3))
    before = pool.kv_slab.clone()
    with pytest.raises(PageRangeError):
        call(pool)
    assert torch.equal(pool.kv_slab, before)


class _NoBroadcast:
    """Only for single-process tests that never read a non-owned layer."""

    def start(self, *a, **k):  # pragma: no cover - reaching it is the failure
        raise AssertionError("no broadcast expected in this test")


def _written(pool: DSAKVPool, content, pages: torch.Tensor) -> DSAKVPool:
    """`pool` with `content` written in `pages` of every layer, as the stand-in prefill writes it."""
    from transfer.app.synthetic import token_locations

    loc = token_locations(pool.layout, pages, content.num_tokens)
    for layer in range(pool.layout.layer_num):
        d = content.layer(pool.layout, layer)
        pool.set_kv_buffer(layer, loc, d.kv_rows(pool.layout))
        pool.set_index_k_and_scale(layer, loc, d.index_k, d.index_scale)
    return pool


@pytest.mark.parametrize("token", [7, 9])  # in a full page; in the last, partial page
@pytest.mark.parametrize("where", ["kv", "index_k", "index_scale"])
def test_verification_catches_a_single_flipped_byte(where, token, device):
    from transfer.app.synthetic import RequestContent, token_locations

    pages = torch.tensor([6, 2, 9])
    content = RequestContent(11, 10, prefix_seed=5, prefix_tokens=4)
    pool = _written(DSAKVPool(tiny(device=device, layer_num=3)), content, pages)
    assert content.mismatched_layers(pool, pages) == []
    loc = token_locations(pool.layout, pages, 10)
    if where == "kv":
        pool.kv_buffer[1].view(torch.uint8)[loc[token], 0, 3] ^= 1  # bytes: a bf16 NaN + 1 may not change
    else:
        page, off = int(pages[token // 4]), token % 4  # 4-token pages
        col = off * 128 + 5 if where == "index_k" else pool.layout.index_scale_offset + off * 4 + 1
        pool.index_buffer[1][page, col] ^= 1
    assert content.mismatched_layers(pool, pages) == [1]


def test_verification_catches_swapped_pages_and_another_rooms_content():
    """The page sums: two full pages swapped, or a room's pages holding another room's
    (or another layer's) content, are caught as surely as a flipped byte."""
    from transfer.app.synthetic import RequestContent

    pages = torch.tensor([6, 2, 9, 4])
    content = RequestContent(11, 14, prefix_seed=5, prefix_tokens=4)  # 3 full pages, a partial one
    pool = _written(DSAKVPool(tiny(layer_num=3)), content, pages)
    assert content.mismatched_layers(pool, pages) == []
    assert content.mismatched_layers(pool, pages[[1, 0, 2, 3]]) == [0, 1, 2]  # two pages swapped
    other = RequestContent(12, 14, prefix_seed=5, prefix_tokens=4)  # same prefix, another room
    assert other.mismatched_layers(pool, pages) == [0, 1, 2]
    saved = pool.index_buffer[2][6].clone()
    pool.index_buffer[2][6] = pool.index_buffer[1][6]  # layer 1's indexer page in layer 2
    assert content.mismatched_layers(pool, pages) == [2]
    pool.index_buffer[2][6] = saved
    assert content.mismatched_layers(pool, pages) == []


@pytest.mark.parametrize("tokens", [8, 7])  # whole pages (summed); a partial last page (compared)
def test_the_prefix_check_of_one_layers_latent_catches_a_flipped_byte_and_moved_pages(tokens, device):
    """What the stand-in prefill checks of a shared prefix read through the owner broadcast."""
    from transfer.app.synthetic import RequestContent, token_locations

    pages = torch.tensor([6, 2])
    content = RequestContent(5, tokens)
    pool = _written(DSAKVPool(tiny(device=device, layer_num=3)), content, pages)
    kv, ids = pool.get_key_buffer(1), pages.numpy()
    assert content.latent_matches(pool.layout, kv, 1, ids)
    assert not content.latent_matches(pool.layout, kv, 2, ids)  # another layer's content
    assert not content.latent_matches(pool.layout, kv, 1, ids[::-1].copy())  # the pages swapped
    assert not RequestContent(6, tokens).latent_matches(pool.layout, kv, 1, ids)  # another prefix
    loc = token_locations(pool.layout, pages, tokens)
    pool.kv_buffer[1].view(torch.uint8)[loc[5], 0, 7] ^= 1
    assert not content.latent_matches(pool.layout, pool.get_key_buffer(1), 1, ids)


def test_the_stand_in_writes_in_place_the_bytes_the_pools_write_methods_store():
    """`RequestContent.write_layer` (the stand-in prefill's fast path) against
    `set_kv_buffer` / `set_index_k_and_scale`, byte for byte over whole slabs: fragmented
    pages, a partial last page, a shared prefix; bytes outside the request untouched."""
    from transfer.app.synthetic import RequestContent, summable, token_locations

    layout = tiny(size=256, layer_num=3)
    pages = np.array([9, 10, 11, 3, 4, 20, 7])  # runs of 3, 2, 1, 1 pages; the last one partial
    content = RequestContent(7, 27, prefix_seed=3, prefix_tokens=6)
    by_methods, in_place = DSAKVPool(layout), DSAKVPool(layout)
    for p in (by_methods, in_place):
        p.kv_slab.view(torch.uint8).fill_(0x5A)
        p.index_slab.view(torch.uint8).fill_(0x5A)
    assert summable(in_place)
    _written(by_methods, content, torch.from_numpy(pages))
    for layer in range(layout.layer_num):
        content.write_layer(in_place, layer, pages)
    assert torch.equal(by_methods.kv_slab.view(torch.uint8), in_place.kv_slab.view(torch.uint8))
    assert torch.equal(by_methods.index_slab.view(torch.uint8), in_place.index_slab.view(torch.uint8))
    assert content.mismatched_layers(in_place, torch.from_numpy(pages)) == []
    assert token_locations(layout, torch.from_numpy(pages), 27)[-1] == 7 * 4 + 2  # the partial page's last slot

"""The paged layout helpers: slots, writing new tokens, reading a sequence back."""

from __future__ import annotations

import pytest
import torch

from kvstore.kernels.paged import gather_tokens, new_kv_pool, slot_mapping, write_tokens


def test_slot_mapping_follows_the_block_table() -> None:
    pages = torch.tensor([7, 2, 5], dtype=torch.int32)
    slots = slot_mapping(pages, 3, 6, page_tokens=4)
    assert slots.tolist() == [7 * 4 + 3, 2 * 4 + 0, 2 * 4 + 1, 2 * 4 + 2, 2 * 4 + 3, 5 * 4 + 0]
    assert slots.dtype == torch.int64
    assert slot_mapping(pages, 12, 0, page_tokens=4).numel() == 0


def test_slot_mapping_refuses_tokens_past_the_pages() -> None:
    pages = torch.tensor([1, 0], dtype=torch.int32)
    with pytest.raises(ValueError, match="need more than the 2 pages"):
        slot_mapping(pages, 5, 4, page_tokens=4)
    with pytest.raises(ValueError, match="start and num_tokens must be >= 0"):
        slot_mapping(pages, -1, 1, page_tokens=4)
    with pytest.raises(ValueError, match="pages dtype"):
        slot_mapping(pages.float(), 0, 1, page_tokens=4)


def test_written_tokens_read_back_in_order() -> None:
    pool = new_kv_pool(2, 6, 4, 2, 16, dtype=torch.bfloat16)
    assert pool.shape == (2, 2, 6, 4, 2, 16)
    pages = torch.tensor([4, 0, 3], dtype=torch.int32)
    k, v = torch.randn(2, 10, 2, 16).to(torch.bfloat16)
    write_tokens(pool[1, 0], pool[1, 1], k, v, slot_mapping(pages, 0, 10, 4))
    assert torch.equal(gather_tokens(pool[1, 0], pages, 10), k)
    assert torch.equal(gather_tokens(pool[1, 1], pages, 7), v[:7])
    assert not pool[0].any()
    with pytest.raises(ValueError, match="13 tokens need 4 pages"):
        gather_tokens(pool[1, 0], pages, 13)


def test_write_tokens_checks_its_arguments() -> None:
    pool = new_kv_pool(1, 4, 4, 2, 16, dtype=torch.float16)
    k = torch.zeros(3, 2, 16, dtype=torch.float16)
    slots = torch.arange(3)
    with pytest.raises(ValueError, match="k dtype"):
        write_tokens(pool[0, 0], pool[0, 1], k.float(), k, slots)
    with pytest.raises(ValueError, match=r"v\.shape\[1\] must equal num_kv_heads"):
        write_tokens(pool[0, 0], pool[0, 1], k, k[:, :1], slots)
    with pytest.raises(ValueError, match=r"slots\.shape\[0\] must equal num_tokens"):
        write_tokens(pool[0, 0], pool[0, 1], k, k, slots[:2])
    with pytest.raises(ValueError, match="v_cache dtype"):
        write_tokens(pool[0, 0], pool[0, 1].float(), k, k, slots)

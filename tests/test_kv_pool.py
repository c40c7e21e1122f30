"""PagePool: reference-counted pages, the accounting every KV decision relies on."""
from __future__ import annotations

import pytest

from pflash_plugin.engine.kv_pool import OutOfPages, PagePool


def test_rejects_empty_pool():
    with pytest.raises(ValueError):
        PagePool(0, 4)
    with pytest.raises(ValueError):
        PagePool(4, 0)


def test_pages_for_rounds_up():
    pool = PagePool(8, 4)
    assert [pool.pages_for(n) for n in (0, 1, 3, 4, 5, 8, 9)] == [0, 1, 1, 1, 2, 2, 3]


def test_allocate_and_release_counts():
    pool = PagePool(4, 16)
    assert (pool.free_pages, pool.used_pages) == (4, 0)
    a = pool.allocate(3)
    assert len(a) == len(set(a)) == 3
    assert all(0 <= p < 4 for p in a)
    assert (pool.free_pages, pool.used_pages) == (1, 3)
    assert not any(pool.shared(p) for p in a)
    assert pool.release(a[:2]) == 2
    assert (pool.free_pages, pool.used_pages) == (3, 1)
    b = pool.allocate(3)
    assert not set(b) & {a[2]}, "a page still in use was handed out again"
    assert pool.free_pages == 0


def test_allocate_zero_is_fine():
    pool = PagePool(2, 4)
    assert pool.allocate(0) == []
    assert pool.free_pages == 2


def test_out_of_pages_allocates_nothing():
    pool = PagePool(3, 4)
    pool.allocate(2)
    with pytest.raises(OutOfPages):
        pool.allocate(2)
    assert pool.free_pages == 1, "a failed allocation must not take pages"
    assert len(pool.allocate(1)) == 1
    with pytest.raises(OutOfPages):
        pool.allocate(1)


def test_share_refcounts_until_last_release():
    pool = PagePool(4, 4)
    pages = pool.allocate(2)
    shared = pool.share(pages)
    assert shared == pages and shared is not pages
    assert all(pool.shared(p) for p in pages)
    pool.share(pages[:1])  # three holders of the first page
    assert pool.release(pages) == 0, "pages with other holders must stay allocated"
    assert pool.used_pages == 2
    assert pool.shared(pages[0]) and not pool.shared(pages[1])
    assert pool.release(pages) == 1  # second page freed, first still has one holder
    assert pool.used_pages == 1 and not pool.shared(pages[0])
    assert pool.release(pages[:1]) == 1
    assert pool.used_pages == 0


def test_double_free_asserts():
    pool = PagePool(2, 4)
    pages = pool.allocate(1)
    pool.release(pages)
    with pytest.raises(AssertionError):
        pool.release(pages)
    assert pool.free_pages == 2, "a double free must not put the page on the free list twice"


def test_release_of_never_allocated_page_asserts():
    pool = PagePool(2, 4)
    with pytest.raises(AssertionError):
        pool.release([1])


def test_share_of_free_page_asserts():
    pool = PagePool(2, 4)
    pages = pool.allocate(1)
    pool.release(pages)
    with pytest.raises(AssertionError):
        pool.share(pages)


def test_all_pages_cycle_without_duplicates():
    pool = PagePool(5, 2)
    for _ in range(3):
        pages = pool.allocate(5)
        assert sorted(pages) == list(range(5))
        assert pool.release(pages) == 5
    assert pool.free_pages == 5

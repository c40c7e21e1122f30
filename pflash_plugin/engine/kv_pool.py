"""Paged accounting of the llama.cpp KV cells shared by all slots.

llama.cpp's unified KV cache places cells itself and has no eviction: a decode with no free cell
fails. The pool reserves pages before anything is written, so a decode never runs out of cells.
Pages are reference counted because `llama_memory_seq_cp` lets several sequences share the cells
of a common prefix. Only full pages are shared; a slot that writes into a shared page first trades
it for a fresh one (copy-on-write accounting), so the count never undercounts the real cells.
"""
from __future__ import annotations


class OutOfPages(RuntimeError):
    pass


class PagePool:
    def __init__(self, n_pages: int, page_size: int) -> None:
        if n_pages <= 0 or page_size <= 0:
            raise ValueError("the KV pool needs at least one page of at least one token")
        self.page_size = page_size
        self.n_pages = n_pages
        self._free = list(range(n_pages - 1, -1, -1))
        self._refs = [0] * n_pages

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def used_pages(self) -> int:
        return self.n_pages - len(self._free)

    def pages_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.page_size)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPages(f"need {n} KV pages, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(n)]
        for page in pages:
            self._refs[page] = 1
        return pages

    def share(self, pages: list[int]) -> list[int]:
        for page in pages:
            assert self._refs[page] > 0, "sharing a free page"
            self._refs[page] += 1
        return list(pages)

    def release(self, pages: list[int]) -> int:
        """Drop one reference to each page; returns how many became free."""
        freed = 0
        for page in pages:
            assert self._refs[page] > 0, "double free of a KV page"
            self._refs[page] -= 1
            if self._refs[page] == 0:
                self._free.append(page)
                freed += 1
        return freed

    def shared(self, page: int) -> bool:
        return self._refs[page] > 1

"""A paged KV cache: fixed-shape device buffers, and the host's list of free pages.

The keys and values of every sequence live in one pool of P pages of Z
positions each. A sequence owns a list of pages; its page table row maps
position p to page `table[p // Z]`, offset `p % Z`:

    page_size Z = 4, pages [7, 2]  ->  positions 0-3 in page 7, 4-7 in page 2

Why pages rather than one [B, max_len] slab per slot? A slab reserves max_len
positions for every slot whatever its length; pages are handed out as a
sequence grows and given back when it finishes, so short and long sequences
share the memory. Shapes still never change: P, Z and the table width W are
fixed, so the jitted steps compile for a few shapes (runner.py), not for every
length.

Page 0 is a null page that no sequence owns. Unused page-table entries point
to it, and writes that must go nowhere (padding, paused or free slots) land in
it. Its contents are garbage by design; the decode step masks them out.
Shape letters: the legend in model.py.
"""

import jax.numpy as jnp

NULL_PAGE = 0


def init_cache(cfg, n_pages, page_size, dtype=None):
    """-> {"k": [L, K, P, Z, H], "v": [L, K, P, Z, H]}, zeros in `dtype` (default cfg.dtype).
    Page 0 is the null page.

    The kv heads come before the pages: one head's pages are one block of memory, the layout
    paged-attention kernels read (decode.paged_attention).
    """
    if n_pages < 2:
        raise ValueError(f"n_pages={n_pages}: need at least 2 (page 0 is the null page)")
    shape = (cfg.n_layers, cfg.n_kv_heads, n_pages, page_size, cfg.head_dim)
    dtype = dtype or cfg.dtype
    return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}


def pages_for(n_positions, page_size):
    """Pages needed to hold n positions: ceil(n / Z). pages_for(0, 4) == 0, pages_for(5, 4) == 2."""
    return -(-n_positions // page_size)


class OutOfPages(RuntimeError):
    """Not enough free pages in the KV cache for what was asked."""


class PagePool:
    """Host-side free lists, for `n_devices` devices of n_pages pages each.

    `alloc` hands out free pages, `release` gives them back; a page is owned by one sequence at
    a time. Page ids are global: device d holds pages d * n_pages to d * n_pages + n_pages - 1,
    the first of them its null page, never handed out. On one device (the usual case) that is
    pages 0 to n_pages - 1, page 0 null.
    """

    def __init__(self, n_pages, n_devices=1):
        self.n_pages, self.n_devices = n_pages, n_devices          # n_pages: on each device
        self.owned = [False] * (n_pages * n_devices)
        # A stack per device: the most recently freed page is reused first (likely still in
        # cache memory).
        self.free = [list(range(d * n_pages + n_pages - 1, d * n_pages, -1))
                     for d in range(n_devices)]

    @property
    def n_free(self):
        return sum(map(len, self.free))

    @property
    def n_used(self):
        return self.n_devices * (self.n_pages - 1) - self.n_free

    def device_of(self, page):
        return page // self.n_pages

    def alloc(self, n, device=0):
        free = self.free[device]
        if n > len(free):
            raise OutOfPages(f"asked for {n} pages but only {len(free)} of {self.n_pages - 1} "
                             f"are free" + (f" on device {device}" if self.n_devices > 1 else ""))
        pages = [free.pop() for _ in range(n)]
        for p in pages:
            self.owned[p] = True
        return pages

    def release(self, pages):
        for p in pages:
            if p % self.n_pages == NULL_PAGE or not self.owned[p]:
                raise ValueError(f"release of page {p}, which is not allocated (double free?)")
            self.owned[p] = False
            self.free[self.device_of(p)].append(p)

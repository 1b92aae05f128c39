"""The baseline for ``kern.bench.prefix``: a pure-Python radix tree written for speed, with the
semantics of ``kern.pool.Cache`` on a device-only, stateless cache fed whole pages.

What makes it fast, as Python trees go:

- keys are ``bytes`` of little-endian u32, so comparing a node's run against the key is one
  ``bytes.startswith(run, offset)`` (a memory compare, no slice);
- children sit in a dict keyed by their first page's bytes: one lookup per step down;
- offsets into the key, not slices of it, while walking;
- evictable leaves in a heap kept as things change (stale entries skipped when popped), so a
  make-room step pops the coldest leaf instead of collecting and heapifying every leaf;
- page ids in a free list (a Python list used as a stack).

Semantics, the same as kern's (``docs/pool.md``): a match descends through the children it
matches whole and stops in the one it matches in part, splitting it right after the last page
it read (a whole page, or the page the key ends in); where the key ends inside the first page
of several children it reads the one used last. It refreshes and locks only that path. An
insert walks the same way, splits where the key leaves the tree and hangs the rest as one new
leaf; it refreshes the key's path and reports how many tokens the tree already held. Eviction
takes the unlocked leaf used longest ago (ties: deeper first), whole, until the room asked for
is there. One logical clock tick per operation. `take_pages` and `release` combine the calls a
request makes back to back, as kern's `Cache` does.
"""

from __future__ import annotations

import heapq

from kern.arith import cdiv


class PoolFull(Exception):
    pass


class Node:
    __slots__ = ("parent", "key", "pages", "children", "lock", "own_lock", "tick", "end", "live")

    def __init__(self, parent: Node | None, key: bytes, pages: list[int], end: int, tick: int):
        self.parent = parent
        self.key = key  # this node's tokens, as bytes
        self.pages = pages
        self.children: dict[bytes, Node] = {}
        self.lock = 0  # locks on this node and its descendants
        self.own_lock = 0  # locks taken on this node itself
        self.tick = tick
        self.end = end  # path length (tokens) at this node's end
        self.live = True


class Match:
    __slots__ = ("hit_len", "node", "pages")

    def __init__(self, hit_len: int, node: Node | None, pages: list[int]):
        self.hit_len, self.node, self.pages = hit_len, node, pages


class Tree:
    def __init__(self, page_tokens: int, num_pages: int):
        self.pt = page_tokens
        self.unit = 4 * page_tokens  # bytes per page of key
        self.root = Node(None, b"", [], 0, 0)
        self.free = list(range(num_pages - 1, -1, -1))
        self.clock = 0
        self.heap: list[tuple[int, int, int, Node]] = []
        self.serial = 0
        self.num_nodes = 0
        self.num_evicted = 0
        self.cached_pages = 0

    # ---- the pool

    @property
    def pages_free(self) -> int:
        return len(self.free)

    def alloc_pages(self, n: int) -> list[int]:
        if n > len(self.free):
            raise PoolFull(f"needed {n}, only {len(self.free)} free")
        if n == 0:
            return []
        out = self.free[-n:]
        del self.free[-n:]
        return out

    def free_pages(self, pages: list[int]) -> None:
        self.free.extend(pages)

    # ---- eviction candidates

    def _offer(self, node: Node) -> None:
        """Push `node` if it is an evictable leaf now (older entries for it go stale)."""
        if node.lock == 0 and not node.children and node is not self.root:
            self.serial += 1
            heapq.heappush(self.heap, (node.tick, -node.end, self.serial, node))

    def make_room(self, n: int) -> int:
        """Evict whole leaves, coldest first, until `n` pages are free; returns how many
        entries went."""
        taken = 0
        heap = self.heap
        while len(self.free) < n and heap:
            tick, _, _, x = heapq.heappop(heap)
            if not x.live or x.lock or x.children or x.tick != tick:
                continue  # stale: touched, locked or grown since it was pushed
            p = x.parent
            del p.children[x.key[: self.unit]]
            x.live = False
            self.free.extend(x.pages)
            self.cached_pages -= len(x.pages)
            self.num_nodes -= 1
            taken += 1
            self._offer(p)
        self.num_evicted += taken
        if len(heap) > 4 * self.num_nodes + 64:
            # Too many stale entries: rebuild from the live leaves.
            self.heap = [e for e in heap if e[3].live and e[3].tick == e[0]]
            heapq.heapify(self.heap)
        return taken

    # ---- walking

    def _split(self, c: Node, nbytes: int) -> Node:
        """Split `c` after `nbytes` bytes of key (whole pages) into a new parent."""
        ntok = nbytes // 4
        k = ntok // self.pt
        p = c.parent
        top = Node(p, c.key[:nbytes], c.pages[:k], c.end - len(c.key) // 4 + ntok, c.tick)
        top.lock = c.lock
        p.children[c.key[: self.unit]] = top
        c.key = c.key[nbytes:]
        c.pages = c.pages[k:]
        c.parent = top
        top.children[c.key[: self.unit]] = c
        self.num_nodes += 1
        return top

    def _common_pages(self, run: bytes, key: bytes, off: int) -> int:
        """Bytes (whole pages) of `run` that `key` matches from `off`; `run` does not match
        whole."""
        u = self.unit
        lo, hi = 1, min(len(run), len(key) - off) // u  # the first page matched (the dict key)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if key.startswith(run[: mid * u], off):
                lo = mid
            else:
                hi = mid - 1
        return lo * u

    def _walk(self, key: bytes) -> tuple[Node, int, list[Node]]:
        """Descend as far as `key` matches, splitting the node it stops in right after the last
        page it read; returns the deepest node, the bytes matched and the path."""
        u = self.unit
        node, off, path = self.root, 0, []
        end = len(key)
        while end - off >= u:
            c = node.children.get(key[off : off + u])
            if c is None:
                break
            run = c.key
            if key.startswith(run, off):
                path.append(c)
                node, off = c, off + len(run)
                continue
            if len(run) > end - off and run.startswith(key[off:]):
                n = end - off  # the key ends inside `run`, which it reads to there
            else:
                n = self._common_pages(run, key, off)
            top = cdiv(n, u) * u
            c = self._split(c, top) if top < len(run) else c
            path.append(c)
            return c, off + n, path
        if 0 < end - off < u:
            # The key ends inside a child's first page: read the one used last.
            rest = key[off:]
            inside = [c for c in node.children.values() if c.key.startswith(rest)]
            if inside:
                c = max(inside, key=lambda c: c.tick)
                c = self._split(c, u) if len(c.key) > u else c
                path.append(c)
                return c, end, path
        return node, off, path

    def _touch(self, path: list[Node]) -> None:
        self.clock += 1
        now = self.clock
        for n in path:
            n.tick = now
        if path:
            self._offer(path[-1])

    # ---- the operations

    def match(self, key: bytes) -> Match:
        """Longest cached prefix, locked (release with `unlock`)."""
        node, off, path = self._walk(key)
        if not path:
            return Match(0, None, [])
        pages: list[int] = []
        for n in path:
            pages += n.pages
        node.own_lock += 1
        x: Node | None = node
        while x is not None and x is not self.root:
            x.lock += 1
            x = x.parent
        self._touch(path)
        return Match(off // 4, node, pages)

    def unlock(self, node: Node) -> None:
        if node.own_lock == 0:
            raise ValueError("not locked")
        node.own_lock -= 1
        x: Node | None = node
        while x is not None and x is not self.root:
            x.lock -= 1
            if x.lock == 0:
                self._offer(x)
            x = x.parent

    def take_pages(self, n: int) -> tuple[list[int] | None, int]:
        """`make_room(n)` and, when `n` pages are free, `alloc_pages(n)`: (the pages or None,
        entries evicted)."""
        taken = self.make_room(n)
        if n > len(self.free):
            return None, taken
        return self.alloc_pages(n), taken

    def release(
        self, key: bytes, pages: list[int], hit: int, node: Node | None, free: list[int]
    ) -> int:
        """The end of a request: `insert`, free the caller's copies of what the tree held past
        the match's `hit` (tokens) and the pages in `free`, and unlock `node`; returns the
        tokens the tree held."""
        held = self.insert(key, pages)
        self.free.extend(pages[hit // self.pt : held // self.pt])
        self.free.extend(free)
        if node is not None:
            self.unlock(node)
        return held

    def insert(self, key: bytes, pages: list[int]) -> int:
        """Give the key (whole pages) and its pages to the tree; returns the tokens it held.
        The caller frees its own pages for those tokens (they duplicate the tree's)."""
        node, off, path = self._walk(key)
        if off < len(key):
            leaf = Node(node, key[off:], pages[off // self.unit :], len(key) // 4, 0)
            node.children[key[off : off + self.unit]] = leaf
            self.num_nodes += 1
            self.cached_pages += len(leaf.pages)
            path.append(leaf)
        self._touch(path)
        return off // 4

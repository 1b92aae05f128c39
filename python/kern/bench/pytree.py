"""The baseline for ``kern.bench.prefix``: a plain pure-Python radix tree with the semantics of
``kern.pool.Cache`` for a stateless model (match, lock, insert, make room, wake), written the way
Python serving trees usually are: node objects, dict children, page-stepped key compares, and
a make-room step that collects the evictable leaves and heapifies them on every call.

Kept only as the benchmark's yardstick: both must report the same hit rate on the same trace.
"""

from __future__ import annotations

import heapq


class PoolFull(Exception):
    pass


class _Node:
    __slots__ = ("parent", "start", "tokens", "pages", "parked", "children", "lock", "stamp")

    def __init__(self, parent, start, tokens, pages):
        self.parent = parent
        self.start = start
        self.tokens = tokens
        self.pages = pages
        self.parked = False
        self.children: dict[int, list[_Node]] = {}
        self.lock = 0
        self.stamp = 0

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    def kids(self):
        for bucket in self.children.values():
            yield from bucket


class PyMatch:
    __slots__ = ("hit_len", "resident_len", "node", "pages")

    def __init__(self, hit_len, resident_len, node, pages):
        self.hit_len, self.resident_len, self.node, self.pages = hit_len, resident_len, node, pages


class PyCache:
    def __init__(self, page_tokens: int, device_pages: int, host_pages: int):
        self.pt = page_tokens
        self.root = _Node(None, 0, [], [])
        self.free_pages = list(range(device_pages - 1, -1, -1))
        self.host_free = list(range(host_pages - 1, -1, -1))
        self.host_capacity = host_pages
        self.clock = 0
        self.num_parked = self.num_dropped_resident = self.num_dropped_parked = self.num_woken = 0

    @property
    def pages_free(self) -> int:
        return len(self.free_pages)

    def _lcp(self, a, b) -> int:
        pt, n, i = self.pt, min(len(a), len(b)), 0
        while i + pt <= n and a[i : i + pt] == b[i : i + pt]:
            i += pt
        while i < n and a[i] == b[i]:
            i += 1
        return i

    def _best_child(self, node, rest, pos):
        bucket = node.children.get(rest[pos]) if pos < len(rest) else None
        best, best_rank = None, None
        for c in bucket or ():
            n = self._lcp(c.tokens, rest[pos : pos + len(c.tokens)])
            # Ties as the Rust tree breaks them: resident first, then matched whole.
            rank = (n, not c.parked, n == len(c.tokens))
            if best is None or rank > best_rank:
                best, best_rank = c, rank
        return best, (best_rank[0] if best is not None else 0)

    def _walk(self, tokens):
        path, node, pos = [], self.root, 0
        while True:
            c, n = self._best_child(node, tokens, pos)
            if c is None:
                return path, pos
            path.append(c)
            pos += n
            if n < len(c.tokens):
                return path, pos
            node = c

    def _touch(self, path):
        self.clock += 1
        for n in path:
            n.stamp = self.clock

    def match(self, tokens) -> PyMatch:
        path, hit = self._walk(tokens)
        pages, resident, ok = [], 0, True
        for n in path:
            end = min(n.end, hit)
            if ok and not n.parked:
                pages.extend(n.pages[: -(-(end - n.start) // self.pt)])
                resident = end
            else:
                ok = False
        self._touch(path)
        return PyMatch(hit, resident, path[-1] if path else None, pages)

    def lock(self, node):
        while node is not self.root:
            node.lock += 1
            node = node.parent

    def unlock(self, node):
        while node is not self.root:
            node.lock -= 1
            node = node.parent

    def alloc_pages(self, n):
        if n > len(self.free_pages):
            raise PoolFull(f"needed {n}, only {len(self.free_pages)} available")
        out = self.free_pages[-n:] if n else []
        del self.free_pages[len(self.free_pages) - n :]
        return out

    def free(self, pages):
        self.free_pages.extend(pages)

    def _split(self, c, at):
        k = at // self.pt
        top = _Node(c.parent, c.start, c.tokens[:at], c.pages[:k])
        top.parked, top.lock, top.stamp = c.parked, c.lock, c.stamp
        bucket = c.parent.children[c.tokens[0]]
        bucket[bucket.index(c)] = top
        c.tokens, c.pages, c.start, c.parent = c.tokens[at:], c.pages[k:], c.start + at, top
        top.children[c.tokens[0]] = [c]
        return top

    def _leaf(self, parent, tokens, pages):
        leaf = _Node(parent, parent.end, tokens, pages)
        parent.children.setdefault(tokens[0], []).append(leaf)
        return leaf

    def _dups(self, c, pages, lo, hi, out):
        base = c.start // self.pt
        for g in range(lo, hi):
            if c.parked or c.pages[g - base] != pages[g]:
                out.append(pages[g])

    def insert(self, tokens, pages):
        pt, dups, node, pos = self.pt, [], self.root, 0
        while pos < len(tokens):
            g0 = pos // pt
            c, m = self._best_child(node, tokens, pos)
            if c is None:
                node = self._leaf(node, tokens[pos:], pages[g0:])
                break
            clen, rest = len(c.tokens), len(tokens) - pos
            if m == clen and not (clen % pt and rest > clen):
                self._dups(c, pages, g0, g0 + -(-clen // pt), dups)
                pos, node = pos + clen, c
                continue
            if m == rest:
                self._dups(c, pages, g0, len(pages), dups)
                node = c
                break
            s = m // pt * pt
            gs = g0 + s // pt
            self._dups(c, pages, g0, gs, dups)
            parent = self._split(c, s) if s else node
            node = self._leaf(parent, tokens[pos + s :], pages[gs:])
            break
        path = []
        while node is not self.root:
            path.append(node)
            node = node.parent
        self._touch(path)
        return dups

    def _remove(self, n):
        bucket = n.parent.children[n.tokens[0]]
        bucket.remove(n)
        if not bucket:
            del n.parent.children[n.tokens[0]]

    def _candidates(self, parked):
        # The usual approach: collect the evictable leaves and heapify them on every call.
        out, stack = [], [self.root]
        while stack:
            n = stack.pop()
            kids = list(n.kids())
            stack.extend(kids)
            if n is self.root or n.lock or n.parked != parked:
                continue
            if parked and not kids or not parked and not any(not k.parked for k in kids):
                out.append((n.stamp, -n.end, id(n), n))
        heapq.heapify(out)
        return out

    def _drop(self, n):
        if n.parked:
            self.host_free.extend(n.pages)
            self.num_dropped_parked += 1
        else:
            for k in list(n.kids()):  # only parked children can remain under a drop candidate
                self._drop(k)
            self.free_pages.extend(n.pages)
            self.num_dropped_resident += 1
        self._remove(n)

    def make_room(self, pages, park=True):
        taken = []
        if len(self.free_pages) >= pages:
            return taken
        heap = self._candidates(parked=False)
        while len(self.free_pages) < pages and heap:
            _, _, _, x = heapq.heappop(heap)
            parked = None
            if park and self.host_capacity and len(x.pages) <= self.host_capacity:
                parked_heap = None
                while len(self.host_free) < len(x.pages):
                    parked_heap = parked_heap or self._candidates(parked=True)
                    if not parked_heap:
                        break
                    y = heapq.heappop(parked_heap)[3]
                    parent = y.parent
                    self._drop(y)
                    taken.append(("dropped", True))
                    if parent.parked and not parent.lock and not parent.children:
                        heapq.heappush(parked_heap, (parent.stamp, -parent.end, id(parent), parent))
                if len(self.host_free) >= len(x.pages):
                    n = len(x.pages)
                    host = self.host_free[-n:] if n else []
                    del self.host_free[len(self.host_free) - n :]
                    self.free_pages.extend(x.pages)
                    x.pages, x.parked = host, True
                    self.num_parked += 1
                    parked = True
                    taken.append(("parked", x))
            if not parked:
                self._drop(x)
                taken.append(("dropped", False))
            p = x.parent
            if (
                p is not self.root
                and not p.parked
                and not p.lock
                and not any(not k.parked for k in p.kids())
            ):
                heapq.heappush(heap, (p.stamp, -p.end, id(p), p))
        return taken

    def wake(self, node):
        chain = []
        while node is not self.root:
            if node.parked:
                chain.append(node)
            node = node.parent
        need = sum(len(n.pages) for n in chain)
        if need > len(self.free_pages):
            raise PoolFull(f"needed {need}, only {len(self.free_pages)} available")
        for n in reversed(chain):
            self.host_free.extend(n.pages)
            n.pages, n.parked = self.alloc_pages(len(n.pages)), False
            self.num_woken += 1

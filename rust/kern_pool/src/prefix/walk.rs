//! The walks: where a lookup of a key goes (`walk`: the longest path, or a snapshot detour off
//! it), what it reads (`read`), and the verbs built on them, `match_prefix*` (split, refresh,
//! lock) and `peek` (change nothing). Insert takes `walk_longest`, the match's own longest
//! path, so the tree holds afterwards what a later match reads.

use super::node::Kids;
use super::prefetch::{prefetch, prefetch_span, PREFETCH_BYTES};
use super::{Match, Prefix, StateHit, Tier, ROOT};
use crate::ids::{PageId, SlotId};

/// What a lookup passes through: the nodes entered, every one matched whole except perhaps the
/// last, of which `cover` tokens are matched; and the hit length.
pub(super) struct Walk {
    pub(super) path: Vec<u32>,
    pub(super) cover: usize,
    pub(super) hit: usize,
}

/// Length of the common prefix: a memory compare when the runs agree, which they mostly do.
fn lcp(a: &[u32], b: &[u32]) -> usize {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    if a == b {
        return n;
    }
    let mut i = 0;
    while i + 16 <= n && a[i..i + 16] == b[i..i + 16] {
        i += 16;
    }
    while i < n && a[i] == b[i] {
        i += 1;
    }
    i
}

impl Prefix {
    /// Where a lookup of `tokens` goes: the longest path, unless a state snapshot deeper than
    /// any on it sits on a shorter child off it (see `snapshot_detour`). Read-only.
    fn walk(&self, tokens: &[u32]) -> Walk {
        let w = self.walk_longest(tokens);
        if self.stats.resident_states + self.stats.parked_states == 0 {
            return w;
        }
        self.snapshot_detour(tokens, w)
    }

    /// A recurrent model resumes only at a snapshot. A prompt that ended mid-page leaves its
    /// snapshot on a child shorter than a page; the next turn through it is inserted as a
    /// sibling of whole pages (a node never ends mid-page above a child), which the longest
    /// path then takes, past the snapshot. Where such a short child of a node the walk passed
    /// whole is a prefix of the key and holds a snapshot deeper than any on the walk's path,
    /// the walk ends in that child instead.
    fn snapshot_detour(&self, tokens: &[u32], w: Walk) -> Walk {
        let pt = self.page_tokens as usize;
        let deepest = w
            .path
            .iter()
            .map(|&i| &self.nodes[i as usize])
            .filter(|n| n.snapshot.is_some() && n.end() as usize <= w.hit)
            .map(|n| n.end() as usize)
            .max()
            .unwrap_or(0);
        // (how many path nodes precede it, the child, its end)
        let mut best: Option<(usize, u32, usize)> = None;
        let (mut parent, mut at) = (ROOT, 0usize);
        for k in 0..=w.path.len() {
            let p = &self.nodes[parent as usize];
            if p.num_partial > 0 {
                let rest = &tokens[at..];
                for &c in p.kids.iter() {
                    let cn = &self.nodes[c as usize];
                    let t = &cn.tokens;
                    let end = at + t.len();
                    if cn.snapshot.is_some()
                        && t.len() < pt
                        && t.len() <= rest.len()
                        && end > best.map_or(deepest, |b| b.2)
                        && rest[..t.len()] == t[..]
                    {
                        best = Some((k, c, end));
                    }
                }
            }
            let Some(&next) = w.path.get(k) else { break };
            let end = self.nodes[next as usize].end() as usize;
            if end > w.hit || !end.is_multiple_of(pt) {
                break;
            }
            (parent, at) = (next, end);
        }
        match best {
            Some((k, c, end)) => {
                let mut path = w.path[..k].to_vec();
                path.push(c);
                Walk {
                    path,
                    cover: self.nodes[c as usize].tokens.len(),
                    hit: end,
                }
            }
            None => w,
        }
    }

    /// The longest cached path of `tokens`. Read-only.
    pub(super) fn walk_longest(&self, tokens: &[u32]) -> Walk {
        let pt = self.page_tokens as usize;
        let mut w = Walk {
            path: Vec::new(),
            cover: 0,
            hit: 0,
        };
        let mut node = ROOT;
        loop {
            let rest = &tokens[w.hit..];
            if rest.len() >= pt {
                if let Some(c) = self.find_full(node, &rest[..pt]) {
                    let cn = &self.nodes[c as usize];
                    let t = &cn.tokens;
                    prefetch_span(t, PREFETCH_BYTES);
                    // `read` copies its pages next, if the walk ends here or deeper.
                    prefetch_span(&cn.pages, 256);
                    // The next step reads one of these children (asked for one step ago): ask
                    // for the head of its tokens and for its own children during the compare.
                    if let Kids::Few(k, ids) = &cn.kids {
                        for &g in &ids[..*k as usize] {
                            let gn = &self.nodes[g as usize];
                            // Its second line (stamp, pages, locks) is read if the walk goes on.
                            prefetch(&gn.pages);
                            prefetch_span(&gn.tokens, 256);
                            if let Kids::Few(k, ids) = &gn.kids {
                                for &h in &ids[..*k as usize] {
                                    prefetch(&self.nodes[h as usize]);
                                }
                            }
                        }
                    }
                    let l = lcp(t, rest);
                    w.path.push(c);
                    if l == t.len() {
                        w.hit += l;
                        w.cover = l;
                        if !l.is_multiple_of(pt) {
                            return w;
                        }
                        node = c;
                        continue;
                    }
                    // Matched in part: up to the last whole page it read, or to the key's end
                    // inside a page.
                    w.cover = if l == rest.len() { l } else { l / pt * pt };
                    w.hit += w.cover;
                    return w;
                }
            }
            if let Some((c, l)) = self.find_short(node, rest) {
                w.path.push(c);
                w.cover = l;
                w.hit += l;
            }
            return w;
        }
    }

    /// The `Match` of a walk's path (after any split), its pages in `pages` (cleared first).
    fn read(&self, path: &[u32], hit: u32, mut pages: Vec<PageId>) -> Match {
        pages.clear();
        pages.reserve(self.pages_for(hit) as usize);
        let mut m = Match {
            hit_len: hit,
            resident_len: 0,
            node: None,
            pages,
            state: None,
        };
        let mut resident = true;
        for &i in path {
            let n = &self.nodes[i as usize];
            let end = n.end().min(hit);
            if resident && n.tier == Tier::Resident {
                let k = self.pages_for(end - n.start) as usize;
                m.pages.extend(n.pages[..k].iter().map(|&p| PageId(p)));
                m.resident_len = end;
            } else {
                resident = false;
            }
            if n.end() <= hit {
                if let Some(s) = n.snapshot {
                    let slot = (n.tier == Tier::Resident).then_some(SlotId(s));
                    m.state = Some(StateHit { len: n.end(), slot });
                }
            }
        }
        m.node = path.last().map(|&i| self.handle(i));
        m
    }

    /// Longest cached prefix of `tokens`, locked. Splits the node the hit ends inside right
    /// after the last page the hit read, unless it is parked, then refreshes and locks the
    /// hit's path only: release the lock with `unlock(m.node)`.
    #[cfg(test)]
    pub fn match_prefix(&mut self, tokens: &[u32]) -> Match {
        self.match_prefix_with(tokens, Vec::new())
    }

    /// `match_prefix` with the page list written into `pages` (cleared first): a caller that
    /// matches often reuses one buffer.
    pub fn match_prefix_with(&mut self, tokens: &[u32], pages: Vec<PageId>) -> Match {
        let w = self.walk(tokens);
        let mut path = w.path;
        if let Some(last) = path.last_mut() {
            let n = &self.nodes[*last as usize];
            let at = w.cover.div_ceil(self.page_tokens as usize) * self.page_tokens as usize;
            if at < n.tokens.len() && n.tier == Tier::Resident {
                *last = self.split(*last, at);
            }
        }
        if let Some(&last) = path.last() {
            self.lock_index(last);
            self.touch_up(last);
        }
        self.read(&path, w.hit as u32, pages)
    }

    /// What `match_prefix` would return, changing nothing (no split, no refresh, no lock):
    /// `node` is then the deepest node the hit reaches, perhaps past the hit.
    pub fn peek(&self, tokens: &[u32]) -> Match {
        let w = self.walk(tokens);
        self.read(&w.path, w.hit as u32, Vec::new())
    }
}

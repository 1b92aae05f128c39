//! Changes to the tree's shape: allocating a node, linking and unlinking a child, splitting a
//! node at a page boundary, removing a leaf. Linking, splitting and removing keep the children
//! index, the LRU sets and the node count in step, so no caller has to.

use super::node::{Kids, Node};
use super::{Prefix, Tier};

impl Prefix {
    pub(super) fn alloc_node(&mut self, node: Node) -> u32 {
        match self.free_nodes.pop() {
            Some(i) => {
                let generation = self.nodes[i as usize].generation.wrapping_add(1);
                self.nodes[i as usize] = Node { generation, ..node };
                i
            }
            None => {
                self.nodes.push(node);
                (self.nodes.len() - 1) as u32
            }
        }
    }

    pub(super) fn add_child(&mut self, parent: u32, child: u32) {
        let pos = self.nodes[parent as usize].kids.len() as u32;
        let (full, resident) = {
            let c = &mut self.nodes[child as usize];
            c.pos = pos;
            (
                c.tokens.len() >= self.page_tokens as usize,
                c.tier == Tier::Resident,
            )
        };
        if full {
            self.index_insert(child);
        }
        self.update(parent, |p| {
            p.kids.push(child);
            p.num_partial += u32::from(!full);
            p.num_resident_children += u32::from(resident);
        });
    }

    fn remove_child(&mut self, parent: u32, child: u32) {
        let (pos, full, resident) = {
            let c = &self.nodes[child as usize];
            (
                c.pos as usize,
                c.tokens.len() >= self.page_tokens as usize,
                c.tier == Tier::Resident,
            )
        };
        if full {
            self.index_remove(child);
        }
        self.unlink(parent);
        let p = &mut self.nodes[parent as usize];
        p.kids.swap_remove(pos);
        let moved = p.kids.get(pos).copied();
        p.num_partial -= u32::from(!full);
        p.num_resident_children -= u32::from(resident);
        if let Some(m) = moved {
            self.nodes[m as usize].pos = pos as u32;
        }
        self.relink(parent);
    }

    /// Split `c` at `at` tokens into its own parent (`at` page-aligned, inside `c`). The new
    /// node takes the first part and `c` keeps its handle, its children, its snapshot and its
    /// own locks, so a lock taken on `c` still covers both halves.
    pub(super) fn split(&mut self, c: u32, at: usize) -> u32 {
        let pt = self.page_tokens as usize;
        debug_assert!(at > 0 && at < self.nodes[c as usize].tokens.len());
        debug_assert!(at.is_multiple_of(pt));
        self.unlink(c);
        let n = &mut self.nodes[c as usize];
        let tail_tokens = n.tokens.split_off(at);
        let tail_pages = n.pages.split_off(at / pt);
        let head_tokens = std::mem::replace(&mut n.tokens, tail_tokens);
        let head_pages = std::mem::replace(&mut n.pages, tail_pages);
        let mut top = Node::new(n.parent, n.start, head_tokens, head_pages, None, n.tier);
        top.kids = Kids::one(c);
        top.pos = n.pos;
        top.num_resident_children = u32::from(n.tier == Tier::Resident);
        top.lock = n.lock;
        top.stamp = n.stamp;
        let parent = n.parent;
        let pos = n.pos;
        n.start += at as u32;
        n.pos = 0;
        let top = self.alloc_node(top);
        // `c` had a page or more, so it was in the index; `top` has the same first page.
        self.index_replace(c, top);
        self.nodes[parent as usize].kids[pos as usize] = top;
        self.nodes[c as usize].parent = top;
        if self.nodes[c as usize].tokens.len() >= pt {
            self.index_insert(c);
        } else {
            self.nodes[top as usize].num_partial += 1;
        }
        self.stats.num_nodes += 1;
        self.relink(c);
        self.relink(top);
        top
    }

    /// Remove a node without children.
    pub(super) fn remove_node(&mut self, i: u32) {
        debug_assert!(self.nodes[i as usize].kids.is_empty());
        let parent = self.nodes[i as usize].parent;
        self.unlink(i);
        self.remove_child(parent, i);
        let n = &mut self.nodes[i as usize];
        n.live = false;
        n.tokens = Vec::new();
        n.pages = Vec::new();
        n.kids = Kids::new();
        n.num_partial = 0;
        self.free_nodes.push(i);
        self.stats.num_nodes -= 1;
    }
}

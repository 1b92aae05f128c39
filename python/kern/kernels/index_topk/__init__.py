"""index_topk: `reference` (torch) and `index_topk` (Triton) submodules; see README.md."""

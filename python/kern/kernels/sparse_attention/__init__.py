"""sparse_attention: `reference` (torch) and `sparse_attention` (Triton) submodules; see
README.md."""

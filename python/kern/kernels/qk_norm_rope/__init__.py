"""qk_norm_rope: `reference` (torch only) and `qk_norm_rope` (Triton) submodules; see README.md."""

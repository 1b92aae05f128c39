"""mla_attention: `reference` (torch) and `mla_attention` (Triton) submodules; see README.md."""

"""compressor_pool: `reference` (torch) and `compressor_pool` (Triton) submodules; see
README.md."""

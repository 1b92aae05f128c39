"""silu_and_mul: `reference` (torch only) and `silu_and_mul` (Triton) submodules; see README.md."""

"""rotary: `reference` (torch only) and `rotary` (Triton) submodules; see README.md."""

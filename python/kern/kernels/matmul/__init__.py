"""matmul: `reference` (torch only) and `matmul` (Triton) submodules; see README.md."""

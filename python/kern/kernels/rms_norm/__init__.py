"""rms_norm: `reference` (torch only) and `rms_norm` (Triton) submodules; see README.md."""

"""paged_attention: `reference` (torch only) and `paged_attention` (Triton) submodules.

See README.md for the formula and tensor layouts.
"""

"""causal_conv1d: `reference` (torch only) and `causal_conv1d` (Triton) submodules.

See README.md for the formula and tensor layouts.
"""

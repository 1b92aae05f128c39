"""gated_delta_rule: `reference` (torch only) and `gated_delta_rule` (Triton) submodules.

See README.md for the formula and tensor layouts.
"""

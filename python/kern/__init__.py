"""kern: an LLM inference server whose served greedy answers match an offline run byte for byte."""

__version__ = "0.1.0"

"""Tiny random-weight checkpoints of every family, deterministic from a seed.

``make_tiny("qwen3", DIR)`` writes a complete Hugging Face folder — ``config.json``,
``generation_config.json``, ``model.safetensors`` (or shards and an index), ``tokenizer.json``,
``tokenizer_config.json`` with a Qwen chat template — that both kern and ``transformers`` load,
so the runner can be tested against the oracle with no network and no download.

Design notes
------------
* Bit-identical output for the same arguments, on any machine: every file is written from
  sorted, fixed data. Each tensor has its own ``torch.Generator`` seeded from a hash of
  (seed, tensor name), so adding a layer does not change the tensors of the others; the BPE
  merges are learned with an explicit tie-break (``kern.tiny.tokenizer``).
* Weights are not transformers' init. Its N(0, 0.02) gives this 64-wide model logits with a
  standard deviation of 0.17, so greedy picks hang on small gaps, and changing the six tokens
  before the last moved the last logits by at most 0.58. Here matrices are N(0, 1/fan_in) and
  the (untied) embedding N(0, 1): logit std 1.07, and the same context change moves them by
  2.8, so a runner with broken attention or positions cannot pass an oracle test by luck
  (greedy text changes token from step to step, see tests/test_tiny.py). A tied embedding is
  scaled down (see ``_weights``). Norm weights are their neutral value (1, or 0 for Qwen3.5's
  zero-centered RMSNorm, which scales by 1 + w) plus N(0, 0.1), so a runner that gets the
  offset wrong is caught. Qwen3.5's decay parameters keep the recurrent state alive for a few
  tokens (A in [0.05, 1]), so a runner that drops or mixes up states is caught too.
* The tokenizer's notes are in ``kern.tiny.tokenizer``; the weights' and the folder's in
  ``kern.tiny.model``; each family's sizes and config.json in its tiny writer
  (``kern.models.<family>.tiny``).
"""

from kern.assets import default_model_path
from kern.tiny.model import DEFAULT_MODEL_ARGS, make_tiny
from kern.tiny.tokenizer import SPECIAL_TOKENS

__all__ = ["DEFAULT_MODEL_ARGS", "SPECIAL_TOKENS", "default_model_path", "make_tiny"]

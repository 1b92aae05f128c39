"""A tiny gpt_oss checkpoint whose answer is scripted, for serving harmony over real HTTP.

How it works (tests/support/scripted_model.py's Markov chain, on gpt_oss): every layer's
``o_proj`` and the experts' ``down_proj`` are zero, biases too, so the residual stream at a
position is the current token's embedding; the final norm turns it into a one-hot the LM
head maps to the token that must follow. ``assistant`` is one added token, the last of every
harmony generation prompt (``<|start|>assistant``), and each piece of the script is one added
token after it, the last followed by an end id (``<|return|>`` or ``<|call|>``). Pieces may
spell harmony's markers: they are plain added tokens, decoded to that text, which is what
kern's harmony parser reads.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer

from kern.tiny import make_tiny
from support.scripted_model import chain_weights

__all__ = ["make_scripted_harmony"]

START_TOKEN = "assistant"


def make_scripted_harmony(out: Path, pieces: list[str], end: str) -> Path:
    """Write to ``out`` a gpt_oss that answers ``pieces`` (one token each) then ``end``."""
    make_tiny("gpt_oss", out, yarn_factor=0)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    plain = [START_TOKEN, *pieces]
    tok.add_tokens([AddedToken(p, special=False, normalized=False) for p in plain])
    ids = {t: tok.token_to_id(t) for t in [*plain, end]}
    assert len(set(ids.values())) == len(ids), ids
    vocab = -(-tok.get_vocab_size(with_added_tokens=True) // 64) * 64
    (out / "tokenizer.json").write_text(tok.to_str(pretty=True) + "\n", encoding="utf-8")
    config = json.loads((out / "tokenizer_config.json").read_text())
    flags = {"lstrip": False, "normalized": False, "rstrip": False, "single_word": False}
    for text in plain:
        entry = {"content": text, **flags, "special": False}
        config["added_tokens_decoder"][str(ids[text])] = entry
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    model = json.loads((out / "config.json").read_text())
    model["vocab_size"] = vocab
    (out / "config.json").write_text(json.dumps(model, indent=2) + "\n")

    chain = list(zip(plain, [*pieces, end], strict=True))
    zeroed = ("o_proj.weight", "o_proj.bias", "experts.down_proj", "down_proj_bias")
    chain_weights(out, ids, chain, end, vocab, zeroed)
    return out

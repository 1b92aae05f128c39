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

from safetensors.torch import load_file, save_file
from tokenizers import AddedToken, Tokenizer

from kern.tiny import make_tiny

__all__ = ["MARGIN", "make_scripted_harmony"]

MARGIN = 20.0
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
    tensors = load_file(str(out / "model.safetensors"))
    hidden = model["hidden_size"]
    embed = tensors["model.embed_tokens.weight"][:0].new_zeros(vocab, hidden)
    head = embed.clone()
    embed[:, 0] = 1.0  # every token the script does not name: its successor is the end
    head[ids[end], 0] = MARGIN
    for k, (token, following) in enumerate(chain, start=1):
        embed[ids[token]] = 0.0
        embed[ids[token], k] = 1.0
        head[ids[following], k] = MARGIN
    tensors["model.embed_tokens.weight"] = embed.contiguous()
    tensors["lm_head.weight"] = head.contiguous()
    tensors["model.norm.weight"] = tensors["model.norm.weight"].new_ones(hidden)
    for name in list(tensors):
        if name.endswith(("o_proj.weight", "o_proj.bias", "experts.down_proj", "down_proj_bias")):
            tensors[name] = tensors[name].new_zeros(tensors[name].shape)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out

"""What a request asks of the sampler, as plain values: its sampling parameters, what logits
processing needs of a row (:class:`Context`), and how a row of a step's logits becomes a token
(:class:`Pick`). Torch-free: the scheduler builds these and the runner side
(:class:`kern.engine.sampler.Sampler`) turns them into ids and logprobs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kern.engine.token_log import TokenLog

__all__ = ["GREEDY", "Context", "LogprobEntry", "Pick", "SamplingParams"]

# The chosen token's logprob and the top ones as (token id, logprob), most likely first.
LogprobEntry = tuple[float, list[tuple[int, float]]]


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """temperature 0 is greedy; top_k 0 and top_p 1 disable those filters; seed None draws
    a fresh random seed for every token."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # (token id, bias) pairs.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # Only these ids may be sampled (every other logit set to -inf); None: any.
    allowed_token_ids: frozenset[int] | None = None

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not self.repetition_penalty > 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise ValueError("allowed_token_ids must not be empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def processes(self) -> bool:
        """Whether the logits change before the choice (penalties, a bias or allowed ids)."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or self.allowed_token_ids is not None
        )


@dataclass(frozen=True, slots=True)
class Context:
    """What logits processing needs of a row's request: its tokens so far (prompt, then
    output) and how many are prompt; ids it may not produce at this step."""

    tokens: Sequence[int]
    num_prompt: int
    banned: frozenset[int] = frozenset()
    # A structured-output matcher (kern.engine.masks.Matcher): masks the row's logits [1, V].
    grammar: Any = None
    # The request's tokens as a tensor, kept across steps (converting a whole context to a
    # tensor every step cost ~10 us per 160 tokens per row); None: converted here.
    log: TokenLog | None = None

    @property
    def masks(self) -> bool:
        return bool(self.banned) or self.grammar is not None


GREEDY = SamplingParams()


@dataclass(frozen=True, slots=True)
class Pick:
    """How one row of a step's logits becomes a token: ``params`` as the ``draw_id``-th token
    its request produces, processed with ``context`` (None: no processing), with the top
    ``num_logprobs`` logprobs when not None. ``owner`` (the request) keys the token log the
    penalties keep across steps on the runner side; None: the context is converted whole."""

    params: SamplingParams
    draw_id: int
    context: Context | None = None
    num_logprobs: int | None = None
    owner: object | None = None

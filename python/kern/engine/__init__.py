"""The engine: what turns submitted requests into tokens.

Nothing is imported here on purpose: importing one module of the package (the request, the
scheduler) must not pull in torch through the others. The scheduler's side (``request``,
``params``, ``scheduler``, ``memory``, ``drafters`` and ``drafters.ngram``) is torch-free; the
runner's side (``runner``, ``arena``, ``layout``, ``sampler``, ``structured``, the drafters that
run a model) owns every tensor.

Design notes
------------
* One step is three phases (nano-vllm's shape): the scheduler plans it (admits what fits,
  cuts each running request's next chunk under the step's token budget, asks the drafter for
  drafts), the runner side runs it (``Sampler.forward``: one ``Runner.forward`` over the
  batch, then a token and its logprobs for every logits row, returned as Python values), and
  the scheduler post-processes (moves ``num_computed``, shares prefill pages, judges drafts
  with ``drafters.accept``, emits the step's events, finishes what stopped).
* Continuous batching: each step is one forward over every running request, decode rows
  first (one token each), then prefill chunks under a per-step token budget
  (``max_step_tokens``). A request joins or leaves between any two steps.
* One code path for prefill, decode and resume. A request is its tokens (prompt, then what it
  produced) and ``num_computed``, how many of them are in its KV. Each step computes the next
  chunk of ``tokens[num_computed:]``; a chunk that reaches the end asks for logits and yields a
  token. Decoding is a chunk of one. The same shapes ``kern.engine.generate`` runs, so a greedy
  answer is the same bits as ``kern run`` on the CPU backend (batch- and chunk-invariant, see
  docs/invariance.md).
* Modules: ``request`` (what the app submits), ``scheduler`` (loop, admission, planning,
  preemption), ``thread`` (the scheduler's thread), ``memory`` (the only caller of
  ``kern.pool``), ``drafters`` (the drafter protocol, the accept rule, one module per drafter
  and the factory that picks one), ``load`` (``Engine``: checkpoint, arenas, books, runner,
  drafter), ``runner`` and ``sampler`` (the tensors; the page kind, ``kern.models.pages``, is
  the runner's), ``generate`` (``kern run``: one sequence, the same rules and drafters).
"""

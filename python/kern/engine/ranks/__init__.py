"""Ranks: the processes kern starts for a target with ``ranks = N``, the one broadcast per
runner call that keeps them in step, and the watchdog that ends them all when one fails.

Nothing is imported here on purpose: ``python -m kern.engine.ranks`` and the loader import the
modules they need (``launch``: rank 0's launcher and watchdog; ``runner``: the broadcast
runner; ``worker``: ranks 1 .. N-1; ``shard``: what each rank reads and the collectives).

Design notes
------------
* Rank 0 is the process the user started (``kern serve``, ``hypercorn kern.app:app``,
  ``kern run``): it runs the app, the scheduler and the cache's books, and starts ranks
  1 .. N-1 itself (``python -m kern.engine.ranks``; on other machines a user starts them, see
  docs/serve.md). They join through ``torch.distributed``: a TCPStore that rank 0 serves
  (where it puts its target first, so a rank needs nothing else to know what to load), a
  process group for the model's collectives (NCCL on CUDA, gloo on the CPU) and a gloo
  group for the control messages.
* One scheduler, many ranks: rank 0's runner is a ``RankedRunner`` (``runner``). Each call
  the scheduler makes (``forward``, ``park``, ``wake``, ``copy_pages``, ``copy_slots``,
  ``keep_rows``) is broadcast once (``broadcast_object_list`` on the control group: the
  batch of ``SeqChunk`` values and the plans as bytes), then every rank runs the same method
  on its own runner, over its shard of the weights and of the arena. Every rank's arena has
  the same placement (rank 0's pool books, sent once at start), so page and slot ids mean the
  same everywhere and one plan lands on every rank. The broadcast's time is counted
  (``broadcast_seconds``) and reported by the benchmark.
* Loading: the engine's one recipe (``kern.engine.load.Engine.load``) asks ``Ranks.start``
  for the ranks and ``Ranks.runner`` for rank 0's runner; every rank reads only its slices
  (``shard.load_shard``); the progress bar is rank 0's. The engine is ready when every rank
  has built its runner (a barrier).
* Faults (the bound is ``HANG_S`` + ``BEAT_S``, about 11 s; a death is seen within
  ``BEAT_S``): every rank but 0 adds to its counter in the store every ``BEAT_S``
  from a thread of its own, whatever its main thread is doing (loading, in a collective,
  idle; a rank gets ``START_S`` for its first one, while it imports torch). Rank 0's
  watchdog thread reads the counters and polls the processes it started; a
  rank that exited, or whose counter has not moved for ``HANG_S`` (a stopped or hung
  process: SIGSTOP stops all its threads), ends the whole server: one line naming the rank
  on stderr, every other rank killed, exit code ``EXIT_CODE`` (the app's crash code),
  which closes the listening socket. A collective that fails on rank 0 (gloo reports a
  peer's closed connection) waits for the watchdog to name the rank before it re-raises.
  The process groups' own timeouts are long on purpose: a rank waits in the control
  broadcast for as long as the server is idle, and liveness is the watchdog's business.
  Ranks other than 0 end when rank 0 does: the kernel kills them (``PR_SET_PDEATHSIG``)
  when it was their parent, and their heartbeat fails when the store (in rank 0) is gone.
"""

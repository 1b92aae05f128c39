"""The HTTP server under the ASGI entry ``kern.app:app`` (the transport): ``http`` (the ASGI
types and response helpers, a leaf), ``settings``, ``openai`` (the handlers of a loaded
model), ``prompts`` (a prompt as token ids), ``responses`` (a generation's events rendered as
a whole answer or a stream, completions and chat), ``text`` (a choice's text), ``api`` (the
wire types), ``splitter`` (reasoning and tool calls, in the target's chat formats of
kern.chat_formats), ``logs``, ``cors`` (browser clients), ``startup`` (how a failed start ends
the process), ``drain`` (``kern serve``'s shutdown), and the agent protocols, each translated
into a chat request and rendered by its own run: ``anthropic_messages`` / ``anthropic_run``
(Anthropic's Messages API) and ``openai_responses`` / ``openai_responses_run`` (OpenAI's
Responses API, the types both name in ``openai_responses_types``).

Nothing is imported here on purpose: each module is imported by name.

Design notes
------------
* No web framework: a dict of routes, msgspec for every body (kern.server.api), and the scheduler
  behind a queue. The handlers tokenize, validate against the limits, and turn the scheduler's
  token events into text; the scheduler only ever sees ints.
* Configuration comes from the environment so ``hypercorn kern.app:app`` works as well as
  ``kern serve`` (which passes the same settings from its flags): ``KERN_CONFIG`` +
  ``KERN_TARGET`` name a kern.toml target, else the embedded tiny model is served;
  ``KERN_API_KEY`` guards every route but ``/health``; ``KERN_MAX_BODY_BYTES`` bounds a
  request body; docs/serve.md lists
  every variable (``KERN_MAX_MODEL_LEN``, ``KERN_CHAT_TEMPLATE``, ``KERN_SERVED_MODEL_NAME``,
  ``KERN_ALLOWED_ORIGINS``, ...).
* Hang-ups: hypercorn speaks ASGI 2.1 and its ``send()`` keeps succeeding after a client has
  gone (seen with hypercorn 0.18: ``send()`` kept succeeding for 3 s after a hang-up while
  ``receive()`` returned ``http.disconnect`` at once). So every generating handler runs a
  watcher on ``receive()`` beside it; on ``http.disconnect`` it aborts the request's
  sequences (the scheduler frees them at its next step) and wakes the handler, queued or
  streaming alike.
* Events cross from the scheduler thread once per step (``call_soon_threadsafe``), and a
  handler drains everything queued before it writes, so a busy stream sends a few tokens per
  write instead of one write per token.
* Stop strings are the server's: the text is matched as it is detokenized, the request is
  aborted the moment one appears, and the choice ends with ``stop``; text that may begin a stop
  string is held back until it cannot.
* A crash of the scheduler thread ends every open request with ``abort``, prints the error and
  exits the process with code 101 (after a moment, so those ends reach the clients).
* Loading is ``App.start``: ``kern serve`` calls it before it serves (so a user's mistake
  is one line and exit 2, and the start-up line can describe what loaded); under plain
  hypercorn the lifespan startup calls it, and a failure there ends the process the same way
  (one line, exit 2; kern.server.startup). The handlers are built from what it loaded.
* Shutdown: ``kern serve`` drains on SIGTERM/SIGINT (``drain``): new requests get a 503
  with ``Retry-After``, those in flight finish within ``--shutdown-timeout``, and what is left
  then ends with ``abort`` (a stream's last chunk, or a whole answer so far). The lifespan
  shutdown ends whatever is still open the same way (``App.drain``).
* A hang-up costs a bounded number of steps whatever the load: the scheduler runs at most
  two steps ahead of the event loop (``hangup``).
* A request whose body is framed two ways is a 400 before anything reads it
  (``request_head``).
* Every HTTP request carries an id, ``X-Request-Id`` from the client or made here, echoed in
  the response and in the one log line a generation request ends with (kern.server.logs). A stats
  line is logged every ``stats_interval`` seconds while there is work.
"""

"""The HTTP server under the ASGI entry ``kern.app:app`` (the transport): ``http`` (the ASGI
types and response helpers, a leaf), ``settings``, ``openai`` (the handlers of a loaded
model), ``prompts`` (a prompt as token ids), ``responses`` (a generation's events rendered as
a whole answer or a stream, completions and chat), ``text`` (a choice's text), ``api`` (the
wire types), ``splitter`` (reasoning and tool calls), ``logs``, ``cors`` (browser clients),
``startup`` (how a failed start ends the process), and the agent protocols, each translated
into a chat request and rendered by its own run: ``anthropic_messages`` / ``anthropic_run``
(Anthropic's Messages API) and ``openai_responses`` / ``openai_responses_run`` (OpenAI's
Responses API).

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
* Shutdown is ``App.drain``, on the event loop: no new request is admitted (503), every
  open stream gets a final ``abort`` chunk and ``[DONE]``, and every request still waiting
  for a whole answer gets a 503 in the error shape. ``kern serve`` drains on SIGTERM/SIGINT
  before hypercorn closes the connections; the lifespan shutdown drains as well.
* Every HTTP request carries an id, ``X-Request-Id`` from the client or made here, echoed in
  the response and in the one log line a generation request ends with (kern.server.logs). A stats
  line is logged every ``stats_interval`` seconds while there is work.
"""

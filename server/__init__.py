"""mlx-lane's server: the HTTP doors, what they share, the generation lane, and the engine that runs the model.

A request flows down the rooms and its events flow back up; imports point the same way (http -> core -> lane <-
engine; the process wiring above them all; server -> cache, models, spec, never back)::

    cli.py, serve.py     process wiring: flags (every one read once, in cli.py), assembly of model + cache + lane +
                         app, uvicorn, shutdown
    catalog.py           what the server serves: model names, --model-alias patterns, LoRA adapters
    pool/                the on-demand models (--model NAME=PATH, --models-dir): residency policy, loads, leases
    startup/             the start-up timeline (/stats startup) and the opt-in kernel warmers beside it (warmers.py
                         starts and watches them; warmer.py is one warmer's process)
    stats.py             serving counters (/stats, /metrics); errors.py: the APIError hierarchy; sizes.py
                         (byte sizes and the device's defaults); memory.py (the admission budget's assembly);
                         device_memory.py (a CUDA card's memory as the driver counts it)

    http/                the doors and the app around them
      app.py             the FastAPI app: state, routes, lifespan, error mapping
      guard.py           what may reach a route (Host / Origin / CORS, API key, body size)
      target.py          a request's model name, resolved once into the Target that computes it
      pipeline.py        run(door, request): parse -> target -> internal request -> stream or collect, every door
      chat/              OpenAI chat completions + text completions: door, schemas, format
      responses/         OpenAI Responses: door, schemas, translate (<-> internal request), format, store
      messages/          Anthropic Messages: door, schemas, translate, format
      embeddings.py, admin.py, info.py (/health /v1/models /stats /metrics), metrics.py, dashboard.py,
      wire.py (JSON bodies, SSE framing, request ids, sessions), error_shapes.py (OpenAI's or Anthropic's)

    core/                what every door shares
      request.py         the internal request (GenerationRequest): no wire types below this line
      context.py         what the core may use of the running server (CoreContext), not the whole ServerState
      prompts.py         chat template / raw prompt -> token ids; lengths and sampling -> SamplingParams
      token_cache.py     a rendered chat prompt tokenized from the pieces earlier prompts tokenized (exact)
      grammar.py         constrained decoding (llguidance): response_format, forced and strict tool calls
      output_parse.py    a reply -> text, reasoning and tool calls, per model family (mlx-lm's parsers)
      generation.py      one request's generation: submit, events (text, reasoning, done, error), collect
      bridge.py          the lane's thread -> the event loop: one sequence's events, disconnect = cancel

    lane/                the one thread that owns model compute, and its policy
      sequence.py        a request on the lane: one object, one lifecycle (Phase), FinishReason
      target.py          which model computes a request (Target: slot, adapter, lease), resolved once at the door
      seam.py            the LaneEngine protocol the executor calls, and the records it returns
      scheduler.py       schedule(waiting, running) -> TickPlan: every per-tick decision
      plan.py            the TickPlan record (and its wire form for sharded replay)
      executor.py        runs a plan through the LaneEngine, writes what comes back into the sequences
      lane.py            the thread: inbox, control (drain, abort, stop), tasks
      warm.py            the warm-up's steps, run before ready or behind the requests while the lane is idle
      budget.py          admission by memory; events.py: SamplingParams and the events a sequence sends
      stops.py           stop strings; replay.py: rank 0 broadcasts plans, followers execute them

    engine/              the mechanism: the LaneEngine's verbs (lane thread only)
      engine.py          the facade: classify, admit (cache take), and the rooms below
      work.py            the engine's own per-sequence record (caches, sampler, rules, where it decodes)
      prefill.py         prompt chunks, one forward or one batched forward; what a completed prompt stores
      decode.py          every decoding sequence is a row of a Batch: joins, leaves, steps, the solo batches
      store.py           what a sequence puts in the prefix cache
      warmup.py          the warm-up's steps (page in, compile); slot.py: one loaded model's facts
      batch/             ONE Batch protocol (protocol.py) and its kinds: solo.py (mlx-lm's generate_step or the
                         speculative walk), mlx.py (mlx-lm's GenerationBatch), ragged.py over ragged_kv.py (rows in
                         free slots, no copies), speculating.py (drafts verified together; drafts.py batches the
                         draft model); choose.py picks a kind from declared facts; rules.py: the logits rules every
                         kind applies
      sampling.py        samplers; kv_layout.py (quantized KV, bytes per token); speculation.py; distributed.py

The prefix cache itself lives in ``cache/`` (one prefix rule in cache.prefix, one protocol in cache.protocol), model
loading, quantization and the attention kernels in ``models/`` (models.attention: the CPU and CUDA paths and the
shared-prefix layout they read), speculative decoding's drafting, accept walk and verification in ``spec/``.
"""

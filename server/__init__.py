"""mlx-lane's server: the HTTP doors, what they share, the generation lane, and the engine that runs the model.

A request flows down the rooms and its events flow back up; imports point the same way (http -> core -> lane <-
engine; the process wiring above them all; server -> cache, models, spec, never back)::

    cli.py, serve.py     process wiring: flags, assembly of model + cache + lane + app, uvicorn, shutdown
    catalog.py           what the server serves: model names, --model-alias patterns, LoRA adapters
    pool/                the on-demand models (--model NAME=PATH, --models-dir): residency policy, loads, leases
    stats.py             serving counters (/stats, /metrics); errors.py: the APIError hierarchy; sizes.py

    http/                the doors and the app around them
      app.py             the FastAPI app: state, routes, lifespan, error mapping
      guard.py           what may reach a route (Host / Origin / CORS, API key, body size)
      pipeline.py        run(door, request): parse -> internal request -> stream or collect, for every door
      chat/              OpenAI chat completions + text completions: door, schemas, format
      responses/         OpenAI Responses: door, schemas, translate (<-> internal request), format, store
      messages/          Anthropic Messages: door, schemas, translate, format
      embeddings.py, admin.py, info.py (/health /v1/models /stats /metrics), metrics.py, dashboard.py,
      wire.py (JSON bodies, SSE framing, request ids, sessions), error_shapes.py (OpenAI's or Anthropic's)

    core/                what every door shares
      request.py         the internal request (GenerationRequest): no wire types below this line
      prompts.py         chat template / raw prompt -> token ids; lengths and sampling -> SamplingParams
      grammar.py         constrained decoding (llguidance): response_format, forced and strict tool calls
      output_parse.py    a reply -> text, reasoning and tool calls, per model family (mlx-lm's parsers)
      generation.py      one request's generation: submit, events (text, reasoning, done, error), collect
      bridge.py          the lane's thread -> the event loop: one sequence's events, disconnect = cancel

    lane/                the one thread that owns model compute, and its policy
      sequence.py        a request on the lane: one object, one lifecycle (Phase), FinishReason
      scheduler.py       schedule(waiting, running) -> TickPlan: every per-tick decision
      plan.py            the TickPlan record (and its wire form for sharded replay)
      budget.py          admission by memory; lane.py: the tick loop that executes plans
      events.py          SamplingParams and the events a sequence sends (Delta, Finished, ...)
      stops.py           stop strings; replay.py: rank 0 broadcasts plans, followers execute them

    engine/              the mechanism: model verbs that execute a plan (lane thread only)
      engine.py          admit (cache take), prefill, batch joins/leaves, solo steps, finish (cache put)
      batch.py           mlx-lm's GenerationBatch per group; solo.py: plain decode; speculation.py
      ragged_batch.py    the plain batch over ragged_kv.py: joins into a free slot, no forward, no copy (default on
                         the CPU and on CUDA, where models/gpu_attention.py reads each row's own columns)
      spec_batch.py      speculating rows verified together (n-gram), over ragged_kv.py (rows write at their ends)
      slot.py            one loaded model as the engine computes with it (the base, or an on-demand one)
      sampling.py        samplers and logits processors; kv_layout.py; distributed.py (process groups)
      batch_logits.py    a batch's bias / penalties / grammar masks as a few array ops over all its rows

The prefix cache itself lives in ``cache/`` (one prefix rule in cache.prefix, one protocol in cache.protocol), model
loading in ``models/`` (with the attention paths the engine relies on: cpu_attention.py and shared_prefix.py on the
CPU, gpu_attention.py on CUDA), speculative decoding's drafting and verification in ``spec/``.
"""

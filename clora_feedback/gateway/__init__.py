"""The OpenAI-compatible HTTP gateway (FastAPI): agents as models, trajectories captured.

The entry point is `clora_feedback.gateway.app.create_app` (building from
`Settings` and serving is the composition root's, `clora_feedback.service`);
it is not re-exported here so that
importing a light module (e.g. `gateway.errors`) does not
pull in the whole server.

Modules, one concern each:
    errors       the one mapping from errors to OpenAI error JSON
    auth         API keys -> principals
    agents       agent registry, routing of `model`, adapter versions
    generation   n engine requests per prompt, submitted together, merged and accumulated
    serving      what the completion handlers share: routing a request, starting its run
    chat         /v1/chat/completions (templates, tools, typed chunks, SSE)
    completions  /v1/completions (one prompt or a list)
    responses    /v1/responses, served through the chat handler's turn
    responses_output   the Responses output items and response object
    responses_stream   a chat turn's typed chunks as Responses events
    logprobs     OpenAI logprob shapes with token bytes
    capture      trajectory records and their commit
    handlers     models, adapter load/unload, trajectories, health handlers
    adapters     the admin routes over adapter versions and releases
    feedback     the feedback webhook
    metrics      Prometheus text and the request-counting middleware
    sse          event-stream response with disconnect detection
    offload      prompt rendering and tokenisation off the event loop
    routes       thin routers
    app          wiring and lifespan

The prompt format (tool rendering, parsing, the forced-call grammar) lives in
`clora_feedback.chat_format`; the wire models in `clora_feedback.schemas.openai`.
"""

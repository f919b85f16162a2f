"""The OpenAI-compatible HTTP gateway (FastAPI): agents as models, trajectories captured.

Entry points live in `clora_feedback.gateway.app` (`create_app`,
`build_app_from_settings`, `serve`); they are not re-exported here so that
importing a light module (e.g. `gateway.tools` or `gateway.protocol`) does not
pull in the whole server.

Modules, one concern each:
    protocol     request models and the `clora` response extension
    errors       the one mapping from errors to OpenAI error JSON
    auth         API keys -> principals
    agents       agent registry, routing of `model`, adapter versions
    generation   n engine requests per HTTP request, merged and accumulated
    chat         /v1/chat/completions (templates, tools, SSE)
    completions  /v1/completions
    logprobs     OpenAI logprob shapes with token bytes
    capture      trajectory records
    admin        models, adapter load/unload, trajectories, health handlers
    metrics      Prometheus text and the request-counting middleware
    sse          event-stream response with disconnect detection
    routes       thin routers
    app          wiring and lifespan
    tools, tool_constraint   tool-call rendering, parsing and forced-call grammar
"""

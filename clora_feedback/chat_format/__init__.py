"""The model's prompt format: how tools are offered, how calls are written and parsed, and the forced-call grammar.

Shared by the gateway (which renders prompts and parses replies) and by engines
(which compile a declarative `ToolCallSpec` / `JSONSchemaSpec` into a token
constraint with `constraint.compile_guided`). Pure Python: no torch, no HTTP.

Modules:
    tools        rendering tools and messages, the forced-call prefix and spec
    calls        the `<tool_call>` tag: writing one, parsing calls (whole and streamed)
    json_prefix  the incremental JSON validator, optionally guided by a compiled JSON Schema
    schema       JSON Schema (the supported subset) -> the validator's schema nodes
    trigger      free text in which every call the model opens is constrained
    constraint   the token constraint built on them, and the vocabulary's token texts

Not here: HTTP, engine scheduling, sampling.
"""

"""Tool calling: rendering, parsing (whole and streamed), forced-call prefix and JSON constraint."""

from __future__ import annotations

import itertools
import json
import random
import re
from typing import Any

import pytest

from clora_feedback.chat_format.calls import (
    ContentDelta,
    ToolCallEvent,
    ToolCallStreamParser,
    parse_tool_calls,
)
from clora_feedback.chat_format.constraint import JSONCallConstraint, vocab_texts
from clora_feedback.chat_format.json_prefix import CallMode, JSONPrefix
from clora_feedback.chat_format.tools import (
    forced_call_constraint,
    forced_call_prefix,
    render_messages,
)
from clora_feedback.errors import InvalidRequestError

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}
TOOLS = [WEATHER, TIME]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
CALL_ID_RE = re.compile(r"call_[0-9a-f]{24}")


def _assistant_call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
        ],
    }


# ---------------------------------------------------------------- render_messages


def test_render_prepends_tools_to_existing_system_and_maps_developer() -> None:
    msgs = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    out = render_messages(msgs, TOOLS, "auto")
    assert [m["role"] for m in out] == ["system", "user"]
    system = out[0]["content"]
    assert system.startswith("# Tools") and system.endswith("\n\nBe brief.")
    listed = system.split("<tools>\n")[1].split("\n</tools>")[0].splitlines()
    specs = [json.loads(line) for line in listed]
    assert [s["name"] for s in specs] == ["get_weather", "get_time"]
    assert specs[0]["description"] == "Current weather in a city."
    assert specs[0]["parameters"] == WEATHER["function"]["parameters"]  # type: ignore[index]
    assert specs[1]["parameters"] == {"type": "object", "properties": {}}
    assert '<tool_call>{"name": ' in system
    assert "must call" not in system


def test_render_adds_system_message_when_none_and_states_obligation() -> None:
    msgs = [{"role": "user", "content": "hi"}]
    required = render_messages(msgs, TOOLS, "required")
    assert required[0]["role"] == "system" and required[1] == {"role": "user", "content": "hi"}
    assert "must call at least one function" in required[0]["content"]
    named = render_messages(msgs, TOOLS, NAMED)
    assert 'must call the function "get_weather"' in named[0]["content"]


@pytest.mark.parametrize("choice", ["none", None])
def test_render_without_offering_tools(choice: str | None) -> None:
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}]
    tools = TOOLS if choice == "none" else None
    assert render_messages(msgs, tools, choice) == msgs


def test_render_multi_turn_round_trips_through_parser() -> None:
    msgs = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'},
                },
                {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": ""}},
            ],
        },
        {"role": "tool", "tool_call_id": "c2", "content": "12:00"},
        {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "sunny"}]},
    ]
    out = render_messages(msgs, TOOLS, "auto")[1:]
    assert out[0] == {"role": "user", "content": "a\nb"}
    content, calls = parse_tool_calls(out[1]["content"])
    assert content == "Checking."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Zürich"}),
        ("get_time", {}),
    ]
    assert out[2] == {
        "role": "tool",
        "content": '<tool_response name="get_time">12:00</tool_response>',
    }
    assert out[3]["content"] == '<tool_response name="get_weather">sunny</tool_response>'


@pytest.mark.parametrize(
    ("messages", "tools", "choice", "param"),
    [
        ([], None, None, "messages"),
        ([{"role": "function", "content": "x"}], None, None, "messages[0].role"),
        ([{"role": "user", "content": None}], None, None, "messages[0].content"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
            None,
            None,
            "messages[0].content[0]",
        ),
        ([{"role": "tool", "content": "r"}], None, None, "messages[0].tool_call_id"),
        (
            [{"role": "tool", "tool_call_id": "zz", "content": "r"}],
            None,
            None,
            "messages[0].tool_call_id",
        ),
        (
            [
                {
                    "role": "assistant",
                    "tool_calls": [{"type": "function", "function": {"name": "f"}}],
                }
            ],
            None,
            None,
            "messages[0].tool_calls[0].id",
        ),
        (
            [_assistant_call("c1", "f", "{}") | {"tool_calls": [{"id": "c1", "type": "x"}]}],
            None,
            None,
            "messages[0].tool_calls[0]",
        ),
        ([{"role": "user", "content": "x"}], [{"type": "retrieval"}], None, "tools[0].type"),
        ([{"role": "user", "content": "x"}], [{"type": "function"}], None, "tools[0].function"),
        (
            [{"role": "user", "content": "x"}],
            [{"type": "function", "function": {"name": "bad name"}}],
            None,
            "tools[0].function.name",
        ),
        ([{"role": "user", "content": "x"}], [WEATHER, WEATHER], None, "tools[1].function.name"),
        (
            [{"role": "user", "content": "x"}],
            [{"type": "function", "function": {"name": "f", "parameters": "{}"}}],
            None,
            "tools[0].function.parameters",
        ),
        (
            [{"role": "user", "content": "x"}],
            TOOLS,
            {"type": "function", "function": {"name": "nope"}},
            "tool_choice",
        ),
        ([{"role": "user", "content": "x"}], TOOLS, "sometimes", "tool_choice"),
        ([{"role": "user", "content": "x"}], None, "required", "tool_choice"),
    ],
)
def test_render_rejects_bad_shapes(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, choice: Any, param: str
) -> None:
    with pytest.raises(InvalidRequestError) as info:
        render_messages(messages, tools, choice)
    assert info.value.param == param


# ---------------------------------------------------------------- parse_tool_calls


def test_parse_calls_and_content() -> None:
    text = (
        'Let me look.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "n": [1, 2.50]}}'
        '</tool_call>\n<tool_call> {"name": "get_time", "arguments": "{\\"tz\\": \\"UTC\\"}"} \n'
    )
    content, calls = parse_tool_calls(text)
    assert content == "Let me look."
    assert [(c.name, c.arguments) for c in calls] == [
        ("get_weather", '{"city":"Paris","n":[1,2.50]}'),  # numbers verbatim
        ("get_time", '{"tz":"UTC"}'),
    ]
    assert all(CALL_ID_RE.fullmatch(c.id) for c in calls)
    assert calls[0].id != calls[1].id


@pytest.mark.parametrize(
    "text",
    [
        "<tool_call>{bad json}</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',
        '<tool_call>{"name": "", "arguments": {}}</tool_call>',
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
        '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>',
        '<tool_call>{"name": "f", "arguments": {}} trailing text',
        '<tool_call>{"name": "f", "arguments": {}}</tool_c',
        '<tool_call>{"name": "f", "arguments": {',
        "use the <tool_call> tag",
    ],
)
def test_parse_malformed_calls_stay_text(text: str) -> None:
    assert parse_tool_calls(text) == (text.strip(), [])


def test_parse_plain_and_empty() -> None:
    assert parse_tool_calls("  \n") == (None, [])
    assert parse_tool_calls(" hello\n") == ("hello", [])
    content, calls = parse_tool_calls('<tool_call>{"name": "f", "arguments": {"s": "é\\ud800"}}')
    assert content is None
    assert calls[0].arguments == '{"s":"\\u00e9\\ud800"}'  # lone surrogate: escaped, encodable


def test_parse_keeps_numbers_verbatim() -> None:
    big = "1" + "0" * 5000
    text = f'<tool_call>{{"name": "f", "arguments": {{"x": 85e+824, "y": -0.10, "z": {big}}}}}'
    _, calls = parse_tool_calls(text)
    assert calls[0].arguments == f'{{"x":85e+824,"y":-0.10,"z":{big}}}'


def test_parse_recovers_after_malformed_tag() -> None:
    text = '<tool_call>{oops <tool_call>{"name": "f", "arguments": {}}</tool_call> done'
    content, calls = parse_tool_calls(text)
    assert content == "<tool_call>{oops  done"
    assert [c.name for c in calls] == ["f"]


# ---------------------------------------------------------------- ToolCallStreamParser


_FRAGMENTS = [
    "Hello",
    " ",
    "\n",
    "é✓",
    "<",
    "<tool",
    "<tool_call>",
    "</tool_call>",
    "</tool_c",
    '{"name": "f", "arguments": {"a": [1, "x}"]}}',
    '{"name": "g", "arguments": "{\\"k\\": true}"}',
    '{"name": 3}',
    "{not json",
    '{"x": NaN}',
    "}",
    '"',
]


def _random_text(rng: random.Random) -> str:
    pieces = []
    for _ in range(rng.randint(0, 12)):
        if rng.random() < 0.35:
            call = json.dumps({"name": rng.choice("fgh"), "arguments": {"v": rng.random()}})
            ws = rng.choice(["", " ", "\n"])
            close = rng.choice(["</tool_call>", "</tool_call>", "", "</tool_c"])
            pieces.append(f"<tool_call>{ws}{call}{ws}{close}")
        else:
            pieces.append(rng.choice(_FRAGMENTS))
    return "".join(pieces)


def _stream(text: str, cuts: list[int]) -> tuple[str | None, list[ToolCallEvent]]:
    parser = ToolCallStreamParser()
    events = []
    bounds = [0, *cuts, len(text)]
    for a, b in itertools.pairwise(bounds):
        events += parser.feed(text[a:b])
    events += parser.finish()
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    assert all(e.text for e in events if isinstance(e, ContentDelta))
    return content or None, [e for e in events if isinstance(e, ToolCallEvent)]


def test_stream_matches_parse_over_random_chunkings() -> None:
    rng = random.Random(1234)
    for _ in range(400):
        text = _random_text(rng)
        expected_content, expected_calls = parse_tool_calls(text)
        for mode in ("chars", "random", "whole"):
            if mode == "chars":
                cuts = list(range(1, len(text)))
            elif mode == "random":
                count = min(max(len(text) - 1, 0), rng.randint(0, 6))
                cuts = sorted(rng.sample(range(1, len(text)), count))
            else:
                cuts = []
            content, calls = _stream(text, cuts)
            assert content == expected_content, (text, cuts)
            assert [(c.name, c.arguments) for c in calls] == [
                (c.name, c.arguments) for c in expected_calls
            ], (text, cuts)
            assert [c.index for c in calls] == list(range(len(calls)))
            assert all(CALL_ID_RE.fullmatch(c.id) for c in calls)


def test_stream_holds_back_only_what_could_be_a_tag() -> None:
    parser = ToolCallStreamParser()
    assert parser.feed("Hi <tool") == [ContentDelta("Hi")]
    assert parser.feed("bar") == [ContentDelta(" <toolbar")]
    assert parser.feed(' <tool_call>{"name": "f", ') == []
    events = parser.feed('"arguments": {}}</tool_call>')
    assert len(events) == 1 and isinstance(events[0], ToolCallEvent) and events[0].name == "f"
    assert parser.finish() == []
    with pytest.raises(RuntimeError):
        parser.feed("x")


def test_stream_releases_malformed_call_early() -> None:
    parser = ToolCallStreamParser()
    assert parser.feed("<tool_call>{") == []
    assert (
        "".join(e.text for e in parser.feed("x") if isinstance(e, ContentDelta)) == "<tool_call>{x"
    )


# ---------------------------------------------------------------- forced calls


def test_forced_call_prefix() -> None:
    assert forced_call_prefix(NAMED, TOOLS) == '<tool_call>{"name": "get_weather", "arguments": '
    assert forced_call_prefix("required", TOOLS) == '<tool_call>{"name": "'
    for choice in ("auto", "none", None):
        assert forced_call_prefix(choice, TOOLS) == ""
        assert forced_call_constraint(choice, TOOLS, ["a"]) is None
    with pytest.raises(InvalidRequestError):
        forced_call_prefix({"type": "function", "function": {"name": "x"}}, TOOLS)


_JSON_VOCAB = [
    *'{}[]:,"\\ \n-+.0123456789eEtrufalsnbxyzé\t/cghimow_',
    '{"',
    '":',
    '",',
    '", "',
    "1.5",
    "true",
    "null",
    "false",
    "-0",
    "e+",
    "\\u00",
    "ab",
    ' {"',
    "}}",
    "]}",
    "get",
    "_weather",
    "_time",
    "search",
    '", "arguments": ',
    "arguments",
    "",
]


def _walk(constraint: JSONCallConstraint, rng: random.Random, steps: int) -> str:
    text = []
    for _ in range(steps):
        if constraint.is_done():
            break
        allowed = [i for i in range(len(_JSON_VOCAB)) if constraint.allows(i)]
        assert allowed, "".join(text)  # the vocab holds every character the grammar needs
        token = rng.choice(allowed)
        constraint.advance(token)
        text.append(_JSON_VOCAB[token])
    return "".join(text)


@pytest.mark.parametrize("mode", ["named", "required"])
def test_constraint_random_walk_always_completes_to_a_call(mode: str) -> None:
    rng = random.Random(7)
    tools = [*TOOLS, {"type": "function", "function": {"name": "search"}}]
    choice: Any = NAMED if mode == "named" else "required"
    prefix = forced_call_prefix(choice, tools)
    finished = 0
    for _ in range(150):
        constraint = forced_call_constraint(choice, tools, _JSON_VOCAB)
        assert constraint is not None
        generated = _walk(constraint, rng, rng.randint(0, 80))
        assert generated == constraint.generated_text
        suffix = constraint.closing_suffix()
        assert (suffix == "") == constraint.is_done()
        finished += constraint.is_done()
        obj = json.loads(prefix.removeprefix("<tool_call>") + generated + suffix)
        assert set(obj) == {"name", "arguments"} and isinstance(obj["arguments"], dict)
        assert obj["name"] in (
            {"get_weather"} if mode == "named" else {"get_weather", "get_time", "search"}
        )
        content, calls = parse_tool_calls(prefix + generated + suffix + "</tool_call>")
        assert content is None and len(calls) == 1
        assert json.loads(calls[0].arguments) == obj["arguments"]
    assert finished > 0


@pytest.mark.parametrize(
    ("mode", "accepted", "refused"),
    [
        ("named", "", "["),
        ("named", "", '"x"'),
        ("named", "{", ","),
        ("named", '{"a"', " 1"),
        ("named", '{"a": 0', "1"),
        ("named", '{"a": tr', "ux"),
        ("named", '{"a": [1,', "]"),
        ("named", '{"a": 1.', "}"),
        ("named", '{"a": -', "}"),
        ("named", '{"a": "', "\x01"),
        ("named", '{"a": "\\', "q"),
        ("named", '{"a": "\\u12', "g"),
        ("named", "{}", ","),
        ("named", "{}", "]"),
        ("named", "{}}", " "),
        ("named", '{"a": ', "NaN"),
        ("required", "", "x"),
        ("required", "get_", "x"),
        ("required", "get_time", "s"),
        ("required", "get_time", '" "'),
        ("required", 'get_time", ', '"argument"'),
        ("required", 'get_time", "arguments": ', "[]"),
        ("required", 'get_time", "arguments": {}', ","),
    ],
)
def test_constraint_refuses_invalid_continuations(
    mode: CallMode, accepted: str, refused: str
) -> None:
    tools = ("get_weather", "get_time")
    state = JSONPrefix.for_call(mode, tools)
    assert state.push(accepted)
    assert not state.copy().push(refused)
    texts = [accepted, refused]
    constraint = JSONCallConstraint(texts, mode, tools)
    if accepted:
        constraint.advance(0)
    assert not constraint.allows(1)


def test_constraint_token_rules_and_done() -> None:
    texts = ["{", "}", "", '"a":1', " ", "}}"]
    constraint = JSONCallConstraint(texts, "named", max_whitespace=2)
    assert not constraint.allows(2) and not constraint.allows(-1) and not constraint.allows(99)
    assert not constraint.allows(1)
    constraint.advance(0)
    constraint.advance(4)
    constraint.advance(4)
    assert not constraint.allows(4)  # whitespace cap
    with pytest.raises(ValueError):
        constraint.advance(4)
    assert constraint.closing_suffix() == "}}"
    constraint.advance(3)
    assert constraint.allows(5)  # "}}" closes the arguments and the call at once
    assert not constraint.is_done()
    constraint.advance(1)
    assert not constraint.is_done() and constraint.closing_suffix() == "}"
    constraint.advance(1)
    assert constraint.is_done() and constraint.closing_suffix() == ""
    assert not any(constraint.allows(i) for i in range(len(texts)))


@pytest.mark.parametrize(
    ("prefix", "suffix"),
    [
        ("{", "}"),
        ('{"a', '":0}'),
        ('{"a":', "0}"),
        ('{"a": [1,', "0]}"),
        ('{"a": "\\', '""}'),
        ('{"a": "\\u1', '000"}'),
        ('{"a": 1e', "0}"),
        ('{"a": 12', "}"),
        ('{"a": fa', "lse}"),
        ('{"a": {"b": [', "]}}"),
        ('{"a": 1,', '"":0}'),
    ],
)
def test_closing_suffix_is_shortest(prefix: str, suffix: str) -> None:
    state = JSONPrefix.for_object()
    assert state.push(prefix)
    assert state.closing_suffix() == suffix
    json.loads(prefix + suffix)


def _random_json(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(7 if depth < 3 else 5)
    if kind == 0:
        return rng.choice([True, False, None])
    if kind == 1:
        return rng.randint(-1000, 1000)
    if kind == 2:
        return rng.uniform(-1e6, 1e6) * rng.choice([1, 1e-9, 1e12])
    if kind in (3, 4):
        return "".join(rng.choice('ab"\\/\n\té✓ ') for _ in range(rng.randint(0, 5)))
    if kind == 5:
        return [_random_json(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {str(rng.random())[:4]: _random_json(rng, depth + 1) for _ in range(rng.randint(0, 3))}


def test_prefix_validator_agrees_with_json_module() -> None:
    rng = random.Random(99)
    for _ in range(1500):
        obj = {"k": _random_json(rng)}
        text = json.dumps(obj, ensure_ascii=rng.random() < 0.5, indent=rng.choice([None, 1]))
        if rng.random() < 0.5:  # mutate one character
            i = rng.randrange(len(text))
            text = text[:i] + rng.choice('{}[]:,"\\ 0-.eE') + text[i + 1 :]
        text = text[: rng.randint(1, len(text))] if rng.random() < 0.5 else text
        state = JSONPrefix.for_object()
        ok = state.push(text)
        try:
            parsed = json.loads(text)
            valid = isinstance(parsed, dict)
        except ValueError:
            valid = False
        if valid:
            assert ok and state.done, text
        elif ok:
            assert not state.done, text
            assert isinstance(json.loads(text + state.closing_suffix()), dict), text


# ---------------------------------------------------------------- vocab_texts


class _SentencePieceLike:
    """Decodes "▁x" as " x" except at the start of the text, like SentencePiece."""

    def __init__(self) -> None:
        self.all_special_ids = [0]
        self.pieces = ["</s>", "a", "▁{", "▁get", "}", "▁"]
        self.calls = 0

    def __len__(self) -> int:
        return len(self.pieces)

    def encode(self, text: str, **kwargs: Any) -> list[int]:
        return [self.pieces.index(text)]

    def batch_decode(self, sequences: list[list[int]], **kwargs: Any) -> list[str]:
        self.calls += 1
        return [
            "".join(self.pieces[i] for i in seq).replace("▁", " ").removeprefix(" ")
            for seq in sequences
        ]


def test_vocab_texts_keeps_leading_spaces_and_caches() -> None:
    tok = _SentencePieceLike()
    texts = vocab_texts(tok)
    assert texts == ["", "a", " {", " get", "}", " "]
    calls = tok.calls
    assert vocab_texts(tok) is texts and tok.calls == calls


def test_vocab_texts_on_real_byte_level_tokenizer() -> None:
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast

    sample = '{"name": "get_weather", "arguments": {"city": "Zürich"}}'
    core = tokenizers.Tokenizer(tokenizers.models.BPE())
    core.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|im_end|>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    core.train_from_iterator([sample] * 10, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>")
    texts = vocab_texts(tok)
    assert len(texts) == len(tok) and texts[tok.eos_token_id] == ""
    assert "".join(texts[i] for i in tok.encode(sample)) == sample
    constraint = JSONCallConstraint(texts, "named")
    args = tok.encode('{"city": "Zürich"}}')
    for token in args:
        assert constraint.allows(token)
        constraint.advance(token)
    assert constraint.is_done()


# ---------------------------------------------------------------- calls the model chooses

_TRIGGER_VOCAB = [
    *_JSON_VOCAB,
    *"POdkp>",
    '{"name": "',
    "Paris",
    "<tool",
    "_call>",
    "<tool_call>",
    "</tool_call>",
    "</",
    "hi ",
    "<",
]
_STRICT_TOOLS = {
    "get_weather": {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer"}},
        "required": ["city", "days"],
        "additionalProperties": False,
    },
    "get_time": None,
}


def _free_walk(constraint: JSONCallConstraint, rng: random.Random, script: list[int]) -> str:
    """Follow `script` while the constraint allows it, then pick allowed tokens at random,
    never the special token "" (so only the grammar, not an end of turn, ends a call)."""
    for token in script:
        assert constraint.allows(token)
        constraint.advance(token)
    for _ in range(rng.randint(0, 120)):
        if constraint.is_done():
            break
        allowed = [i for i, t in enumerate(_TRIGGER_VOCAB) if t and constraint.allows(i)]
        constraint.advance(rng.choice(allowed))
    return constraint.generated_text


@pytest.mark.parametrize("parallel", [True, False])
def test_triggered_calls_random_walk_always_parses(parallel: bool) -> None:
    import jsonschema

    from clora_feedback.chat_format.constraint import triggered_grammar

    grammar = triggered_grammar(_STRICT_TOOLS, parallel=parallel)
    rng = random.Random(3)
    opened = [_TRIGGER_VOCAB.index(t) for t in ("hi ", "<tool", "_call>")]
    calls_seen = 0
    for _ in range(120):
        constraint = JSONCallConstraint.from_grammar(_TRIGGER_VOCAB, grammar)
        text = _free_walk(constraint, rng, opened)
        suffix = constraint.closing_suffix()
        _, calls = parse_tool_calls(text + suffix)
        assert calls, text + suffix  # the opened call always parses, whatever followed
        assert parallel or (len(calls) == 1 and constraint.is_done() == (suffix == ""))
        for call in calls:
            schema = _STRICT_TOOLS[call.name] or {"type": "object"}
            jsonschema.validate(json.loads(call.arguments), schema)
        calls_seen += len(calls)
    assert calls_seen >= 120


def test_triggered_calls_leave_free_text_free() -> None:
    from clora_feedback.chat_format.constraint import triggered_grammar

    texts = ["plain <b>text</b> ", "<tool_", "call>", "x", "", '{"name": "get_time"']
    constraint = JSONCallConstraint.from_grammar(
        texts, triggered_grammar(_STRICT_TOOLS, parallel=True)
    )
    assert all(constraint.allows(i) for i in range(len(texts)))  # the end of turn too
    constraint.advance(0)
    constraint.advance(1)
    assert constraint.allows(4) and constraint.allows(2)
    constraint.advance(2)  # `<tool_call>` is complete: the call is constrained now
    assert not constraint.allows(3) and not constraint.allows(4)  # no text, no end of turn
    assert constraint.allows(5)
    assert not constraint.is_done()
    assert constraint.closing_suffix().endswith("}</tool_call>")

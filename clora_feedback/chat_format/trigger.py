"""The grammar of a reply in which the model may choose to call tools: free text, then calls.

With `tool_choice` "auto" the model writes what it likes until it opens a call
with `<tool_call>` (see `calls`); from there the call must be well formed:
`{"name": "`, one of the declared tool names, `", "arguments": `, an arguments
object that follows that tool's parameter schema (the "required" mode of
`json_prefix.JSONPrefix`, guided by `schema`), the call's `}`, then
`</tool_call>`, after which the text is free again. JSON whitespace is allowed
around the opening `{`, around `"name"`'s colon and before `</tool_call>`, as
the stream parser accepts it.

With `parallel` false (`parallel_tool_calls: false`, or legacy `functions`)
the grammar is complete once the first call's `}` is written, so the engine
finishes the reply there: at most one call.

`TriggeredCalls` is a character machine with the same face as `JSONPrefix`
(`push`, `copy`, `done`, `closing_suffix`, plus `free`: outside any call, where
every token, special ones included, may follow), so the token constraint in
`constraint` drives both.

Not here: tokens (see `constraint`), parsing the finished text (see `calls`).
"""

from __future__ import annotations

from typing import NamedTuple

from clora_feedback.chat_format.calls import CALL_CLOSE, CALL_OPEN
from clora_feedback.chat_format.json_prefix import JSONPrefix

__all__ = ["TriggeredCalls"]

_WS = " \t\n\r"
_LEAD = '{"name":"'
"""What follows `<tool_call>` before the tool name (whitespace aside)."""
_LEAD_WS_AT = frozenset({0, 1, 7, 8})
"""Positions in `_LEAD` where whitespace may come first: around `{` and the colon."""

# Phases of the machine.
_FREE = 0  # outside any call
_OPEN = 1  # after `<tool_call>`, matching `_LEAD`
_CALL = 2  # inside the call's JSON (the name, the arguments)
_CLOSE = 3  # after the call's `}`, matching `</tool_call>`
_DONE = 4  # one call made and no more allowed


class _State(NamedTuple):
    phase: int
    tail: str = ""  # free text that may be the start of `<tool_call>`
    matched: int = 0  # characters of `_LEAD` / `CALL_CLOSE` matched
    ws_run: int = 0
    call: JSONPrefix | None = None


class TriggeredCalls:
    """Free text with well-formed calls (format in the module docstring).

    Args:
        call: the grammar after `{"name": "` (`constraint.call_grammar(functions, None)`);
            copied per call.
        parallel: several calls may follow one another; false: the first call ends it.
        max_whitespace: most consecutive whitespace characters where the call allows them.
    """

    __slots__ = ("_call", "_max_ws", "_parallel", "_state")

    def __init__(self, call: JSONPrefix, *, parallel: bool, max_whitespace: int | None) -> None:
        self._call = call
        self._parallel = parallel
        self._max_ws = max_whitespace
        self._state = _State(_FREE)

    def copy(self) -> TriggeredCalls:
        """An independent copy (the state is immutable, so this is shallow)."""
        new = TriggeredCalls.__new__(TriggeredCalls)
        new._call, new._parallel, new._max_ws = self._call, self._parallel, self._max_ws
        new._state = self._state
        return new

    @property
    def done(self) -> bool:
        """True once the one allowed call is complete (never with `parallel`)."""
        return self._state.phase == _DONE

    @property
    def free(self) -> bool:
        """Outside any call: any token, even one without text (end of turn), may follow."""
        return self._state.phase == _FREE

    @property
    def calls_open(self) -> bool:
        """A call has been opened and is not closed yet."""
        return self._state.phase in (_OPEN, _CALL, _CLOSE)

    def push(self, text: str) -> bool:
        """Feed `text`; False if some character of it breaks a call."""
        return all(self._step(c) for c in text)

    def _whitespace(self, state: _State) -> bool:
        run = state.ws_run + 1
        self._state = state._replace(ws_run=run)
        return self._max_ws is None or run <= self._max_ws

    def _step(self, c: str) -> bool:
        state = self._state
        phase = state.phase
        if phase == _FREE:
            tail = state.tail + c
            if tail.endswith(CALL_OPEN):
                self._state = _State(_OPEN)
            else:
                self._state = _State(_FREE, tail[-(len(CALL_OPEN) - 1) :])
            return True
        if phase == _OPEN:
            if c in _WS and state.matched in _LEAD_WS_AT:
                return self._whitespace(state)
            if c != _LEAD[state.matched]:
                return False
            if state.matched + 1 < len(_LEAD):
                self._state = _State(_OPEN, matched=state.matched + 1)
            else:
                self._state = _State(_CALL, call=self._call.copy())
            return True
        if phase == _CALL:
            assert state.call is not None
            call = state.call.copy()
            if not call.push(c):
                return False
            if not call.done:
                self._state = state._replace(call=call)
            else:
                self._state = _State(_CLOSE if self._parallel else _DONE)
            return True
        if phase == _CLOSE:
            if c in _WS and state.matched == 0:
                return self._whitespace(state)
            if c != CALL_CLOSE[state.matched]:
                return False
            matched = state.matched + 1
            self._state = (
                _State(_FREE) if matched == len(CALL_CLOSE) else _State(_CLOSE, "", matched)
            )
            return True
        return False  # _DONE accepts nothing

    def closing_suffix(self) -> str:
        """The shortest text that closes an open call ("" outside calls)."""
        state = self._state
        if state.phase == _OPEN:
            rest = _LEAD[state.matched :]
            probe = self.copy()
            if not probe.push(rest):  # pragma: no cover - the lead is always accepted
                raise AssertionError("the call's opening was refused")
            return rest + probe.closing_suffix()
        if state.phase == _CALL:
            assert state.call is not None
            return state.call.closing_suffix() + (CALL_CLOSE if self._parallel else "")
        if state.phase == _CLOSE:
            return CALL_CLOSE[state.matched :]
        return ""

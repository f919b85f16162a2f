"""Apply a unified diff to a text: how a `Correction` given as a diff becomes corrected content.

Strict by design: every context and removed line must match, otherwise the
diff is refused (`InvalidRequestError`), because a diff that does not apply
to the agent's output is not a correction of it. File headers (`---`/`+++`)
are optional; `\\ No newline at end of file` markers are honoured, and a diff
of an output without a final newline that omits the marker is accepted.
"""

from __future__ import annotations

import re

from clora_feedback.errors import InvalidRequestError

_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


def apply_unified_diff(original: str, diff: str) -> str:
    """Return `original` with `diff` applied.

    Raises:
        InvalidRequestError: the diff is malformed or does not match `original`.
    """
    source = original.splitlines(keepends=True)
    lines = diff.splitlines(keepends=True)
    out: list[str] = []
    pos = 0  # next unconsumed line of `source`
    i = 0
    while i < len(lines) and not lines[i].startswith("@@"):
        if not lines[i].startswith(("---", "+++", "diff ", "index ")) and lines[i].strip():
            raise InvalidRequestError(
                f"diff line {i + 1} is not a header or hunk: {lines[i].rstrip()!r}", param="diff"
            )
        i += 1
    if i == len(lines):
        raise InvalidRequestError("diff has no hunks", param="diff")
    while i < len(lines):
        match = _HUNK.match(lines[i])
        if match is None:
            raise InvalidRequestError(
                f"diff line {i + 1} is not a hunk header: {lines[i].rstrip()!r}", param="diff"
            )
        old_start, old_len = int(match.group(1)), int(match.group(2) or 1)
        start = old_start if old_len == 0 else old_start - 1
        if start < pos or start > len(source):
            raise InvalidRequestError(
                f"hunk at diff line {i + 1} is out of order or past the end", param="diff"
            )
        out.extend(source[pos:start])
        pos = start
        i += 1
        while i < len(lines) and not lines[i].startswith("@@"):
            tag, text = lines[i][:1], lines[i][1:]
            # A following "\ No newline at end of file" means this line has no newline.
            if i + 1 < len(lines) and lines[i + 1].startswith("\\"):
                text = text.rstrip("\n")
            elif not text.endswith("\n"):
                text += "\n"
            if tag in (" ", "-"):
                if pos >= len(source) or (
                    source[pos] != text and not _same_last_line(source, pos, text, lines)
                ):
                    raise InvalidRequestError(
                        f"diff does not apply: line {pos + 1} of the output is not {text.rstrip()!r}",
                        param="diff",
                    )
                if tag == " ":
                    out.append(text)
                pos += 1
            elif tag == "+":
                out.append(text)
            elif tag != "\\":
                raise InvalidRequestError(
                    f"bad diff line {i + 1}: {lines[i].rstrip()!r}", param="diff"
                )
            i += 1
    out.extend(source[pos:])
    result = "".join(out)
    if _lenient(original, lines) and result.endswith("\n"):
        result = result[
            :-1
        ]  # keep the output's missing final newline, as the diff did not mention it
    return result


def _lenient(original: str, lines: list[str]) -> bool:
    """True when `original` lacks a final newline and the diff has no no-newline markers.

    Many tools diff such text without the marker; the diff is then applied as if
    it had been there, and the result keeps the original's (missing) final newline.
    """
    return (
        bool(original)
        and not original.endswith("\n")
        and not any(x.startswith("\\") for x in lines)
    )


def _same_last_line(source: list[str], pos: int, text: str, lines: list[str]) -> bool:
    return (
        pos == len(source) - 1 and _lenient("".join(source), lines) and source[pos] + "\n" == text
    )

"""The `clora` command line dispatches each subcommand to its own parser."""

from __future__ import annotations

import pytest

from clora_feedback.cli.main import main


@pytest.mark.parametrize(
    ("argv", "usage"),
    [
        (["demo", "--help"], "usage: clora demo"),
        (["bench", "experiments", "--help"], "usage: clora bench experiments"),
        (["bench", "serve", "--help"], "usage: clora bench serve"),
        (["adapters", "--help"], "usage: clora adapters"),
    ],
)
def test_subcommand_help_comes_from_its_own_parser(
    argv: list[str], usage: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith(usage)


def test_unknown_options_are_refused_outside_the_demo(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--no-such-option"])
    assert exit_info.value.code == 2
    assert "unrecognized arguments: --no-such-option" in capsys.readouterr().err


def test_the_demo_refuses_unknown_agents(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--agents", "nobody"]) == 2
    assert "unknown agents ['nobody']" in capsys.readouterr().out

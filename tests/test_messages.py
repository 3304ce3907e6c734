"""One wording for "unknown X" (kvlab.messages), whichever layer says it."""

from __future__ import annotations

import pytest

from kvlab import messages
from kvlab.cli import main


def test_the_wording_by_hand():
    assert messages.unknown("task", "nope", ["a", "b"]) == "unknown task 'nope'; choose one of: a, b"
    assert messages.unknown("task", ["x", "y"], ["a"]) == "unknown tasks 'x', 'y'; choose one of: a"


@pytest.mark.parametrize(
    "argv, what",
    [
        (["bench", "--tasks", "nope", "--out", "{tmp}"], "unknown task 'nope'; choose one of: "),
        (
            ["bench", "--tasks", "niah_single", "--methods", "nope", "--out", "{tmp}"],
            "unknown method 'nope'; choose one of: ",
        ),
        (
            ["run", "--doc", "assets/examples/story.txt", "--method", "nope", "--ratio", "2", "--question", "q"],
            "unknown method 'nope'; choose one of: ",
        ),
    ],
)
def test_every_command_words_an_unknown_name_alike(argv, what, tmp_path, capsys):
    assert main([a.replace("{tmp}", str(tmp_path)) for a in argv]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and what in err

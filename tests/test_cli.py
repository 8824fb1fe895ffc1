"""The `zeroshard` command's own flags (the subcommands have their own test files)."""

from __future__ import annotations

import pytest

from zeroshard.tools import cli


@pytest.mark.parametrize("flag", ["-V", "--version"])
def test_version_flags_print_the_version(flag: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main([flag])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"zeroshard {cli.version()}"

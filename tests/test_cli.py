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


def test_report_names_the_package_folder() -> None:
    """`zeroshard report`'s install path is the zeroshard package (it said
    zeroshard/tools, where the report module lives since the restructure)."""
    import os

    import zeroshard
    from zeroshard.tools.report import zeroshard_facts

    path = zeroshard_facts()["install path"]
    assert path == os.path.dirname(os.path.realpath(zeroshard.__file__))
    assert os.path.isfile(os.path.join(path, "tools", "report.py"))

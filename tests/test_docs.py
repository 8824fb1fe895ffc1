"""The README's code blocks run as printed, in order, as a newcomer would run them.

Every fenced block of README.md (tests/docblocks.py reads them and their directives):

* ``python``: written to a file in one folder shared by the whole README and run with
  this interpreter on one rank (``python FILE`` as its own process, forked from the
  tests' preloaded forkserver: ``multirank.run_script``), unless a ``<!-- doctest: file NAME -->`` directive makes
  it a file that a later command runs (``zeroshard run --nproc 2 pipe.py``);
* ``bash``: each command run with ``bash -c`` in that folder (a test per command);
* ``json``: a fragment of a DeepSpeed config, merged into a minimal one and read by
  ``zeroshard.config.load_config``;
* ``text``: not code, not run.

The folder holds links to the checkout's ``examples/``, ``Makefile`` and
``pyproject.toml`` (so ``make demo`` and ``examples/...`` paths work as in a clone) and
a ``.venv`` of shims for this checkout and interpreter, already "installed" (``make
test`` has just checked the real one; ``make demo`` here must not install anything);
files the blocks write (``ckpt/``, ``runs/``) stay in it. Otherwise the harness changes
the environment only: ``ZEROSHARD_EXAMPLE_MODEL=tiny`` shrinks the example's model (the
one knob, read by examples/train_gpt.py), ``OMP_NUM_THREADS=1``, and ``PYTHONPATH`` and
``PATH`` name this checkout and interpreter.

Blocks that cannot run here say so in the README source with a reason (``skip``
directives) and are reported as skipped with it. Commands that fail only because of
another piece of work still open are listed in ``PENDING`` with the issue they wait on:
they are strict expected failures, so the day they pass the suite fails until the entry
is removed.

Time: the blocks run serially; each ``zeroshard run --nproc 2`` costs a launcher and two
workers' start-up (about 10 s on an idle 2-core host, several times that under load), so
the README's launches are what the time is spent on.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field

import multirank
import pytest
from docblocks import Block, Command, read_blocks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
TIMEOUT_S = 420
#: command or block id -> why it is expected to fail for now. Strict: once it passes,
#: the test fails until the entry is removed (delete it after the named work merges).
PENDING: dict[str, str] = {}


@dataclass
class Outcome:
    code: int
    output: str


@dataclass
class DocRun:
    """The README's blocks run in order in one folder; ``outcome(id)`` runs everything up
    to that block or command first (so selecting one test still runs what it needs)."""

    folder: str
    env: dict[str, str]
    steps: list[tuple[str, Block, Command | None]]
    done: dict[str, Outcome] = field(default_factory=dict)

    def outcome(self, step_id: str) -> Outcome:
        for sid, block, command in self.steps:
            if sid not in self.done:
                self.done[sid] = self._run(block, command)
            if sid == step_id:
                return self.done[sid]
        raise KeyError(step_id)

    def _run(self, block: Block, command: Command | None) -> Outcome:
        if block.skip or block.file or (command is not None and command.skip):
            return Outcome(0, "")  # not run (the test reports why)
        try:
            if block.lang == "python":
                path = os.path.join(self.folder, f"doc_{block.id}.py")
                with open(path, "w") as f:
                    f.write(block.text)
                # `python doc_x.py`, forked from the preloaded server (torch imported once)
                res = multirank.run_script([path], env=self.env, cwd=self.folder, timeout=TIMEOUT_S)
            else:
                assert command is not None
                res = subprocess.run(
                    ["bash", "-c", command.text],
                    cwd=self.folder,
                    env=self.env,
                    capture_output=True,
                    text=True,
                    timeout=TIMEOUT_S,
                )
        except subprocess.TimeoutExpired as exc:
            out = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else exc.stdout
            return Outcome(-1, f"timed out after {TIMEOUT_S} s\n{out or ''}")
        return Outcome(res.returncode, res.stdout + res.stderr)


def _steps(blocks: list[Block]) -> list[tuple[str, Block, Command | None]]:
    steps: list[tuple[str, Block, Command | None]] = []
    for block in blocks:
        if block.lang == "bash":
            steps += [(c.id, block, c) for c in block.commands()]
        elif block.lang == "python":
            steps.append((block.id, block, None))
    return steps


BLOCKS = read_blocks(README)
STEPS = _steps(BLOCKS)


def _shim(path: str, body: str) -> None:
    with open(path, "w") as f:
        f.write("#!/bin/sh\n" + body)
    os.chmod(path, 0o755)


def _folder_env(folder: str) -> dict[str, str]:
    """Links to the checkout's examples/, Makefile and pyproject.toml; a ``.venv`` of
    shims (``.venv/bin/zeroshard`` and ``python``: this checkout, this interpreter)
    whose ``.installed-stamp`` is fresh, so ``make demo`` runs its recipe and never its
    install step (which, pointed at this folder, would re-install the real venv's
    editable package from here); the shim python refuses pip outright, to be sure."""
    for name in ("examples", "Makefile", "pyproject.toml"):
        os.symlink(os.path.join(ROOT, name), os.path.join(folder, name))
    shims = os.path.join(folder, ".venv", "bin")
    os.makedirs(shims)
    python = sys.executable
    _shim(os.path.join(shims, "zeroshard"), f'exec "{python}" -m zeroshard.tools.cli "$@"\n')
    _shim(
        os.path.join(shims, "python"),
        f'if [ "$1" = -m ] && [ "$2" = pip ]; then echo "doc-test: no pip here" >&2; exit 3; fi\n'
        f'exec "{python}" "$@"\n',
    )
    open(os.path.join(folder, ".venv", ".installed-stamp"), "w").close()  # newer than pyproject
    return {
        **os.environ,
        "PATH": os.pathsep.join([shims, os.environ["PATH"]]),
        "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
        "OMP_NUM_THREADS": "1",
        "ZEROSHARD_EXAMPLE_MODEL": "tiny",
        "ZEROSHARD_PROGRESS": "0",
    }


@pytest.fixture(scope="module")
def doc_run(tmp_path_factory) -> DocRun:
    folder = str(tmp_path_factory.mktemp("readme"))
    env = _folder_env(folder)
    for block in BLOCKS:  # the files the README defines exist before any command runs
        if block.file:
            with open(os.path.join(folder, block.file), "w") as f:
                f.write(block.text)
    return DocRun(folder, env, STEPS)


@pytest.mark.parametrize("step_id", [s[0] for s in STEPS])
def test_readme_block_runs_as_printed(doc_run: DocRun, step_id: str) -> None:
    _, block, command = next(s for s in STEPS if s[0] == step_id)
    where = f"README.md:{command.line if command else block.line}"
    reason = block.skip or (command.skip if command else None)
    if reason:
        pytest.skip(f"{where}: {reason}")
    if block.file:
        pytest.skip(f"{where}: the file {block.file}, run by a later command")
    outcome = doc_run.outcome(step_id)
    ok = outcome.code == 0
    if step_id in PENDING:
        if ok:
            pytest.fail(f"{where} passes now: remove PENDING[{step_id!r}] ({PENDING[step_id]})")
        pytest.xfail(f"{where}: {PENDING[step_id]}")
    assert ok, f"{where}: exit {outcome.code}\n{outcome.output[-4000:]}"


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.lang == "json"], ids=lambda b: b.id)
def test_readme_json_fragments_load(block: Block) -> None:
    """A JSON block is a fragment of a DeepSpeed config: merged into a minimal one, the
    config loader takes it (every key known, every value in range)."""
    from zeroshard.config import load_config

    text = block.text.strip()
    fragment = json.loads(text if text.startswith("{") else "{" + text.rstrip(",") + "}")
    config = {"train_micro_batch_size_per_gpu": 1, **fragment}
    load_config(config)


def test_readme_blocks_are_all_accounted_for() -> None:
    """Every block has a language the doc-test knows (docblocks.read_blocks refuses any
    other), every file block is run by a command that names it, every PENDING entry
    names a step that exists, and every skip gives a reason."""
    commands = [c.text for _, _, c in STEPS if c is not None]
    for block in BLOCKS:
        if block.file:
            assert any(block.file in c.split() for c in commands), (block.id, block.file)
        assert block.skip is None or block.skip.strip(), block.id
    ids = {s[0] for s in STEPS}
    assert set(PENDING) <= ids, set(PENDING) - ids
    assert sum(b.lang == "python" for b in BLOCKS) >= 7 and commands  # the README's, found


def test_example_docstring_commands_are_launched_by_the_tests() -> None:
    """The commands the examples' docstrings print are the ones the suite runs:
    tests/test_examples.py launches them as printed, or the README does (a command of
    its own, or `make demo`'s recipe: examples/train_gpt.py and `zeroshard plot
    runs/demo`)."""
    import ast

    from example_cases import LAUNCHED

    launched = set(LAUNCHED)
    with open(os.path.join(ROOT, "Makefile")) as f:
        demo = [
            line.strip().replace("$(BIN)/", "")
            for line in f.read().split("\ndemo:", 1)[1].split("\n\n", 1)[0].splitlines()[1:]
        ]
    assert any(c.text.split("#")[0].strip() == "make demo" for _, _, c in STEPS if c is not None)
    launched |= set(demo)
    # and the README's commands, which the test above runs as printed
    launched |= {c.text.split("#")[0].strip() for _, b, c in STEPS if c and not (b.skip or c.skip)}  # fmt: skip
    printed = []
    for folder, _, files in os.walk(os.path.join(ROOT, "examples")):
        for name in sorted(files):
            if name.endswith(".py"):
                with open(os.path.join(folder, name)) as f:
                    doc = ast.get_docstring(ast.parse(f.read()), clean=False) or ""
                for line in doc.splitlines():
                    if line.startswith("    ") and line.split()[0] in ("zeroshard", "python"):
                        printed.append(line.split("#", 1)[0].strip())
    assert len(printed) >= 10, printed
    missing = [c for c in printed if c not in launched]
    assert not missing, missing

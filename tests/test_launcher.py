"""`zeroshard run` and the DeepSpeed-style launcher: layout planning, then real launches.

The launch tests start real ranks through the command line (gloo on CPU), each under a
subprocess timeout so that a hang fails the test instead of stalling the suite.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from zeroshard.tools.launch.launcher import (
    LaunchError,
    add_arguments,
    parse_hostfile,
    plan_layout,
    report_failure,
)

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "tests" / "scripts"
ZEROSHARD = [sys.executable, "-m", "zeroshard.tools.cli"]
PIPES: dict[str, Any] = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE}


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    return {**env, "PYTHONUNBUFFERED": "1", **extra}


def zeroshard(*args: str, timeout: float = 60, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*ZEROSHARD, *args], cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout
    )


def ok_lines(stdout: str) -> dict[int, str]:
    """rank -> the line ok.py printed."""
    return {
        int(m.group(1)): m.group(0)
        for m in re.finditer(r"OK rank=(\d+) [^\n]*?argv=\[[^\]]*\]", stdout)
    }


# ----------------------------------------------------------------------------- layout


def layout(*argv: str, device_count: int = 0):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return plan_layout(parser.parse_args([*argv, "train.py"]), device_count)


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "hostfile"
    path.write_text(text)
    return str(path)


def test_hostfile_good(tmp_path):
    hf = write(tmp_path, "node-a slots=4\nnode-b slots=4\n")
    assert [(e.host, e.slots, e.line) for e in parse_hostfile(hf)] == [
        ("node-a", 4, 1),
        ("node-b", 4, 2),
    ]
    got = layout("--hostfile", hf, "--node-rank", "1")
    assert (got.nnodes, got.nproc_per_node, got.node_rank) == (2, 4, 1)
    assert (got.master_addr, got.master_port) == ("node-a", 29500)


def test_hostfile_comments_and_blank_lines(tmp_path):
    hf = write(tmp_path, "# cluster\n\n   \nlocalhost slots=2   # this box\n# end\n")
    assert [(e.host, e.slots, e.line) for e in parse_hostfile(hf)] == [("localhost", 2, 4)]
    got = layout("--hostfile", hf)
    assert (got.nnodes, got.nproc_per_node, got.node_rank, got.master_port) == (1, 2, 0, None)


@pytest.mark.parametrize(
    "text, line",
    [
        ("node-a slots=4\nnode-b slots=four\n", 2),
        ("node-a\n", 1),
        ("# x\nnode-a slots=0\n", 2),
        ("node-a slots=2 extra\n", 1),
        ("node-a gpus=2\n", 1),
        ("node-a slots=2\nnode-a slots=2\n", 2),
    ],
)
def test_hostfile_bad_line(tmp_path, text, line):
    hf = write(tmp_path, text)
    with pytest.raises(LaunchError, match=rf"{re.escape(hf)}, line {line}"):
        parse_hostfile(hf)


def test_hostfile_unequal_slots_names_the_line(tmp_path):
    hf = write(tmp_path, "node-a slots=2\n# gpu box\nnode-b slots=4\n")
    with pytest.raises(LaunchError, match=r"line 3: node-b gets 4 processes but node-a gets 2"):
        layout("--hostfile", hf, "--node-rank", "0")
    # filtering the slots down to equal counts is fine
    got = layout("--hostfile", hf, "--node-rank", "1", "--include", "node-a@node-b:0,1")
    assert (got.nnodes, got.nproc_per_node) == (2, 2)


def test_hostfile_missing_or_empty(tmp_path):
    with pytest.raises(LaunchError, match=r"hostfile .*nope.*cannot read"):
        parse_hostfile(tmp_path / "nope")
    with pytest.raises(LaunchError, match="no hosts"):
        parse_hostfile(write(tmp_path, "# only a comment\n"))


def test_hostfile_finds_this_node(tmp_path):
    hf = write(tmp_path, "node-a.invalid slots=1\nlocalhost slots=1\n")
    assert layout("--hostfile", hf).node_rank == 1
    hf = write(tmp_path, "node-a.invalid slots=1\nnode-b.invalid slots=1\n")
    with pytest.raises(LaunchError, match="pass --node-rank"):
        layout("--hostfile", hf)


def test_hostfile_nnodes_nproc_and_exclude(tmp_path):
    hf = write(tmp_path, "a slots=4\nb slots=4\nc slots=4\n")
    got = layout("--hostfile", hf, "--num_nodes", "2", "--num_gpus", "3", "--node_rank", "0")
    assert (got.nnodes, got.nproc_per_node, got.master_addr) == (2, 3, "a")
    got = layout("--hostfile", hf, "--exclude", "a@b:3@c:3", "--node-rank", "0")
    assert (got.nnodes, got.nproc_per_node, got.master_addr) == (2, 3, "b")
    with pytest.raises(LaunchError, match="has no slot 7"):
        layout("--hostfile", hf, "--include", "a:7")
    with pytest.raises(LaunchError, match="not in the hostfile"):
        layout("--hostfile", hf, "--include", "zz")


def test_single_node_defaults_and_include():
    assert layout().nproc_per_node == 1  # no GPUs: one process
    assert layout(device_count=3).nproc_per_node == 3  # default: one per device
    assert layout("--nproc_per_node", "2", device_count=3).nproc_per_node == 2
    # more ranks than GPUs: allowed (gloo can share a GPU; NCCL's refusal is reported
    # by init_distributed, and the launcher prints a note)
    assert layout("--nproc_per_node", "5", device_count=3).nproc_per_node == 5
    got = layout("--include", "localhost:0,1")  # on CPU the list sets the count
    assert (got.nproc_per_node, got.master_port, got.local_slots) == (2, None, None)
    got = layout("--include", "localhost:1,3", device_count=4)
    assert (got.nproc_per_node, got.local_slots) == (2, [1, 3])
    got = layout("--exclude", "localhost:0", device_count=4)
    assert (got.nproc_per_node, got.local_slots) == (3, [1, 2, 3])
    with pytest.raises(LaunchError, match="cannot be combined"):
        layout("--include", "localhost:0", "--num_gpus", "2")
    with pytest.raises(LaunchError, match="--master-addr"):
        layout("--nnodes", "2")
    with pytest.raises(LaunchError, match="outside"):
        layout("--nnodes", "2", "--node-rank", "2", "--master-addr", "h")


# ----------------------------------------------------------------------------- launches


@pytest.mark.timeout(90)
def test_run_two_ranks():
    res = zeroshard("run", "--nproc", "2", "tests/scripts/ok.py", "--flag", "x")
    assert res.returncode == 0, res.stderr
    lines = ok_lines(res.stdout)
    assert sorted(lines) == [0, 1], res.stdout
    cores = len(os.sched_getaffinity(0))
    for line in lines.values():
        assert "world=2 " in line and "sum=3 " in line
        assert f"omp={max(1, cores // 2)} " in line
        assert line.endswith("argv=['--flag', 'x']")  # no --local_rank in the torchrun spelling


@pytest.mark.timeout(90)
def test_failing_rank_stops_the_job():
    start = time.monotonic()
    res = zeroshard("run", "--nproc", "2", "tests/scripts/fail.py", timeout=60)
    elapsed = time.monotonic() - start
    assert res.returncode != 0
    assert elapsed < 30, f"took {elapsed:.1f}s"
    assert "boom-rank-1" in res.stderr
    # the summary names the rank that raised, not the one stopped in the barrier
    assert "FAILED: rank 1 " in res.stderr, res.stderr
    assert "rank 1 error: ValueError: boom-rank-1" in res.stderr
    # one traceback (the root cause's, in the launcher's summary), not one per rank
    assert res.stderr.count("Traceback (most recent call last)") == 1, res.stderr
    assert "zeroshard: also failed: rank 0: " in res.stderr, res.stderr


@pytest.mark.timeout(90)
def test_deepspeed_spelling(tmp_path):
    cfg = "examples/ds_config_demo.json"  # the launcher checks it before starting workers
    res = zeroshard("--num_gpus", "2", "tests/scripts/ok.py", "--deepspeed", cfg)
    assert res.returncode == 0, res.stderr
    lines = ok_lines(res.stdout)
    assert sorted(lines) == [0, 1], res.stdout
    for rank, line in lines.items():  # DeepSpeed passes --local_rank first, then the args
        assert line.endswith(f"argv=['--local_rank={rank}', '--deepspeed', '{cfg}']"), line


@pytest.mark.timeout(90)
def test_a_script_exiting_is_quoted_once():
    """argparse refusing DeepSpeed's --local_rank=N on every rank: the summary quotes
    the message (not just `SystemExit: 2`), with the script's exit code."""
    res = zeroshard("--num_gpus", "2", "tests/scripts/args.py", "--flag", "y")
    assert res.returncode == 2, res.stderr
    assert re.search(r"^zeroshard: FAILED: rank [01] .* exited with code 2$", res.stderr, re.M)
    quoted = "error: unrecognized arguments: --local_rank="
    error = re.search(r"^zeroshard: rank [01] error: (.*)$", res.stderr, re.M)
    assert error and quoted in error.group(1) and "(exit code 2)" in error.group(1), res.stderr
    assert re.search(r"^zeroshard: also failed: rank [01]: .*" + quoted, res.stderr, re.M)
    assert "Traceback" not in res.stderr and "SystemExit" not in res.stderr, res.stderr


@pytest.mark.timeout(90)
def test_config_checked_once_before_any_worker(tmp_path):
    """Three typos: one report of the three, by the launcher, in a few lines; no worker
    starts (the script would write a marker). A missing config: one line."""
    bad = tmp_path / "bad.json"
    bad.write_text(
        '{"train_micro_batch_size_per_gpu": 8, "gradient_acumulation_steps": 1,\n'
        ' "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betaz": [0.9, 0.95]}},\n'
        ' "zero_optimization": {"stage": 3, "overlap_com": true}}\n'
    )
    marker = tmp_path / "started"
    script = tmp_path / "train.py"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    res = zeroshard("run", "--nproc", "2", str(script), "--deepspeed_config", str(bad))
    assert res.returncode == 2 and not marker.exists(), res.stderr
    lines = res.stderr.splitlines()
    assert lines == [
        f"zeroshard: error: 3 problems in {bad}:",
        "  gradient_acumulation_steps: unknown key; did you mean 'gradient_accumulation_steps'?",
        "  optimizer.params.betaz: unknown key; did you mean 'betas'?",
        "  zero_optimization.overlap_com: unknown key; did you mean 'overlap_comm'?",
        "zeroshard: no worker started (the config of --deepspeed_config; --no-config-check "
        "starts them anyway)",
    ], res.stderr
    missing = tmp_path / "nosuch.json"
    res = zeroshard("--num_gpus", "2", str(script), f"--deepspeed={missing}")
    assert res.returncode == 2 and not marker.exists(), res.stderr
    assert res.stderr.splitlines()[0] == f"zeroshard: error: {missing}: config file not found"


def test_config_found_on_the_command_line(tmp_path):
    from zeroshard.tools.launch.config import find_config_arg

    ds = tmp_path / "ds.json"
    ds.write_text('{"train_batch_size": 8} // a DeepSpeed config')
    other = tmp_path / "model.json"  # a script's own --config file: not ours to check
    other.write_text('{"hidden_size": 64}')
    found = lambda *argv: (c.flag, c.path) if (c := find_config_arg(list(argv))) else None  # noqa: E731
    assert found("--deepspeed_config", "a.yaml") == ("--deepspeed_config", "a.yaml")
    assert found("--deepspeed", "--deepspeed_config", "c.json") == ("--deepspeed_config", "c.json")
    assert found("--deepspeed", "c.json", "--lr", "1") == ("--deepspeed", "c.json")
    assert found("--deepspeed=c.json") == ("--deepspeed", "c.json")
    assert found("--deepspeed", "{}") is None  # Hugging Face also takes inline JSON
    assert found("--config", str(ds)) == ("--config", str(ds))
    assert found(f"--config={other}") is None and found("--config", "x.yaml") is None
    assert found("--model", "x.json", "--deepspeed") is None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(90)
def test_two_nodes_on_one_machine():
    """Two launchers, as on two nodes: static rendezvous, node 1 runs the module form."""
    common = ["run", "--nnodes", "2", "--nproc", "1", "--master-addr", "127.0.0.1"]
    common += ["--master-port", str(_free_port())]
    procs = []
    for rank, target in ((1, ["-m", "ok"]), (0, ["ok.py"])):
        argv = [*ZEROSHARD, *common, "--node-rank", str(rank), *target, f"node{rank}"]
        procs.append(subprocess.Popen(argv, cwd=SCRIPTS, env=_env(), text=True, **PIPES))
    try:
        outs = [p.communicate(timeout=60) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err
    (node1_out, _), (node0_out, _) = outs
    assert "OK rank=0 world=2 " in node0_out and "argv=['node0']" in node0_out
    assert "OK rank=1 world=2 " in node1_out and "argv=['node1']" in node1_out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


@pytest.mark.timeout(90)
def test_sigterm_stops_all_ranks():
    argv = [*ZEROSHARD, "run", "--nproc", "2", "tests/scripts/hang.py"]
    proc = subprocess.Popen(argv, cwd=ROOT, env=_env(), text=True, **PIPES)
    assert proc.stdout is not None
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 45
        while len(pids) < 2 and time.monotonic() < deadline:
            line = proc.stdout.readline()
            pids += [int(pid) for pid in re.findall(r"READY rank=\d+ pid=(\d+)", line)]
        assert len(pids) == 2, "ranks did not start"
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        assert proc.returncode != 0
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(p) for p in pids)
    finally:  # ranks run in their own sessions: kill them by pid, then the launcher
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        proc.kill()
        proc.communicate(timeout=30)


@pytest.mark.timeout(90)
def test_ctrl_c_prints_one_line_per_rank():
    """Ctrl-C (SIGINT to the launcher, which forwards it): each rank says in one line
    where it was, the launcher says it stopped them; no KeyboardInterrupt tracebacks."""
    argv = [*ZEROSHARD, "run", "--nproc", "2", "tests/scripts/hang.py"]
    proc = subprocess.Popen(argv, cwd=ROOT, env=_env(), text=True, **PIPES)
    assert proc.stdout is not None
    try:
        ready = 0
        deadline = time.monotonic() + 45
        while ready < 2 and time.monotonic() < deadline:
            ready += "READY rank=" in proc.stdout.readline()
        assert ready == 2, "ranks did not start"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    lines = err.splitlines()
    assert "Traceback" not in err and len(lines) <= 3, err
    assert lines[-1] == "zeroshard: stopped by SIGINT; workers stopped", err
    said = sorted(line.split(":")[0] for line in lines[:-1])
    assert said in (["[rank0]", "[rank1]"], ["[rank0]"], ["[rank1]"], []), err
    for line in lines[:-1]:
        assert re.fullmatch(r"\[rank[01]\]: interrupted at .*hang\.py:\d+ in <module>.*", line), err


def test_usage_errors():
    res = zeroshard("run", "--nproc", "2", "tests/scripts/no_such_script.py", timeout=60)
    assert res.returncode == 2 and "script not found" in res.stderr
    res = zeroshard("--version", timeout=60)
    assert res.returncode == 0 and res.stdout.startswith("zeroshard ")
    res = zeroshard("run", "--help", timeout=60)
    assert res.returncode == 0 and "every node" in res.stdout


def test_c10d_rendezvous_is_hosted_by_node_zero():
    # with node ranks known, node 0's launcher hosts the c10d store whatever the start
    # order of the launchers (two "nodes" on one machine would otherwise race for it)
    from zeroshard.tools.launch.launcher import torchrun_argv

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    for rank, host in ((0, "true"), (1, "false")):
        argv = ["--nnodes", "2", "--node-rank", str(rank), "--master-addr", "127.0.0.1"]
        argv += ["--master-port", "29500", "--rdzv-backend", "c10d", "train.py"]
        args = parser.parse_args(argv)
        out = torchrun_argv(args, plan_layout(args, device_count=0))
        i = out.index("--rdzv-conf")
        assert out[i + 1] == f"is_host={host}", out
    argv = ["--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", "29500", "t.py"]
    args = parser.parse_args(argv)
    assert "--rdzv-conf" not in torchrun_argv(args, plan_layout(args, device_count=0))


class _Failure:
    """What torchelastic's ProcessFailure gives report_failure: a rank's error file's
    message (or torch's stand-in text without one), its exit code and when."""

    def __init__(self, exitcode: int, message: Any, timestamp: float, local_rank: int) -> None:
        self.exitcode, self.message, self.timestamp = exitcode, message, timestamp
        self.local_rank, self.pid = local_rank, 100 + local_rank

    def signal_name(self) -> str:
        return signal.Signals(-self.exitcode).name if self.exitcode < 0 else "<N/A>"


def _error_file(text: str, when: float) -> dict:
    return {"message": text, "extraInfo": {"zeroshard_time": str(when), "zeroshard_brief": "1"}}


def test_a_rank_stopped_after_its_own_error_is_quoted(capsys) -> None:
    """A rank that wrote its own error and was then stopped by the launcher (every rank
    is stopped once one fails: a race under load) is reported with its error, not only
    as stopped; a rank stopped before it wrote one, as stopped."""
    no_file = "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html"
    err = argparse.Namespace(
        failures={
            1: _Failure(
                2, _error_file("args.py: error: bad --local_rank=1 (exit code 2)", 1.0), 1.0, 1
            ),
            0: _Failure(
                -signal.SIGTERM,
                _error_file("args.py: error: bad --local_rank=0 (exit code 2)", 1.1),
                1.2,
                0,
            ),
            2: _Failure(-signal.SIGTERM, no_file, 1.3, 2),
        }
    )
    assert report_failure(err) == 2
    out = capsys.readouterr().err
    assert re.search(r"^zeroshard: FAILED: rank 1 .* exited with code 2$", out, re.M), out
    assert (
        "zeroshard: also failed: rank 0: args.py: error: bad --local_rank=0 (exit code 2) (then stopped by the launcher (SIGTERM))"
        in out
    ), out
    assert "zeroshard: also failed: rank 2: stopped by the launcher (SIGTERM)" in out, out

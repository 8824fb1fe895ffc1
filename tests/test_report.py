"""`zeroshard report`: text and JSON output, disk speed probe, and probe isolation."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from zeroshard.tools import report

ROOT = Path(__file__).resolve().parents[1]


def zeroshard(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "zeroshard.tools.cli", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.timeout(120)
def test_text_report():
    res = zeroshard("report")
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert torch.__version__ in out
    assert re.search(r"gloo \.+ yes", out)
    assert re.search(r"fused CPU AdamW \.+ (yes|no|unavailable)", out)
    for section in ("[torch]", "[distributed backends]", "[devices]", "[dtype support]"):
        assert section in out
    assert re.search(r"bf16 matmul \.+ ", out) and "fp8" in out
    assert re.search(r"total GiB \.+ [\d.]+", out)


@pytest.mark.timeout(120)
def test_json_report_with_disk_speed(tmp_path):
    res = zeroshard("report", "--json", "--nvme-path", str(tmp_path), "--nvme-size-mb", "16")
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert data["torch"]["version"] == torch.__version__
    assert data["distributed backends"]["gloo"] == "yes"
    assert data["dtype support"]["cpu"]["bf16 matmul"] == "yes"
    speed = data["nvme/disk speed"]
    assert speed["write GB/s"] > 0 and speed["read GB/s"] > 0, speed
    assert speed["file MiB"] == 16
    assert list(tmp_path.iterdir()) == []  # the test file is removed


def test_disk_speed_in_text(tmp_path):
    text = report.render({"nvme/disk speed": report.disk_speed(tmp_path, size_mb=4)})
    assert re.search(r"write GB/s \.+ \d+\.\d+", text)
    assert re.search(r"read GB/s \.+ \d+\.\d+", text)


def test_failing_probe_is_reported_not_raised(tmp_path, monkeypatch):
    missing = tmp_path / "missing"
    got = report.collect(nvme_path=str(missing), nvme_size_mb=1)
    assert got["nvme/disk speed"].startswith("unavailable: FileNotFoundError")

    def broken() -> dict:
        raise RuntimeError("probe exploded\nsecond line")

    monkeypatch.setattr(report, "_cpu", broken)
    got = report.collect()
    assert got["cpu"] == "unavailable: RuntimeError: probe exploded"
    assert got["torch"]["version"] == torch.__version__  # the other probes still ran
    assert "[cpu] unavailable: RuntimeError: probe exploded" in report.render(got)

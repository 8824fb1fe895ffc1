"""Bubble measurement, bubble formulas and the timeline PNG (no processes: synthetic traces)."""

import json

import pytest

from zeroshard.parallel.pipeline.plot import (
    bubble_fractions,
    main,
    mean_bubble,
    plot_timeline,
    theoretical_bubble,
)


def _orders(schedule: str, p: int, m: int) -> list[list[tuple[str, int]]]:
    """Per stage, the order of its actions: GPipe (all F then all B) or 1F1B."""
    out = []
    for s in range(p):
        if schedule == "gpipe":
            out.append([("F", i) for i in range(m)] + [("B", i) for i in range(m)])
            continue
        warm = min(p - s - 1, m)
        order = [("F", i) for i in range(warm)]
        f, b = warm, 0
        while b < m:
            if f < m:
                order.append(("F", f))
                f += 1
            order.append(("B", b))
            b += 1
        out.append(order)
    return out


def simulate(schedule: str, p: int, m: int, t_f: float = 1.0, t_b: float = 2.0) -> list[dict]:
    """Run the per-stage orders as early as dependencies allow; the trace the engine would record."""
    orders = _orders(schedule, p, m)
    done: dict[tuple[str, int, int], float] = {}
    free = [0.0] * p
    pos = [0] * p
    trace = []
    while any(pos[s] < len(orders[s]) for s in range(p)):
        progressed = False
        for s in range(p):
            if pos[s] == len(orders[s]):
                continue
            kind, mb = orders[s][pos[s]]
            dep = (
                ("F", s - 1, mb)
                if kind == "F"
                else (("B", s + 1, mb) if s + 1 < p else ("F", s, mb))
            )
            if kind == "F" and s == 0:
                ready = 0.0
            elif dep in done:
                ready = done[dep]
            else:
                continue
            start = max(free[s], ready)
            end = start + (t_f if kind == "F" else t_b)
            trace.append(
                {
                    "stage": s,
                    "kind": kind,
                    "microbatch": mb,
                    "chunk": 0,
                    "t_start": start,
                    "t_end": end,
                }
            )
            done[(kind, s, mb)] = free[s] = end
            pos[s] += 1
            progressed = True
        assert progressed, "deadlocked order"
    return trace


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 4), (3, 1)])
def test_simulated_schedules_match_formula(schedule, p, m):
    trace = simulate(schedule, p, m)
    fr = bubble_fractions(trace)
    assert sorted(fr) == list(range(p))
    expect = theoretical_bubble(schedule, p, m)
    assert expect == pytest.approx((p - 1) / (m + p - 1))
    for s, f in fr.items():
        assert f == pytest.approx(expect, abs=1e-12), s
    assert mean_bubble(trace) == pytest.approx(expect)


def test_bubble_counts_only_compute_and_overlaps_once():
    trace = [
        {"stage": 0, "kind": "F", "microbatch": 0, "chunk": 0, "t_start": 0.0, "t_end": 2.0},
        {"stage": 0, "kind": "send", "microbatch": 0, "chunk": 0, "t_start": 2.0, "t_end": 3.0},
        {"stage": 0, "kind": "BW", "microbatch": 0, "chunk": 0, "t_start": 1.0, "t_end": 2.5},
        {"stage": 1, "kind": "F", "microbatch": 0, "chunk": 0, "t_start": 3.0, "t_end": 4.0},
    ]
    fr = bubble_fractions(trace)
    assert fr[0] == pytest.approx(1 - 2.5 / 4)  # [0, 2.5] busy, the send is not compute
    assert fr[1] == pytest.approx(0.75)
    with pytest.raises(ValueError, match="empty pipeline trace"):
        bubble_fractions([])


def test_formulas():
    assert theoretical_bubble("1f1b", 4, 8) == pytest.approx(3 / 11)
    assert theoretical_bubble("interleaved_1f1b", 4, 8, virtual=2) == pytest.approx(3 / 19)
    assert theoretical_bubble("interleaved_1f1b", 4, 8, virtual=1) == theoretical_bubble(
        "1f1b", 4, 8
    )
    # ZB-H1 with F = B = W: a third of 1F1B's bubble time over the same busy time
    zb = theoretical_bubble("zb_h1", 4, 8)
    assert zb == pytest.approx(3 / (8 * 3 + 3))
    assert zb < theoretical_bubble("1f1b", 4, 8)
    assert theoretical_bubble("1f1b", 1, 8) == 0.0
    with pytest.raises(ValueError, match="no bubble formula for schedule 'zb_v'"):
        theoretical_bubble("zb_v", 4, 8)
    with pytest.raises(ValueError, match="one chunk per stage"):
        theoretical_bubble("1f1b", 4, 8, virtual=2)


def test_timeline_png_and_cli(tmp_path, capsys):
    trace = simulate("1f1b", 4, 6)
    trace[0]["chunk"] = 1  # two chunks: labels become mb.chunk
    out = plot_timeline(trace, str(tmp_path / "t.png"))
    with open(out, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(simulate("gpipe", 2, 3)))
    assert main([str(path)]) == 0
    text = capsys.readouterr().out
    assert "stage 1: bubble 0.250" in text
    assert (tmp_path / "trace.png").stat().st_size > 1000

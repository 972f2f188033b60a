"""Horovod's autotune (HOROVOD_AUTOTUNE=1) in real kolo run jobs of torch
ranks (`autotune_ranks.py`): rank 0's log has upstream's header and one
row per score, the parameters change from score to score while every
rank's sums stay right (the ranks fuse alike), the last row is the best
tried, and a threshold the user set stays in every row."""

import csv
import os
import sys

from ddp_step import torch_or_skip

torch_or_skip()

import watch  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
RANKS = os.path.join(HERE, "autotune_ranks.py")
KOLO = os.path.join(os.path.dirname(sys.executable), "kolo")
HEADER = "hierarchical_allreduce,hierarchical_allgather,torus_allreduce,cache_enabled,cycle_time_ms,tensor_fusion_threshold,score"
MAX_SAMPLES = 4
# the search's scores (one more than the most, as upstream), the cache the other way, the best
ROWS = MAX_SAMPLES + 1 + 1 + 1


def tune(tmp_path, **extra):
    log = tmp_path / "autotune.csv"
    env = {
        **os.environ,
        "HOROVOD_AUTOTUNE": "1",
        "HOROVOD_AUTOTUNE_LOG": str(log),
        "HOROVOD_AUTOTUNE_WARMUP_SAMPLES": "1",
        "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE": "2",
        "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES": str(MAX_SAMPLES),
        **extra,
    }
    out = watch.run([KOLO, "run", "-np", "2", "--", sys.executable, RANKS, str(log), str(ROWS)], timeout=240, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    oks = [line for line in out.stdout.splitlines() if ":ok autotune " in line]
    assert len(oks) == 2, out.stdout
    text = log.read_text()
    assert text.splitlines()[0] == HEADER
    rows = list(csv.reader(text.splitlines()[1:]))
    assert len(rows) == ROWS, text
    for row in rows:
        assert len(row) == 7 and row[:3] == ["0", "0", "0"] and row[3].strip() in ("0", "1"), row
        assert float(row[6]) > 0, row
    return rows


def test_autotune_tries_parameters_agreed_by_every_rank_and_settles_on_the_best(tmp_path):
    rows = tune(tmp_path)
    # upstream's first test points (cycle ms, threshold MiB), in order
    assert (rows[0][4], rows[0][5]) == ("5", "4") and (rows[1][4], rows[1][5]) == ("50", "32"), rows
    assert len({(r[4], r[5]) for r in rows}) >= 3, rows
    # the cache was tried the other way once
    assert len({r[3].strip() for r in rows}) == 2, rows
    best = max(rows[:-1], key=lambda r: float(r[6]))
    assert rows[-1] == best, rows


def test_a_fusion_threshold_the_user_set_stays_fixed(tmp_path):
    rows = tune(tmp_path, HOROVOD_FUSION_THRESHOLD=str(2 << 20))
    assert all(r[5] == "2" for r in rows), rows
    assert len({r[4] for r in rows}) >= 3, rows

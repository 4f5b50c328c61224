"""`ddiloco experiment`'s arguments, refused in one line before any work: a non-empty `--out` (two experiments'
files would mix) and a seed outside 0..2**63 - 1."""

from __future__ import annotations

import pytest

from ddiloco.cli import main
from ddiloco.run_config import MAX_SEED


def test_a_non_empty_out_directory_is_refused_before_any_work(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "results.json").write_text("{}")
    assert main(["experiment", "failures", "--quick", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--out" in err and "not empty" in err, err
    assert sorted(p.name for p in out.iterdir()) == ["results.json"]
    assert (out / "results.json").read_text() == "{}"


@pytest.mark.parametrize("seed", ["-1", str(MAX_SEED + 1), "99999999999999999999"])
def test_a_seed_out_of_range_is_refused_before_any_work(tmp_path, capsys, seed):
    out = tmp_path / "out"
    assert main(["experiment", "failures", "--quick", "--seed", seed, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--seed" in err and str(MAX_SEED) in err, err
    assert not out.exists()


def test_a_column_of_seconds_reads_in_one_format():
    # `experiment failures` printed 224 and 161 beside 70.5722 and 55.2505 in its virtual_time_s column.
    from ddiloco.sim.report import format_value

    assert [format_value("virtual_time_s", v) for v in (224.0, 70.5722, 5)] == ["224.0 s", "70.6 s", "5.0 s"]

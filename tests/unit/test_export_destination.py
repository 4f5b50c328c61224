"""`ddiloco export RUN --out FILE`: a destination that would destroy the run, or that cannot be written, is refused in
one line (exit status 2), and the run's files are left as they were. An --out of the run's own config.json once
overwrote it with the export (exit 0), and the run could no longer be resumed or exported."""

from __future__ import annotations

import hashlib
import os
import stat

import pytest
import torch
from safetensors import safe_open

from ddiloco.cli import main
from ddiloco.run_config import RunConfig
from ddiloco.runtime.syncer_state import GENESIS_FILE, GenesisRecord, write_genesis

EXIT_USAGE = 2


@pytest.fixture
def run_dir(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    RunConfig().save(run_dir / "config.json")
    params = {f"layer{i}.weight": torch.full((2, 3), float(i)) for i in range(RunConfig().diloco.num_fragments)}
    write_genesis(run_dir, GenesisRecord(params, (), "a test", ()))
    return run_dir


def digest(directory) -> dict[str, str]:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("inside", ["config.json", GENESIS_FILE, "learners/0/model.safetensors",
                                    "./sub/../config.json", "summary.json", "model.pt"])
def test_an_out_inside_the_run_directory_is_refused_and_the_run_is_untouched(run_dir, capsys, inside):
    before = digest(run_dir)
    out = run_dir / inside
    assert main(["export", str(run_dir), "--out", str(out)]) == EXIT_USAGE
    err = capsys.readouterr().err
    root = run_dir.resolve()
    assert err == (f"ddiloco export: error: --out {out} would replace a file of the run directory {run_dir}, which the "
                   f"run needs: write the export elsewhere, e.g. --out {root.parent / 'model.safetensors'}, or as a "
                   f"new {root / 'export.safetensors'}\n")
    assert digest(run_dir) == before


def test_an_export_next_to_the_runs_files_may_be_written_again_but_no_other_safetensors_file_replaced(run_dir, capsys):
    # RUN/export.safetensors, where the project's own tests and a user keep it, refused by the first version of this
    # check; an existing .safetensors file that is no export stays the run's (or the user's).
    out = run_dir / "export.safetensors"
    assert main(["export", str(run_dir), "--out", str(out)]) == 0
    assert main(["export", str(run_dir), "--out", str(out)]) == 0      # the same export, again
    capsys.readouterr()
    other = run_dir / "weights.safetensors"
    other.write_bytes(out.read_bytes().replace(b"ddiloco_run", b"someone_run"))
    before = digest(run_dir)
    assert main(["export", str(run_dir), "--out", str(other)]) == EXIT_USAGE
    assert "would replace a file of the run directory" in capsys.readouterr().err
    assert digest(run_dir) == before


def test_an_out_reached_through_a_symlink_to_the_run_directory_is_refused(run_dir, tmp_path, capsys):
    link = tmp_path / "link"
    link.symlink_to(run_dir)
    before = digest(run_dir)
    assert main(["export", str(run_dir), "--out", str(link / "config.json")]) == EXIT_USAGE
    assert "would replace a file of the run directory" in capsys.readouterr().err
    assert digest(run_dir) == before


@pytest.mark.parametrize("out", ["/proc/x.safetensors", "/dev/null/x.safetensors"])
def test_an_out_that_cannot_be_written_is_one_line(run_dir, capsys, out):
    assert main(["export", str(run_dir), "--out", out]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith(f"ddiloco export: error: --out {out}: cannot write there (") and err.count("\n") == 1, err
    assert "Traceback" not in err


def test_an_out_next_to_the_run_directory_is_written(run_dir, tmp_path, capsys):
    out = tmp_path / "exports" / "model.safetensors"
    assert main(["export", str(run_dir), "--out", str(out)]) == 0
    assert out.is_file()


def test_an_out_that_is_no_regular_file_is_refused_and_left_as_it_was(run_dir, tmp_path, capsys):
    # A FIFO (and, as root, a device such as /dev/full) was renamed over by the export: exit 0, the node gone.
    fifo = tmp_path / "fifo.safetensors"
    os.mkfifo(fifo)
    assert main(["export", str(run_dir), "--out", str(fifo)]) == EXIT_USAGE
    assert capsys.readouterr().err == (f"ddiloco export: error: --out {fifo} is a FIFO, not a regular file: give "
                                       "the path of a new file or of an earlier export\n")
    assert stat.S_ISFIFO(fifo.lstat().st_mode)


def test_an_out_that_is_a_symlink_writes_the_file_it_points_to_and_keeps_the_link(run_dir, tmp_path, capsys):
    target, link = tmp_path / "models" / "real.safetensors", tmp_path / "link.safetensors"
    target.parent.mkdir()
    link.symlink_to(target)
    assert main(["export", str(run_dir), "--out", str(link)]) == 0
    assert capsys.readouterr().out.startswith(f"wrote {link} (the link's file {target}): ")
    assert link.is_symlink() and link.resolve() == target
    with safe_open(str(target), framework="pt") as file:
        assert "ddiloco_run" in file.metadata()


@pytest.mark.parametrize("content", [b"import torch\nprint('my training script')\n", b""])
def test_an_existing_file_that_is_no_safetensors_file_is_refused_and_kept(run_dir, tmp_path, capsys, content):
    # A mistyped `--out train.py` replaced the user's script with the export (exit 0), as cp would.
    script = tmp_path / "train.py"
    script.write_bytes(content)
    assert main(["export", str(run_dir), "--out", str(script)]) == EXIT_USAGE
    assert capsys.readouterr().err == (f"ddiloco export: error: --out {script} exists and is not a safetensors file: "
                                       "an export replaces only an earlier one; remove it first or give another "
                                       "path\n")
    assert script.read_bytes() == content


def test_an_existing_safetensors_file_outside_the_run_is_replaced(run_dir, tmp_path, capsys):
    out = tmp_path / "model.safetensors"
    assert main(["export", str(run_dir), "--out", str(out)]) == 0
    assert main(["export", str(run_dir), "--out", str(out), "--dtype", "bfloat16"]) == 0
    with safe_open(str(out), framework="pt") as file:
        assert file.get_tensor("layer0.weight").dtype == torch.bfloat16


def test_an_empty_out_is_refused_by_name(run_dir, capsys):
    assert main(["export", str(run_dir), "--out", ""]) == EXIT_USAGE
    assert capsys.readouterr().err == ("ddiloco export: error: --out is empty: give a file path such as "
                                       "model.safetensors\n")


def test_the_export_line_counts_a_tied_weight_once(tmp_path, capsys):
    # A tied GPT-2 was reported as `29 parameters, 30,080 values` where the model has 28 and 28,032.
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    RunConfig().save(run_dir / "config.json")
    params = {f"layer{i}.weight": torch.ones(2, 3) for i in range(RunConfig().diloco.num_fragments)}
    write_genesis(run_dir, GenesisRecord(params, (), "a test", (("head.weight", "layer0.weight"),)))
    out = tmp_path / "model.safetensors"
    assert main(["export", str(run_dir), "--out", str(out)]) == 0
    assert capsys.readouterr().out.startswith(f"wrote {out}: 4 parameters (and 1 tied under a second name), 24 values "
                                              "in float32, the global model after 0 rounds")
    with safe_open(str(out), framework="pt") as file:
        assert sorted(file.keys()) == ["head.weight", *sorted(params)]

"""What a source distribution carries: the package with its data, and what the README and `--help` point to (the docs,
the examples) and the license its metadata names. Until 2026-12-07 the sdist had no docs/, examples/ or LICENSE (an
install probe), and the wheel no `py.typed`."""

import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_sdist_holds_the_docs_the_examples_the_license_and_the_package_data(tmp_path):
    # From a copy without the checkout's build products: setuptools adds every file an earlier build's
    # `*.egg-info/SOURCES.txt` lists, so in the checkout itself the check passed whatever MANIFEST.in said.
    source = tmp_path / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".git", ".venv", "*.egg-info", "__pycache__", "build",
                                                                "dist", "runs", ".diag", ".whl", "*.so"))
    done = subprocess.run([sys.executable, "setup.py", "-q", "sdist", "-d", str(tmp_path)], cwd=source,
                          capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stderr[-2000:]
    (sdist,) = tmp_path.glob("ddiloco-*.tar.gz")
    with tarfile.open(sdist) as tar:
        names = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    wanted = {"LICENSE", "README.md", "docs/runtime.md", "docs/your_model.md", "examples/mlp.py",
              "examples/slurm/ddiloco.sbatch", "src/ddiloco/py.typed", "src/ddiloco/_kernels.c",
              "src/ddiloco/transport/wire.proto"}
    assert wanted - names == set()
    assert any(name.startswith("src/ddiloco/corpus/") and name.endswith(".gz") for name in names)
    assert any(name.startswith("docs/img/") for name in names)

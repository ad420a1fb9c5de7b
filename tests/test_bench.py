"""The benchmarks run (tiny mode): behaviour only, no timing assertions."""
import re
import subprocess
import sys

from conftest import REPO, clean_env


def test_compare_reference_tiny_mode_prints_the_table(fashion_dir):
    proc = subprocess.run([sys.executable, "bench/compare_reference.py", "--tiny"], cwd=REPO, env=clean_env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ")]
    assert any("plain DDP recipe" in r for r in rows) and any("train/mnist.py" in r for r in rows)
    assert any("compute-only floor" in r for r in rows)
    assert all("| 500 |" in r for r in rows if "recipe" in r or "train/mnist.py" in r)  # both evaluated 500 samples
    assert re.search(r"RATIO ours/reference epoch time = \d+\.\d+", proc.stdout)

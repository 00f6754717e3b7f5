"""lab/check_results.py: the committed release results keep their contract (run on this
repository, as CI runs the lab's CPU checks), and a broken result is one line and exit 1."""

import json
import shutil
import subprocess
import sys

from tests.conftest import CHECKOUT

SCRIPT = CHECKOUT / "lab" / "check_results.py"


def run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True)


def test_the_committed_results_keep_the_contract():
    out = run()
    assert out.returncode == 0, out.stdout + out.stderr
    assert "keep the contract" in out.stdout or "no committed GPU results" in out.stdout


def test_a_broken_result_is_one_line_per_problem(tmp_path):
    files = sorted((CHECKOUT / "bench" / "results").glob("*/????-??-??-nvidia-h200.json"), key=lambda f: f.name)
    if not files:
        assert run(tmp_path).returncode == 0  # nothing to check
        return
    latest = files[-1]
    folder = tmp_path / "bench" / "results" / latest.parent.name
    folder.mkdir(parents=True)
    r = json.loads(latest.read_text())
    r["baselines"] = {k: v for k, v in r["baselines"].items() if k != "hf_eager"}
    r["configs"][0]["per_workload"] = {"prose": {"tau": 0.5, "tok_s": 1.0, "speedup": 1.0}}
    (folder / latest.name).write_text(json.dumps(r))
    (tmp_path / "BENCHMARKS.md").write_text("# Benchmarks\n")
    out = run(tmp_path)
    lines = out.stdout.splitlines()
    assert out.returncode == 1 and len(lines) == 3, out.stdout
    assert "baselines" in lines[0] and "tau 0.5 below 1.0" in lines[1] and "does not link" in lines[2]
    shutil.copy(CHECKOUT / "BENCHMARKS.md", tmp_path / "BENCHMARKS.md")
    shutil.copy(latest, folder / latest.name)
    assert run(tmp_path).returncode == 0

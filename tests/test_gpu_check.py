"""`make gpu-check` (bench/gpu/) stays runnable on a machine that has no GPU to run it: the script
parses, its dry run names every step, the wheels it unpacks are only those missing, and its burst
workload runs end to end on the CPU (a smoke run of the script, not a figure)."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "gpu" / "gpu-check.sh"
STEPS = ["environment", "dependencies", "checkpoint", "gpu_tests", "nvml_record", "workload_a", "online", "summary"]


def test_the_script_parses_and_its_dry_run_prints_each_step(tmp_path):
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    run = subprocess.run(["bash", str(SCRIPT), "--dry-run"], capture_output=True, text=True, check=True,
                         env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path / "out")})
    lines = [line for line in run.stdout.splitlines() if line.startswith("step ")]
    assert [line.split()[2] for line in lines] == STEPS
    assert all(line.startswith(f"step {i}/8 ") for i, line in enumerate(lines, 1))
    assert "--preset 1b --dtype bfloat16" in run.stdout and "-m gpu" in run.stdout
    assert f"--out {tmp_path / 'out'}/workload_a.json" in run.stdout
    assert not (tmp_path / "out").exists()  # a dry run writes nothing


def test_only_the_wheels_this_python_lacks_are_unpacked(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for name, module in (("present", "json"), ("absent", "inferops_surely_absent_module")):
        with zipfile.ZipFile(wheels / f"{name}-1.0-py3-none-any.whl", "w") as wheel:
            wheel.writestr(f"{module}/__init__.py", "VALUE = 1\n")
            wheel.writestr(f"{name}-1.0.dist-info/METADATA", "Name: x\n")
    site = tmp_path / "site"
    run = subprocess.run([sys.executable, str(ROOT / "bench/gpu/unpack_missing.py"), str(wheels), str(site)],
                         capture_output=True, text=True, check=True)
    assert (site / "inferops_surely_absent_module" / "__init__.py").is_file()
    assert not (site / "json").exists()
    assert "kept this machine's json" in run.stdout
    missing = subprocess.run([sys.executable, str(ROOT / "bench/gpu/unpack_missing.py"), str(tmp_path / "none"),
                              str(site)], capture_output=True, text=True)
    assert missing.returncode == 1 and "gpu-check.sh bundle" in missing.stdout


def test_workload_a_runs_end_to_end_on_the_cpu(tmp_path, tiny_llama_dir):
    out = tmp_path / "burst.json"
    subprocess.run([sys.executable, str(ROOT / "bench/gpu/workloads.py"), "burst", "--model", str(tiny_llama_dir),
                    "--device", "cpu", "--prompts", "3", "--input-len", "12", "--output-len", "4", "--out", str(out)],
                   check=True, capture_output=True, cwd=ROOT)
    result = json.loads(out.read_text())
    assert result["engine"]["output_tokens"] == result["transformers_static_batch"]["output_tokens"] == 12
    assert result["workload"] == {"prompts": 3, "input_len": 12, "output_len": 4}
    assert result["ratio"] > 0 and result["target"] == ">= 3.0x"

"""bench/accelerator.sh, the one script for a GPU or TPU host, runs here in its dry mode."""

import json
import os
import subprocess

from conftest import REPO_ROOT


def test_the_accelerator_script_runs_its_rows_and_names_the_device(tmp_path):
    out = tmp_path / "results.json"
    done = subprocess.run(
        ["bash", os.path.join(REPO_ROOT, "bench", "accelerator.sh"), "--dry", "--out", str(out),
         "--only", "anakin-ppo-cartpole-preset", "anakin-ppo-brax-ant-4k-envs", "envs-jumanji-64-envs"],
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads(out.read_text())
    assert json.loads(done.stdout.strip().splitlines()[-1]) == results  # the last line is the same JSON
    assert "cpu" in results["device"] and results["dry"] is True
    ran, skipped, script = results["rows"]
    assert ran["row"] == "anakin-ppo-cartpole-preset" and ran["status"] == "ok", ran
    assert ran["env_steps"] >= 4096 and ran["sps"] > 0 and ran["compile_s"] > 0
    assert skipped == {"row": "anakin-ppo-brax-ant-4k-envs", "status": "not run in --dry"}
    # A bench script's row keeps the script's own JSON result (dry: CartPole's raw and PPO steps/s).
    assert script["row"] == "envs-jumanji-64-envs" and script["status"] == "ok", script
    cartpole = script["result"]["CartPole-v1"]
    assert cartpole["raw_sps"] > 0 and cartpole["ppo_sps"] > 0 and cartpole["ppo_over_raw"] > 0

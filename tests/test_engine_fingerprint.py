"""The engine's results are bit-identical to the pinned fingerprint (a guard for speed-ups of the engine and rules)."""

import json
import os
import subprocess
import sys

from hetpipe_jax.paths import REPO_ROOT

# scripts/engine_fingerprint.py --quick, measured on the engine before issue 10's speed-ups and unchanged by them.
# A change to the engine's or the rules' results changes it: if that change is intended, check it, then update this
# value (the script's --per_case names the cases that changed).
QUICK_FINGERPRINT = "85b92bf488b51b669a368248b70a03af94b015498bf961b2f0c22e2e3a47c2eb"


def test_engine_results_match_the_pinned_fingerprint():
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["PYTHONPATH"] = str(REPO_ROOT)
  proc = subprocess.run([sys.executable, "scripts/engine_fingerprint.py", "--quick"], cwd=REPO_ROOT, env=env,
                        capture_output=True, text=True, timeout=120, check=False)
  assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]  # hooks or timing-only mode changed a result
  out = json.loads(proc.stdout)
  assert out["quick"] is True and out["num_cases"] == 16
  assert out["fingerprint"] == QUICK_FINGERPRINT

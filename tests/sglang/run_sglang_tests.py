#!/usr/bin/env python3
"""Makes the SGLang venv (scripts/setup-sglang-venv.sh: sglang and this clone's kvbank package,
outside the clone) and runs tests/sglang there with pytest against this build's kvbankd.

    run_sglang_tests.py --kvbankd build/release/bin/kvbankd [--python PY] [pytest args...]

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

    setup = [os.path.join(REPO, "scripts", "setup-sglang-venv.sh")]
    if args.python:
        setup += ["--python", args.python]
    start = time.monotonic()
    print("[sglang-tests] " + " ".join(setup), flush=True)
    r = subprocess.run(setup, stdout=subprocess.PIPE, text=True)
    if r.returncode == SKIP:
        print("[sglang-tests] skipped: the SGLang venv cannot be built (PyPI unreachable)",
              flush=True)
        return SKIP
    if r.returncode != 0:
        print(f"[sglang-tests] FAILED: scripts/setup-sglang-venv.sh exited {r.returncode}",
              flush=True)
        return 1
    py = r.stdout.strip().splitlines()[-1]
    print(f"[sglang-tests] venv ready in {time.monotonic() - start:.0f} s: {py}", flush=True)

    env = dict(os.environ)
    env["KVBANK_KVBANKD"] = os.path.abspath(args.kvbankd)
    env.pop("PYTHONPATH", None)  # the installed package, not the source tree
    r = subprocess.run([py, "-m", "pytest", "-v", "-s", "-p", "no:cacheprovider", HERE]
                       + pytest_args, env=env, cwd=HERE)
    print("[sglang-tests] done in %.0f s" % (time.monotonic() - start), flush=True)
    return r.returncode


if __name__ == "__main__":
    sys.exit(main())

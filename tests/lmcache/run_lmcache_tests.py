#!/usr/bin/env python3
"""Makes the LMCache venv (scripts/setup-lmcache-venv.sh: a copy of the vLLM venv with
lmcache==0.5.6 and this clone's kvbank package, outside the clone) and runs tests/lmcache there
with pytest against this build's kvbankd.

    run_lmcache_tests.py --kvbankd build/release/bin/kvbankd [--python PY] [pytest args...]

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

    setup = [os.path.join(REPO, "scripts", "setup-lmcache-venv.sh")]
    if args.python:
        setup += ["--python", args.python]
    start = time.monotonic()
    print("[lmcache-tests] " + " ".join(setup), flush=True)
    r = subprocess.run(setup, stdout=subprocess.PIPE, text=True)
    if r.returncode == SKIP:
        print("[lmcache-tests] skipped: the LMCache venv cannot be built (PyPI unreachable)",
              flush=True)
        return SKIP
    if r.returncode != 0:
        print(f"[lmcache-tests] FAILED: scripts/setup-lmcache-venv.sh exited {r.returncode}",
              flush=True)
        return 1
    py = r.stdout.strip().splitlines()[-1]
    print(f"[lmcache-tests] venv ready in {time.monotonic() - start:.0f} s: {py}", flush=True)

    env = dict(os.environ)
    env["KVBANK_KVBANKD"] = os.path.abspath(args.kvbankd)
    env.pop("PYTHONPATH", None)  # the installed package, not the source tree
    # Chunk keys hash token ids with Python's hash(): every engine of the run shares one seed.
    env["PYTHONHASHSEED"] = "20261203"
    r = subprocess.run([py, "-m", "pytest", "-v", "-p", "no:cacheprovider", HERE] + pytest_args,
                       env=env, cwd=HERE)
    print(f"[lmcache-tests] done in {time.monotonic() - start:.0f} s", flush=True)
    return r.returncode


if __name__ == "__main__":
    sys.exit(main())

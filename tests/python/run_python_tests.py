#!/usr/bin/env python3
"""Builds the kvbank Python package into a venv outside the clone and runs tests/python there.

    run_python_tests.py --kvbankd build/release/bin/kvbankd [pytest args...]
    run_python_tests.py --prepare     (the venv and its packages only: nothing built, no tests)

The venv is $KVBANK_PY_VENV (default: $XDG_CACHE_HOME or ~/.cache, then kvbank-venv); it is made
once (python -m venv, then pytest, numpy, scikit-build-core, pybind11 and grpcio (the tests' fake
servers) from PyPI) and reused.
Every run pip-installs ./python into it again, building in a folder kept next to the venv (one per
clone, so a rebuild only compiles what changed; ccache when it is installed). A lock file keeps
two runs from installing into the same venv at once. kvbankd reaches the tests as
$KVBANK_KVBANKD.
"""

import argparse
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))
SKIP = 77  # ctest: SKIP_RETURN_CODE
BUILD_REQUIREMENTS = ["pytest>=7", "numpy>=1.21", "scikit-build-core>=0.8", "pybind11>=2.11",
                      "grpcio>=1.51"]


def run(cmd, env=None):
    print("[python-tests] " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, env=env)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kvbankd")
    ap.add_argument("--prepare", action="store_true",
                    help="make the venv and install its packages, then stop (scripts/test.sh "
                         "does it while the build runs)")
    ap.add_argument("--python", default=sys.executable, help="the interpreter the venv is made of")
    args, pytest_args = ap.parse_known_args()
    if not args.prepare and not args.kvbankd:
        ap.error("--kvbankd is required (or --prepare)")

    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    venv = os.path.abspath(os.environ.get("KVBANK_PY_VENV") or os.path.join(cache, "kvbank-venv"))
    if os.path.commonpath([venv, REPO]) == REPO:
        sys.exit(f"KVBANK_PY_VENV={venv} is inside the clone; put it outside")
    os.makedirs(os.path.dirname(venv), exist_ok=True)
    py = os.path.join(venv, "bin", "python")
    with open(venv + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.exists(py):
            run([args.python, "-m", "venv", venv])
        probe = subprocess.run(
            [py, "-c", "import pytest, numpy, scikit_build_core, pybind11, grpc"],
            capture_output=True)
        if probe.returncode != 0:
            try:
                run([py, "-m", "pip", "install", "--quiet"] + BUILD_REQUIREMENTS)
            except subprocess.CalledProcessError:
                # Only this step needs the network: ctest reports the test as skipped (77).
                print(f"[python-tests] skipped: cannot install {' '.join(BUILD_REQUIREMENTS)} "
                      f"into {venv} (is PyPI reachable?)", flush=True)
                return SKIP
        if args.prepare:
            print(f"[python-tests] venv ready: {venv}", flush=True)
            return 0

        # One build folder per clone, next to the venv: incremental rebuilds.
        tag = hashlib.sha256(REPO.encode()).hexdigest()[:12]
        build_dir = venv + "-build/" + tag
        env = dict(os.environ)
        cmake_args = env.get("CMAKE_ARGS", "")
        if shutil.which("ccache") and "CMAKE_CXX_COMPILER_LAUNCHER" not in cmake_args:
            env["CMAKE_ARGS"] = (env.get("CMAKE_ARGS", "") +
                                 " -DCMAKE_CXX_COMPILER_LAUNCHER=ccache").strip()
        env.setdefault("CMAKE_BUILD_PARALLEL_LEVEL", "1")  # shared machines: one compile at a time
        start = time.monotonic()
        run([py, "-m", "pip", "install", "--quiet", "--no-build-isolation", "--no-deps",
             "--force-reinstall", "--config-settings=build-dir=" + build_dir,
             os.path.join(REPO, "python")], env=env)
        print("[python-tests] kvbank installed in %.0f s" % (time.monotonic() - start), flush=True)

        env = dict(os.environ)
        env["KVBANK_KVBANKD"] = os.path.abspath(args.kvbankd)
        env.pop("PYTHONPATH", None)  # the installed package, not the source tree
        # From the tests' folder: `import kvbank` finds the venv's package (python/ is not on the
        # path), conftest.py comes from here.
        r = subprocess.run([py, "-m", "pytest", "-v", "-p", "no:cacheprovider", HERE]
                           + pytest_args, env=env, cwd=HERE)
    return r.returncode


if __name__ == "__main__":
    sys.exit(main())

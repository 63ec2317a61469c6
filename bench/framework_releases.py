"""Which releases of a framework its ready-made targets run on: each release installed in a
throw-away venv, then ``ddpcheck check`` there, printing its exit status and time per release.

    python bench/framework_releases.py deepspeed 0.18.9 0.19.0 0.19.8
    python bench/framework_releases.py accelerate 0.30.0 1.0.0 --once --check-args \
        "--dtypes float64,float32 --examples 20 --world-sizes 2"
    python bench/framework_releases.py lightning 2.0.0 2.4.0 --pip "setuptools<81" --once
    python bench/framework_releases.py deepspeed 0.19.0 --workdir /tmp/fw --keep   # reuse venvs
    python bench/framework_releases.py transformers 5.0.0 --pip "accelerate==1.15.0" --once

Per release: ``python -m venv``, then torch at the version ``constraints.txt`` pins (a local CPU
build here; never unpinned), the framework at that release, and this checkout of ddpcheck (not
editable: what a user installs), all pinned to that torch. Then, per target, ``ddpcheck check
TARGET --dtypes float32 --examples 20 --world-sizes 2`` (``--check-args`` to change) twice: the
first with an empty ``TORCH_EXTENSIONS_DIR`` -- a framework that JIT-builds C++ ops (DeepSpeed)
builds them in that run, as after an install -- and the second with what the first built. Exit
statuses, one meaning each: 0 nothing found, 1 a counterexample (never expected of a correct
framework), 2 set-up (a release older than the target supports is refused here, naming both), 4
ddpcheck's own glue failed. The venvs are removed at the end unless ``--keep``.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: The ready-made targets that drive each framework.
TARGETS = {
    "deepspeed": ["deepspeed_zero1"],
    "accelerate": ["accelerate"],
    "lightning": ["lightning", "fabric"],
    "transformers": ["hf_trainer"],
}


def torch_pin() -> str:
    """``torch==X`` as constraints.txt pins it."""
    with open(os.path.join(ROOT, "constraints.txt")) as f:
        for line in f:
            if re.match(r"torch==", line.strip()):
                return line.strip()
    raise SystemExit("constraints.txt pins no torch")


def venv(workdir: str, framework: str, release: str, extra: list[str]) -> str:
    """A venv with torch, ``framework==release`` (and the ``extra`` requirements) and this
    checkout's ddpcheck; its bin folder."""
    folder = os.path.join(workdir, f"{framework}-{release}")
    bin_dir = os.path.join(folder, "bin")
    done = os.path.join(folder, ".installed")
    if os.path.exists(done):  # kept from an earlier run: this checkout's ddpcheck, afresh
        subprocess.run(
            [
                os.path.join(bin_dir, "python"),
                "-m",
                "pip",
                "install",
                "--quiet",
                "--no-deps",
                "--force-reinstall",
                ROOT,
            ],
            check=True,
        )
        return bin_dir
    subprocess.run([sys.executable, "-m", "venv", "--clear", folder], check=True)
    pins = os.path.join(folder, "pins.txt")
    with open(pins, "w") as f:
        f.write(torch_pin() + "\n")
    pip = [os.path.join(bin_dir, "python"), "-m", "pip", "install", "--quiet", "-c", pins]
    subprocess.run([*pip, torch_pin()], check=True)
    subprocess.run([*pip, f"{framework}=={release}", *extra], check=True)
    subprocess.run([*pip, ROOT], check=True)
    open(done, "w").close()
    return bin_dir


def check(bin_dir: str, target: str, args: list[str], extensions: str) -> tuple[int, float, str]:
    """``ddpcheck check`` in that venv: its exit status, wall seconds and last line."""
    started = time.perf_counter()
    done = subprocess.run(
        [os.path.join(bin_dir, "ddpcheck"), "check", target, *args],
        capture_output=True,
        text=True,
        cwd=tempfile.gettempdir(),
        env={**os.environ, "TORCH_EXTENSIONS_DIR": extensions},
    )
    seconds = time.perf_counter() - started
    lines = [
        line
        for line in (done.stdout + done.stderr).splitlines()
        if line.strip() and not line.startswith(("note:", "skipped "))
    ]
    first = next(
        (
            line
            for line in lines
            if line.startswith(
                (
                    "ddpcheck",
                    "DeepSpeedTarget",
                    "AccelerateTarget",
                    "LightningTarget",
                    "FabricTarget",
                    "HfTrainerTarget",
                )
            )
        ),
        lines[-1] if lines else "",
    )
    return done.returncode, seconds, first


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("framework", choices=sorted(TARGETS))
    parser.add_argument("releases", nargs="+")
    parser.add_argument(
        "--target", nargs="+", help="the ready-made targets to check (default: the framework's)"
    )
    parser.add_argument("--check-args", default="--dtypes float32 --examples 20 --world-sizes 2")
    parser.add_argument("--workdir", help="where the venvs go (default: a temporary folder)")
    parser.add_argument("--keep", action="store_true", help="keep the venvs")
    parser.add_argument(
        "--pip",
        nargs="*",
        default=[],
        help="more requirements for every "
        "venv (lightning 2.0 imports pkg_resources: 'setuptools<81')",
    )
    parser.add_argument(
        "--once",
        action="store_true",
        help="one run per target, not two (a framework that builds no C++ op)",
    )
    args = parser.parse_args()
    workdir = args.workdir or tempfile.mkdtemp(prefix="ddpcheck-releases-")
    os.makedirs(workdir, exist_ok=True)
    rows = []
    try:
        for release in args.releases:
            started = time.perf_counter()
            bin_dir = venv(workdir, args.framework, release, args.pip)
            installed = time.perf_counter() - started
            for target in args.target or TARGETS[args.framework]:
                extensions = tempfile.mkdtemp(prefix="ops-", dir=workdir)  # empty: a first run
                first = check(bin_dir, target, args.check_args.split(), extensions)
                again = (
                    None
                    if args.once
                    else check(bin_dir, target, args.check_args.split(), extensions)
                )
                rows.append((release, target, installed, first, again))
                then = "" if again is None else f", then exit {again[0]} in {again[1]:.0f} s"
                print(
                    f"{args.framework} {release} {target}: exit {first[0]} in {first[1]:.0f} s "
                    f"(an empty op cache){then}\n    {first[2][:200]}",
                    flush=True,
                )
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    print(
        f"\n{'release':10} {'target':16} {'exit':>4} {'first run':>10} {'exit':>4} "
        f"{'second':>8}   (ddpcheck check {args.check_args}; first run: empty op cache)"
    )
    for release, target, _, first, again in rows:
        second = "" if again is None else f"{again[0]:>4} {again[1]:>7.0f}s"
        print(f"{release:10} {target:16} {first[0]:>4} {first[1]:>9.0f}s {second}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

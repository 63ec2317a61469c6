"""The torch matrix: ddpcheck's wheel checked on each torch release people train on, each in a
throw-away venv, and the measured table written into docs/torch-releases.md.

    make dist                                    # the wheel under test, in dist/
    python bench/torch_matrix.py 2.1.2 2.8.0     # releases, one venv at a time
    python bench/torch_matrix.py 2.14.1 --python python3.13 --examples 20

For each release: a venv in the system's temporary folder, ``torch==RELEASE`` (the index's build:
on PyPI a CUDA build of several GB, which runs on the CPU; check ``df -h`` first) with numpy<2
where the release predates numpy 2, the wheel of dist/ (no dependency resolution for ddpcheck:
its own are installed alongside), then in an empty folder:

* the standalone scripts ``bench/ddp_no_sync_unused.py`` (pytorch#69031), ``bench/stride_bug.py``
  and ``bench/fsdp2_cpu.py`` (does FSDP2 run on the CPU here?), each's exit status;
* ``ddpcheck check TARGET --examples N --world-sizes 2,3 --seed 7`` of ``parallel``, ``torch_ddp``,
  ``torch_zero`` and ``torch_fsdp``: exit status, what was found, the known-bug line if any;
* ``pytest -n auto properties/`` (a copy of this checkout's properties): passed and failed.

The venv is deleted after each release. Each release's row replaces the row of the same release
and Python in the table (others are kept), so releases can be measured one at a time.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(REPO, "docs", "torch-releases.md")
TARGETS = ("parallel", "torch_ddp", "torch_zero", "torch_fsdp")
PYTEST = ("python", "-m", "pytest", "-n", "auto", "-p", "no:cacheprovider", "-q", "properties")
PYTEST += ("-o", "markers=slow")  # the checkout's marker, outside its pyproject.toml
SCRIPTS = ("ddp_no_sync_unused.py", "stride_bug.py", "fsdp2_cpu.py")
BEGIN, END = "<!-- matrix: bench/torch_matrix.py writes these rows -->", "<!-- /matrix -->"
HEADER = (
    "| torch | Python | measured | properties | parallel | torch_ddp | torch_zero | torch_fsdp "
    "| pytorch#69031 | stride bug | FSDP2 on CPU |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|"
)


def run(command, cwd, timeout, env=None):
    """(exit status, stdout + stderr, seconds) of ``command``; a timeout is status "timeout"."""
    started = time.monotonic()
    try:
        done = subprocess.run(
            command, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env
        )
        status, text = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as exc:
        status, text = "timeout", f"{exc.stdout or ''}{exc.stderr or ''}"
    return status, text, time.monotonic() - started


def install(venv, release, python, wheel):
    subprocess.run([python, "-m", "venv", venv], check=True)
    pip = [os.path.join(venv, "bin", "python"), "-m", "pip", "install", "--no-cache-dir", "-q"]
    numpy = "numpy<2" if tuple(map(int, release.split(".")[:2])) < (2, 3) else "numpy"
    subprocess.run(
        [*pip, f"torch=={release}", numpy, "hypothesis>=6.80", "pytest>=7.4", "pytest-xdist>=3.3"],
        check=True,
    )
    subprocess.run([*pip, "--no-deps", wheel], check=True)


def check_cell(status, text):
    """A ``ddpcheck check`` result in one cell."""
    if status == 0:
        return "0"
    lines = [line for line in text.splitlines() if line.strip()]
    if status == 1:
        first = next((line for line in lines if " diverged at world size " in line), "")
        kind = first.split(": ", 1)[-1] if first else "found"
        known = any(line.startswith("known upstream bug:") for line in lines)
        return f"1: {kind}" + (" + known-bug line" if known else "")
    if status == 2:
        error = next((line for line in lines if "error:" in line), "")
        floor = re.search(r"supports torch (\S+) and later", error)
        return f"2: needs torch {floor.group(1)}" if floor else f"2: {error[-80:]}"
    return f"{status}"


def stride_cell(text):
    """bench/stride_bug.py's realistic case (ZeRO's bucket view at W=2): its exit status says
    only whether the case expected right is right, so its line is read."""
    found = re.search(r"zero_bucket_view\s+W=2: max \|grad - reference\| = (\S+) \((\w+)\)", text)
    if not found:
        return "?"
    return f"**wrong** ({found.group(1)})" if found.group(2) == "WRONG" else "right"


def pytest_cell(status, text):
    """pytest's closing counts, and the targets of the properties that failed."""
    summary = re.findall(r"^=*\s*(\d+ (?:failed|passed)[^\n]*? in [\d.]+s)", text, re.M)
    cell = summary[-1] if summary else str(status)
    failed = sorted(set(re.findall(r"^FAILED \S+\[(\w+)\]", text, re.M)))
    return cell + (f" (failed: {', '.join(failed)})" if failed else "")


def measure(release, python, wheel, examples, kept=None):
    """The row of ``release``: its cells, in the order of :data:`HEADER`. ``kept``: a venv that
    already holds that torch, used (the wheel installed into it) and kept."""
    venv = kept or tempfile.mkdtemp(prefix=f"ddpcheck-torch-{release}-")
    work = tempfile.mkdtemp(prefix="ddpcheck-matrix-")
    try:
        if kept:
            pip = [f"{venv}/bin/python", "-m", "pip", "install", "-q", "--no-deps"]
            subprocess.run([*pip, "--force-reinstall", wheel], check=True)
        else:
            install(venv, release, python, wheel)
        bin_ = os.path.join(venv, "bin")
        env = {**os.environ, "PATH": bin_ + os.pathsep + os.environ["PATH"]}
        version = subprocess.run(
            [f"{bin_}/python", "-c", "import sys, torch; print(torch.__version__, sys.version)"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        scripts, outputs = {}, {}
        for script in SCRIPTS:
            status, text, _ = run([f"{bin_}/python", f"{REPO}/bench/{script}"], work, 600, env)
            scripts[script], outputs[script] = status, text
            print(f"torch {release}: bench/{script}: exit {status}\n{text}", flush=True)
        checks = {}
        for target in TARGETS:
            command = [f"{bin_}/ddpcheck", "check", target, "--examples", str(examples)]
            command += ["--world-sizes", "2,3", "--seed", "7"]
            status, text, seconds = run(command, work, 3600, env)
            checks[target] = check_cell(status, text)
            print(f"torch {release}: {' '.join(command[1:])}: exit {status} in {seconds:.0f} s")
            print(text[-3000:], flush=True)
        shutil.copytree(f"{REPO}/properties", f"{work}/properties")
        status, text, seconds = run(
            [f"{bin_}/python", *PYTEST[1:]],
            work,
            3600,
            env,
        )
        print(f"torch {release}: pytest properties: exit {status} in {seconds:.0f} s")
        print(text[-4000:], flush=True)
        bugs = {0: "absent", 1: "**present**"}
        return [
            version[0],
            version[1],
            datetime.date.today().isoformat(),
            pytest_cell(status, text),
            *(checks[t] for t in TARGETS),
            bugs.get(scripts["ddp_no_sync_unused.py"], str(scripts["ddp_no_sync_unused.py"])),
            stride_cell(outputs["stride_bug.py"]),
            {0: "runs", 1: "runs, **wrong**", 2: "no"}.get(scripts["fsdp2_cpu.py"], "?"),
        ]
    finally:
        if not kept:
            shutil.rmtree(venv, ignore_errors=True)  # several GB each
        shutil.rmtree(work, ignore_errors=True)


def write_row(cells):
    """Put the row into docs/torch-releases.md, replacing the same torch and Python's."""
    with open(DOC) as f:
        text = f.read()
    head, rest = text.split(BEGIN)
    table, tail = rest.split(END)
    key = (cells[0], cells[1])
    rows = [
        line
        for line in table.strip().splitlines()[2:]
        if tuple(c.strip() for c in line.strip("|").split("|")[:2]) != key
    ]
    rows.append("| " + " | ".join(cells) + " |")
    rows.sort(key=lambda line: [int(n) for n in re.findall(r"\d+", line.split("|")[1])[:3]])
    with open(DOC, "w") as f:
        f.write(f"{head}{BEGIN}\n{HEADER}\n" + "\n".join(rows) + f"\n{END}{tail}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("releases", nargs="+", help="torch releases, such as 2.1.2 2.8.0")
    parser.add_argument("--python", default=sys.executable, help="the venvs' interpreter")
    parser.add_argument("--examples", type=int, default=60, help="check's random examples")
    parser.add_argument("--venv", help="a venv holding the one release given: used and kept")
    args = parser.parse_args()
    if args.venv and len(args.releases) != 1:
        parser.error("--venv takes one release")
    wheels = sorted(glob.glob(f"{REPO}/dist/ddpcheck-*.whl"))
    if not wheels:
        sys.exit("no wheel in dist/: run `make dist` first")
    for release in args.releases:
        cells = measure(release, args.python, wheels[-1], args.examples, args.venv)
        write_row(cells)
        print(f"torch {release}: " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()

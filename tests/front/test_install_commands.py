"""Every ``pip install`` ddpcheck shows installs what it says: each one the README and docs/ print
(in a code block, or inline in the prose) and each install hint of ddpcheck's messages is resolved
by pip (``pip install --dry-run --report``, against the registries this machine's pip is set up
with), and the releases its comment names are the releases it resolves -- ``lightning 2.6.6``
exactly that release, ``deepspeed>=0.19.0`` at least that one, a bare name at all. The hint
``pip install 'ddpcheck[frameworks]'`` once named for DeepSpeed installs no DeepSpeed: this would
have said so.

How it resolves: in this environment, as a reader's holding torch and the frameworks the
Makefile installs (resolving each command from nothing as well took 30 s of CPU per run): a
distribution the command asks for ends at the release pip would install, or at the installed
one where that satisfies it. No command may replace the installed torch unless it names torch: the
docs say to install torch first, and pip keeps it. ddpcheck itself is on no index: a command
naming it (``.``, the wheel, ``ddpcheck[...]``) asks for what ``pyproject.toml`` declares and the
extras named, which the checkout and the wheel both carry. Skipped only when the registry cannot
be reached.
"""

from __future__ import annotations

import concurrent.futures
import importlib.metadata
import json
import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest
import torch

from ddpcheck import targets
from tests.front.test_docs import FENCE, PAGES, ROOT

tomllib = pytest.importorskip("tomllib")  # Python 3.11 and later

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
#: Distributions a comment may make claims about (a word of prose is no distribution).
KNOWN = ("ddpcheck", "torch", "accelerate", "lightning", "deepspeed", "numpy", "transformers")
CLAIM = re.compile(
    rf"\b(?P<name>{'|'.join(KNOWN)})\b"
    r"(?:\s*(?P<op>==|>=|≥)?\s*(?P<version>\d+(?:\.\d+)+))?",
    re.I,
)
#: What pip prints when it cannot reach an index: the registry is unreachable, not the command.
UNREACHABLE = re.compile(
    r"NewConnectionError|Failed to establish|Network is unreachable|"
    r"Temporary failure in name resolution|Connection refused|"
    r"ConnectTimeout|Read timed out|ProxyError"
)


def _commands() -> list[tuple[str, str, str]]:
    """``(where, command, comment)`` for every ``pip install`` the pages show, and every hint
    of the messages (the framework's name is their claim)."""
    found = []
    for page in PAGES:
        text = page.read_text()
        name = page.relative_to(ROOT).as_posix()
        for fence in FENCE.finditer(text):
            for line in fence.group(2).splitlines():
                command, _, comment = line.strip().removeprefix("$ ").partition(" #")
                if command.startswith("pip install "):
                    found.append((name, command.strip(), comment))
        prose = FENCE.sub("", text)
        for span in re.findall(r"`(pip install [^`]+)`", prose):
            found.append((name, span, ""))
    for entry in targets.READY_MADE:
        if entry.framework != "torch":
            found.append((f"ddpcheck targets: {entry.name}", entry.install, entry.framework))
    # an option named in prose (`pip install --dry-run`) installs nothing
    return [f for f in found if any(not w.startswith("-") for w in shlex.split(f[1])[2:])]


def _requirements(extras: str) -> list[str]:
    """What installing ddpcheck with ``extras`` (``[a,b]`` or empty) asks of pip."""
    wanted = [e.strip() for e in extras.strip("[]").split(",") if e.strip()]
    unknown = set(wanted) - set(PYPROJECT["optional-dependencies"])
    assert not unknown, f"pyproject.toml has no extra {sorted(unknown)}"
    return [
        *PYPROJECT["dependencies"],
        *(r for e in wanted for r in PYPROJECT["optional-dependencies"][e]),
    ]


def _arguments(command: str) -> tuple[list[str], bool]:
    """pip's arguments for ``command`` (after ``pip install``), ddpcheck replaced by its
    requirements; and whether it names ddpcheck."""
    args, names_ddpcheck = [], False
    for word in shlex.split(command)[2:]:
        ours = re.fullmatch(r"(?:\.|\S*ddpcheck(?:-[\w.]+-py3-none-any\.whl)?)(\[[\w,-]*\])?", word)
        if word == "-e":
            continue
        if ours:
            args += _requirements(ours.group(1) or "")
            names_ddpcheck = True
        else:
            args.append(word)
    return args, names_ddpcheck


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version.split("+")[0])[:3])


def _name(requirement: str) -> str:
    return re.sub(r"[-_.]+", "-", re.match(r"[\w.-]+", requirement).group()).lower()


def _resolve(command: str, report: pathlib.Path) -> tuple[dict | None, str]:
    """The release of each distribution ``command`` installs or asks for, by name, once it ran
    here (None and pip's output when pip cannot resolve it)."""
    args, names_ddpcheck = _arguments(command)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--quiet",
            "--disable-pip-version-check",
            "--timeout",
            "20",
            "--retries",
            "1",
            "--report",
            str(report),
            *args,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={k: v for k, v in os.environ.items() if not k.startswith("PYTHON")},
    )
    if done.returncode != 0:
        return None, done.stdout + done.stderr
    after = {}
    options_with_values = {"-c", "-r", "--constraint", "--requirement"}
    for before, word in zip(["", *args], args):
        if not word.startswith("-") and before not in options_with_values:
            try:
                after[_name(word)] = importlib.metadata.version(_name(word))
            except importlib.metadata.PackageNotFoundError:
                pass
    after.update(
        {
            _name(item["metadata"]["name"]): item["metadata"]["version"]
            for item in json.loads(report.read_text())["install"]
        }
    )
    if names_ddpcheck:
        after["ddpcheck"] = PYPROJECT["version"]
    if "torch" in after and after["torch"] != torch.__version__ and "torch" not in command:
        return None, f"it replaces the installed torch {torch.__version__} by {after['torch']}"
    return after, ""


def _broken_claims(comment: str, installed: dict) -> list[str]:
    broken = []
    for claim in CLAIM.finditer(comment):
        name, op, version = claim.group("name").lower(), claim.group("op"), claim.group("version")
        got = installed.get(name)
        if got is None:
            broken.append(f"names {name}, which it does not install")
        elif version and op in (">=", "≥") and _release(got) < _release(version):
            broken.append(f"says {name}>={version}, resolves {name} {got}")
        elif version and op in (None, "==") and _release(got) != _release(version):
            broken.append(f"says {name} {version}, resolves {name} {got}")
    return broken


@pytest.mark.slow  # pip resolving a dozen commands: seconds of network and CPU
def test_every_pip_install_shown_installs_what_it_says(tmp_path):
    commands = _commands()
    assert any("deepspeed" in c for _, c, _ in commands), "no command installs deepspeed?"
    distinct = list(dict.fromkeys(c for _, c, _ in commands))
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # two cores
        resolved = dict(
            zip(
                distinct,
                pool.map(
                    lambda i: _resolve(distinct[i], tmp_path / f"{i}.json"), range(len(distinct))
                ),
            )
        )
    unreachable = [
        out for installed, out in resolved.values() if installed is None and UNREACHABLE.search(out)
    ]
    if unreachable:
        pytest.skip(f"the package registry cannot be reached: {unreachable[0][-300:]}")
    problems = []
    for where, command, comment in commands:
        installed, out = resolved[command]
        if installed is None:
            problems.append(f"{where}: {command}: pip cannot resolve it:\n{out[-1500:]}")
        for broken in _broken_claims(comment, installed or {}):
            problems.append(f"{where}: {command}  # {comment}: {broken}")
    assert not problems, "\n".join(problems)


def test_the_extras_start_from_the_releases_the_targets_support():
    """A framework's extra starts at the oldest release its targets support (``Target.requires``;
    hf_tp needs a later transformers than hf_trainer), and each target's install command names
    its own floor: what ``pip install`` takes from it is a release the target accepts."""
    floors = {}
    for requirements in PYPROJECT["optional-dependencies"].values():
        for requirement in requirements:
            name, _, floor = requirement.partition(">=")
            floors[name] = floor or None
    oldest: dict[str, list[str]] = {}
    for entry in targets.READY_MADE:
        if entry.framework != "torch":
            oldest.setdefault(entry.framework, []).append(entry.minimum)
            assert entry.install == f"pip install '{entry.framework}>={entry.minimum}'"
    for name, minimums in oldest.items():
        release = min(minimums, key=lambda r: tuple(map(int, r.split("."))))
        assert floors.get(name) == release, (name, floors)


def test_the_claims_are_read_as_written():
    installed = {"accelerate": "1.15.0", "lightning": "2.6.6", "torch": "2.13.0+cpu"}
    assert _broken_claims("accelerate 1.15.0, Lightning>=2.0.9 on torch 2.13.0", installed) == []
    assert _broken_claims("accelerate 1.16.0 and deepspeed", installed) == [
        "says accelerate 1.16.0, resolves accelerate 1.15.0",
        "names deepspeed, which it does not install",
    ]
    assert _broken_claims("lightning ≥ 2.7", installed) == [
        "says lightning>=2.7, resolves lightning 2.6.6"
    ]
    assert _arguments("pip install -c constraints.txt -e '.[frameworks]'") == (
        ["-c", "constraints.txt", *_requirements("[frameworks]")],
        True,
    )
    assert (
        _arguments("pip install dist/ddpcheck-0.1.0-py3-none-any.whl")[0]
        == PYPROJECT["dependencies"]
    )
    assert _arguments("pip install 'deepspeed>=0.19.0'") == (["deepspeed>=0.19.0"], False)

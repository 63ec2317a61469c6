"""``ddpcheck fuzz-rule``: a sharding rule's invariants, with a deadline on every call of it.

Invariant: :func:`check_rule` reports no violation exactly when, for every parameter list it tried
(Hypothesis draws them: 1 to 300 parameters shaped like real models' -- vectors, matrices, conv
kernels, large embeddings on the meta device, scalars, empty tensors -- in float32, float64,
bfloat16 and float16, at world sizes 1..8, often larger than the list; then the fixed lists of
:func:`parameter_lists`), ``rule(params, W)`` returned within the deadline one integer owner in
``[0, W)`` per parameter, returned the same valid answer when called again, and returned the same
answer on every rank of real worlds of 2..4 processes. A violation found by Hypothesis is shrunk
to the smallest parameter list that shows it. Each kind of violation (see :data:`KINDS`) has its
own message, naming the rule, the world size and the parameter list it failed on.

Where the rule runs: never in the calling process. Every call happens inside a rank process of a
persistent world (one rank for the pure checks, 2..4 for the cross-rank check) and has two
deadlines: a ``SIGALRM`` interval timer that interrupts a call still running after ``deadline``
seconds (enough for any hang that returns to the interpreter: loops, ``time.sleep``, lock waits),
and a ``faulthandler`` watchdog that dumps the stack and ends the rank a few seconds later (a hang
inside C code that never returns to the interpreter; see ``_Guard``). Before each call the rank
writes which input it is calling the rule on to a progress file, so when a rank dies or the
world's own deadline passes the parent still knows which input was to blame -- or that no call of
the rule was running, which makes the failure a set-up error (:class:`SetupError`), not a verdict.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import math
import numbers
import os
import shutil
import signal
import tempfile
import time
import traceback
from typing import Any, Callable, Sequence

import torch

__all__ = ["DTYPES", "KINDS", "ParamSpec", "RuleReport", "SetupError", "Violation", "balance",
           "check_rule", "gpt_like", "parameter_lists", "rule_violations"]

#: Violation kinds, in the order they are reported.
KINDS = ("raised", "hangs", "crashed", "wrong length", "not an integer", "out of range",
         "nondeterministic", "rank-dependent")
#: Dtypes of the drawn parameters.
DTYPES = ("float32", "float64", "bfloat16", "float16")
#: World sizes of the pure checks (drawn; several exceed the length of many lists).
MAX_WORLD_SIZE = 8
#: Parameters per drawn list, at most.
MAX_PARAMS = 300
#: World sizes of the cross-rank check (real processes).
RANK_WORLD_SIZES = (2, 3, 4)
#: World sizes of the balance report on GPT-like parameters.
BALANCE_WORLD_SIZES = (2, 3, 4, 8)
#: Drawn examples by default; each is two calls of the rule.
DEFAULT_EXAMPLES = 200
#: Seconds the pure search may spend; once spent it starts no new call of the rule (so a slow
#: rule ends the search early, with the examples it got through, instead of running for hours).
SEARCH_BUDGET = 120.0
#: Seconds the cross-rank check may spend on one world.
CROSS_BUDGET = 60.0
#: Seconds after the per-call deadline before a call stuck in C code ends its rank (at most
#: HARD_REFRESH more, and never before HARD_FLOOR seconds; see ``_Guard``).
HARD_GRACE = 2.0
HARD_REFRESH = 5.0
HARD_FLOOR = 10.0
#: Seconds the parent allows past a task's own limits before it declares the world hung.
WORLD_MARGIN = 30.0
#: Parameters with more elements than this are built on the meta device (no memory).
META_ABOVE = 4096

_HERE = os.path.dirname(os.path.abspath(__file__))  # frames here are ddpcheck's, not the rule's
_ELEMENT_SIZE = {"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2}


class SetupError(RuntimeError):
    """fuzz-rule could not run its checks (a world failed while no call of the rule was running,
    the rule module does not import in a rank, ...): no verdict on the rule."""


@dataclasses.dataclass(frozen=True)
class Violation:
    kind: str  # one of KINDS
    message: str


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """One parameter a rule is called with: its dtype and shape. Large ones live on the meta
    device, so a 250,000 x 8,192 embedding costs no memory."""

    dtype: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * _ELEMENT_SIZE[self.dtype]

    @property
    def meta(self) -> bool:
        return self.numel > META_ABOVE

    def tensor(self) -> torch.Tensor:
        return torch.zeros(self.shape, dtype=getattr(torch, self.dtype),
                           device="meta" if self.meta else "cpu")

    def describe(self) -> str:
        return f"{self.dtype} {self.shape}{' meta' if self.meta else ''}"


@dataclasses.dataclass
class RuleReport:
    """What :func:`check_rule` found."""

    violations: list[Violation]
    examples: int = 0  # drawn parameter lists tried by the pure search
    budget_reached: bool = False  # the pure search stopped early on SEARCH_BUDGET
    cross_rank_lists: int = 0  # parameter lists compared across the ranks of each world
    #: owners on :func:`gpt_like` at each of BALANCE_WORLD_SIZES (when the invariants hold)
    gpt_owners: dict[int, list[int]] = dataclasses.field(default_factory=dict)


# ---------------------------------------------------------------------------------------------
# Parameter lists


def gpt_like(layers: int = 12, width: int = 768, vocab: int = 50257, context: int = 1024
             ) -> list[ParamSpec]:
    """GPT-2-small-shaped float32 parameters, in registration order."""
    shapes = [(vocab, width), (context, width)]
    for _ in range(layers):
        shapes += [(width,), (width,), (width, 3 * width), (3 * width,), (width, width), (width,),
                   (width,), (width,), (width, 4 * width), (4 * width,), (4 * width, width),
                   (width,)]
    shapes += [(width,), (width,)]
    return [ParamSpec("float32", s) for s in shapes]


def parameter_lists() -> dict[str, list[ParamSpec]]:
    """Fixed named parameter lists checked after the drawn ones: tiny, mixed-dtype, GPT-shaped."""
    f32, f64 = "float32", "float64"
    return {
        "tiny": [ParamSpec(f32, (4,))],
        "mlp": [ParamSpec(f32, (8, 5)), ParamSpec(f32, (8,)), ParamSpec(f32, (3, 8)),
                ParamSpec(f32, (3,))],
        "mixed dtypes": [ParamSpec(f64, (6, 5)), ParamSpec(f64, (6,)), ParamSpec(f32, (3, 6))],
        "equal sizes": [ParamSpec(f32, (7,)) for _ in range(5)],
        "gpt-like": gpt_like(),
    }


def describe(specs: Sequence[ParamSpec], name: str | None = None, limit: int = 10) -> str:
    """``2 parameters [float32 (4,), float64 (3, 4)]``; runs of three or more equal parameters
    are counted (``[120 x float32 (1,)]``), long lists end with ``... N more``."""
    runs: list[list] = []
    for spec in specs:
        if runs and runs[-1][1] == spec:
            runs[-1][0] += 1
        else:
            runs.append([1, spec])
    items = [f"{n} x {spec.describe()}" if n > 2 else ", ".join([spec.describe()] * n)
             for n, spec in runs[:limit]]
    if len(runs) > limit:
        items.append(f"... {sum(n for n, _ in runs[limit:])} more")
    count = f"{len(specs)} parameter{'' if len(specs) == 1 else 's'}"
    return f"{name + ' (' + count + ')' if name else count} [{', '.join(items)}]"


def param_lists_strategy() -> Any:
    """Hypothesis strategy for parameter lists shaped like real models'.

    Small lists are drawn often (a third of the lengths are 1..3, a third 1..16); half the lists
    repeat a block of shapes like a stack of layers, after an optional embedding; half mix
    dtypes parameter by parameter. Everything shrinks towards one ``float32 (1,)``.
    """
    from hypothesis import strategies as st

    dtype = st.sampled_from(DTYPES)
    dim = st.one_of(st.integers(1, 64), st.integers(1, 4096))
    vector = st.tuples(dim)
    matrix = st.tuples(dim, dim)
    conv = st.builds(lambda o, i, k: (o, i, k, k), st.integers(1, 512), st.integers(1, 512),
                     st.sampled_from((1, 3, 5, 7)))
    embedding = st.tuples(st.integers(1000, 262144), st.integers(64, 8192))
    shape = st.one_of(vector, matrix, vector, matrix, conv, embedding, st.just(()), st.just((0,)))
    param = st.builds(ParamSpec, dtype, shape)

    @st.composite
    def lists(draw: Any) -> tuple[ParamSpec, ...]:
        n = draw(st.one_of(st.integers(1, 3), st.integers(1, 16), st.integers(1, MAX_PARAMS)))
        if draw(st.booleans()):  # layers: [embedding] + block * k, cut to n
            head = draw(st.lists(st.builds(ParamSpec, dtype, embedding), max_size=1))
            block = draw(st.lists(param, min_size=1, max_size=6))
            specs = (head + block * n)[:n]
        else:
            specs = draw(st.lists(param, min_size=n, max_size=n))
        if not draw(st.booleans()):  # one dtype for the whole list
            base = draw(dtype)
            specs = [ParamSpec(base, s.shape) for s in specs]
        return tuple(specs)

    return lists()


# ---------------------------------------------------------------------------------------------
# One guarded call of the rule (inside a rank process)


class _Hung(BaseException):
    """Raised into a call of the rule by SIGALRM (BaseException: ``except Exception`` in the rule
    cannot swallow it)."""


class _Stop(BaseException):
    """Ends the Hypothesis search at once (a hang is not shrunk: each attempt costs a deadline)."""


def _on_alarm(signum: int, frame: Any) -> None:
    raise _Hung()


class _Progress:
    """The progress file of one rank: which call of the rule is running, if any."""

    def __init__(self, directory: str, rank: int):
        self.path = os.path.join(directory, f"rank{rank}.calling")
        self.hang_path = os.path.join(directory, f"rank{rank}.hung")
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        self.hang_file = open(self.hang_path, "w")

    def calling(self, where: str) -> None:
        data = ("calling\n" + where).encode()
        os.pwrite(self._fd, data, 0)
        os.ftruncate(self._fd, len(data))

    def idle(self) -> None:
        os.ftruncate(self._fd, 0)

    def close(self) -> None:
        os.close(self._fd)
        self.hang_file.close()


class _Guard:
    """Deadlines around every call of the rule in this rank, and the search's time budget.

    Each call gets a ``SIGALRM`` after ``limit`` seconds. The hard stop, a ``faulthandler``
    watchdog that dumps the stack and ends the process, is armed for the guard's whole life and
    pushed back at the start of a call once it is ``HARD_REFRESH`` seconds old (re-arming it per
    call costs a thread join, milliseconds on a loaded machine), so it fires within
    ``limit + HARD_GRACE + HARD_REFRESH`` seconds of the start of a call that never returns to
    the interpreter, and never during a call that returns within ``limit``.
    """

    def __init__(self, limit: float, progress: _Progress, budget: float):
        self.limit = limit
        self.progress = progress
        self.ends = time.monotonic() + budget
        self.out_of_time = False
        self._saved: Any = None
        self._armed_at = -math.inf

    def __enter__(self) -> "_Guard":
        self._saved = signal.signal(signal.SIGALRM, _on_alarm)
        return self

    def __exit__(self, *exc: Any) -> None:
        signal.setitimer(signal.ITIMER_REAL, 0)
        faulthandler.cancel_dump_traceback_later()
        signal.signal(signal.SIGALRM, self._saved)
        self.progress.close()

    def _arm(self) -> None:
        now = time.monotonic()
        if now - self._armed_at > HARD_REFRESH:
            faulthandler.dump_traceback_later(max(self.limit + HARD_GRACE, HARD_FLOOR)
                                              + HARD_REFRESH, exit=True,
                                              file=self.progress.hang_file)
            self._armed_at = now

    def call(self, rule: Any, params: list[torch.Tensor], world_size: int, where: str
             ) -> tuple[str, Any]:
        """``("ok", owners)``, or ``(kind, detail)``: ``raised``, ``hangs`` or the kind of an
        invalid answer (validated inside the deadline too: the answer is the rule's object)."""
        if time.monotonic() > self.ends:
            self.out_of_time = True
            raise _Stop()
        self._arm()
        self.progress.calling(where)
        try:
            signal.setitimer(signal.ITIMER_REAL, self.limit)
            try:
                try:
                    answer = rule(list(params), world_size)
                except _Hung:
                    raise
                except BaseException as exc:  # SystemExit too: a rule returns, it does not exit
                    return "raised", _exception_text(exc)
                return _validate(answer, len(params), world_size)
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
        except _Hung as hung:
            return "hangs", _hang_text(self.limit, hung)
        finally:
            self.progress.idle()


def _hang_text(limit: float, hung: BaseException | None = None) -> str:
    text = f"did not return within the {limit:g} s deadline (--deadline)"
    frames = traceback.extract_tb(hung.__traceback__) if hung is not None else []
    theirs = [f for f in frames if not os.path.abspath(f.filename).startswith(_HERE + os.sep)]
    if theirs:  # the innermost frame outside ddpcheck: where the rule was
        text += f"; it was at {theirs[-1].filename}:{theirs[-1].lineno} in {theirs[-1].name}"
    return text


def _exception_text(exc: BaseException) -> str:
    try:
        return f"raised {type(exc).__name__}: {_short(str(exc))}"
    except Exception:
        return f"raised {type(exc).__name__}"


def _short(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def _safe_repr(value: Any) -> str:
    try:
        return _short(repr(value), 120)
    except Exception:
        return f"<{type(value).__name__} whose repr raised>"


def _validate(answer: Any, n: int, world_size: int) -> tuple[str, Any]:
    """``("ok", owners tuple)`` or ``(kind, detail)`` for an answer of the rule."""
    try:
        if isinstance(answer, torch.Tensor):
            answer = answer.tolist()
        if isinstance(answer, (str, bytes, dict)) or not hasattr(answer, "__len__"):
            return "wrong length", (f"returned {_safe_repr(answer)}, not a sequence; a rule "
                                    "returns one owner rank per parameter")
        owners = list(answer)
    except Exception as exc:
        return "wrong length", (f"returned {_safe_repr(answer)}, which cannot be read as a "
                                f"sequence ({type(exc).__name__}: {_short(str(exc), 100)})")
    if len(owners) != n:
        return "wrong length", (f"returned {len(owners)} owner{'' if len(owners) == 1 else 's'} "
                                f"for {n} parameter{'' if n == 1 else 's'}; a rule returns exactly "
                                "one owner rank per parameter, in order")
    for i, owner in enumerate(owners):
        if isinstance(owner, bool) or not isinstance(owner, numbers.Integral):
            return "not an integer", (f"returned owner {_safe_repr(owner)} (type "
                                      f"{type(owner).__name__}) for parameter {i}; owners are int "
                                      "ranks")
        if not 0 <= owner < world_size:
            return "out of range", (f"returned owner {owner!r} for parameter {i}; owners must be "
                                    f"in [0, world_size={world_size})")
    return "ok", tuple(int(o) for o in owners)


def _answer(guard: _Guard, rule: Any, params: list[torch.Tensor], world_size: int, where: str,
            call: str) -> tuple[str, Any]:
    return guard.call(rule, params, world_size, f"{call}\n{where}")


def _twice(guard: _Guard, rule: Any, specs: Sequence[ParamSpec], world_size: int, where: str
           ) -> tuple[str, Any]:
    """Call the rule twice on one input: ``("ok", owners)``, or ``(kind, detail)`` of its first
    violation."""
    params = [s.tensor() for s in specs]
    kind, first = _answer(guard, rule, params, world_size, where, "the first call")
    if kind != "ok":
        return kind, first
    kind, again = _answer(guard, rule, params, world_size, where, "the second call")
    if kind != "ok":
        return kind, f"on the second call (the first answered {_brief(first)}), {again}"
    if again != first:
        return "nondeterministic", (f"answered {_brief(first)} and then {_brief(again)}; a rule "
                                    "must be a pure function of the parameters' shapes, dtypes and "
                                    "order and of world_size")
    return "ok", first


def _where(world_size: int, specs: Sequence[ParamSpec], name: str | None = None) -> str:
    return f"at world size {world_size} on {describe(specs, name)}"


# ---------------------------------------------------------------------------------------------
# The pure checks: one task in a world of one rank


_FOUND = {kind: type(f"RuleViolation_{kind.replace(' ', '_').replace('-', '_')}", (Exception,), {})
          for kind in KINDS}


def _search_in_rank(rule: Any, examples: int, seed: int | None, limit: float, directory: str,
                    budget: float) -> dict[str, Any]:
    """Hypothesis search, then the named lists; the smallest violation of each kind found, and on
    success the owners on GPT-like parameters for the balance report."""
    from hypothesis import HealthCheck, Phase, Verbosity, given, settings
    from hypothesis import seed as hypothesis_seed
    from hypothesis import strategies as st

    name = rule_name(rule)
    found: dict[str, tuple[tuple, str]] = {}
    tried: list[tuple[ParamSpec, ...]] = []
    gpt_owners: dict[int, list[int]] = {}

    def note(kind: str, detail: str, specs: Sequence[ParamSpec], world_size: int,
             list_name: str | None = None) -> None:
        # Fewest parameters, then smallest world; among equals the latest, which Hypothesis's
        # shrinker found simpler than the ones before it.
        key = (len(specs), world_size)
        if kind not in found or key <= found[kind][0]:
            found[kind] = (key, f"{kind}: {name} {_where(world_size, specs, list_name)}: {detail}")

    with _Guard(limit, _Progress(directory, 0), budget) as guard:
        # Explicit settings, no database: the user's Hypothesis profile and examples do not apply.
        @settings(max_examples=examples, derandomize=seed is None, database=None, deadline=None,
                  phases=(Phase.generate, Phase.shrink), verbosity=Verbosity.quiet,
                  report_multiple_bugs=True, print_blob=False,
                  suppress_health_check=list(HealthCheck))
        @given(specs=param_lists_strategy(), world_size=st.integers(1, MAX_WORLD_SIZE))
        def one(specs: tuple[ParamSpec, ...], world_size: int) -> None:
            if not found:
                tried.append(specs)
            kind, detail = _twice(guard, rule, specs, world_size, _where(world_size, specs))
            if kind == "ok":
                return
            note(kind, detail, specs, world_size)
            if kind == "hangs":
                raise _Stop()  # not shrunk: every attempt would cost a deadline
            raise _FOUND[kind](detail)  # one exception type per kind: each is shrunk on its own

        if seed is not None:
            one = hypothesis_seed(seed)(one)
        try:
            try:
                one()
            except Exception:  # our violations (one, several, or flaky): `found` holds them
                if not found:
                    raise
            if not found:
                for list_name, specs in parameter_lists().items():
                    for world_size in range(1, MAX_WORLD_SIZE + 1):
                        kind, answer = _twice(guard, rule, specs, world_size,
                                              _where(world_size, specs, list_name))
                        if kind != "ok":
                            note(kind, answer, specs, world_size, list_name)
                            raise _Stop()
                        if list_name == "gpt-like" and world_size in BALANCE_WORLD_SIZES:
                            gpt_owners[world_size] = list(answer)
        except _Stop:
            pass
    return {"found": {kind: message for kind, (_, message) in found.items()},
            "examples": len(tried), "budget_reached": guard.out_of_time,
            "sample": _sample(tried), "gpt_owners": gpt_owners}


def _sample(tried: list[tuple[ParamSpec, ...]], count: int = 24) -> list[tuple[ParamSpec, ...]]:
    """Some of the drawn lists, for the cross-rank check: the first ones and a spread."""
    if len(tried) <= count:
        chosen = tried
    else:
        step = len(tried) / count
        chosen = [tried[int(i * step)] for i in range(count)]
    return sorted(set(chosen), key=lambda specs: (len(specs), [s.describe() for s in specs]))


# ---------------------------------------------------------------------------------------------
# The cross-rank check: one task in each world of 2..4 ranks


def _answers_in_rank(rule: Any, lists: list[tuple[str | None, Sequence[ParamSpec]]], limit: float,
                     directory: str, budget: float) -> list[tuple[str, Any]]:
    """Inside a rank: this rank's answer (or failure) on each list at the world's size; stops at
    the first hang (the other ranks' answers on later lists would not be compared anyway)."""
    import torch.distributed as dist

    rank, world_size = dist.get_rank(), dist.get_world_size()
    answers: list[tuple[str, Any]] = []
    with _Guard(limit, _Progress(directory, rank), budget) as guard:
        for list_name, specs in lists:
            params = [s.tensor() for s in specs]
            try:
                answer = _answer(guard, rule, params, world_size,
                                 f"in a world of {world_size} processes on rank {rank}, on "
                                 f"{describe(specs, list_name)}", "the call")
            except _Stop:  # out of time: compare what every rank got through
                break
            answers.append(answer)
            if answer[0] == "hangs":
                break
    return answers


# ---------------------------------------------------------------------------------------------
# The parent's side


def check_rule(rule: Callable[..., Any], *, examples: int = DEFAULT_EXAMPLES,
               seed: int | None = None, deadline: float = 60.0,
               rank_world_sizes: Sequence[int] = RANK_WORLD_SIZES) -> RuleReport:
    """Every invariant ``rule`` breaks, each on the smallest input found (empty: none).

    ``deadline`` bounds each call of the rule (seconds). The rule travels to the rank processes
    by pickle, so it must be defined at module level of an importable module. Raises
    :class:`SetupError` (or ``WorldStartError``) when the checks could not run: no verdict.
    """
    from ddpcheck._internal.world import get_world

    name = rule_name(rule)
    directory = tempfile.mkdtemp(prefix="ddpcheck-fuzz-rule-")
    try:
        world = get_world(1)
        ran = _run(world, _search_in_rank, (rule, examples, seed, deadline, directory,
                                            SEARCH_BUDGET), deadline, SEARCH_BUDGET, directory,
                   name, "the search in a world of 1 process")
        if isinstance(ran, Violation):
            return RuleReport([ran])
        result = ran[0]
        report = RuleReport([Violation(k, result["found"][k]) for k in KINDS
                             if k in result["found"]],
                            result["examples"], result["budget_reached"])
        if report.violations:
            if "hangs" in result["found"]:
                world.kill()  # the interrupted call may have left the rank in any state
            return report
        # The fixed lists first (the smallest first), so messages do not depend on the draws.
        lists = list(parameter_lists().items()) + [(None, specs) for specs in result["sample"]]
        report.cross_rank_lists = len(lists)
        for world_size in rank_world_sizes:
            violation = _cross_rank(rule, name, world_size, lists, deadline, directory)
            if violation is not None:
                report.violations = [violation]
                return report
        report.gpt_owners = result["gpt_owners"]
        return report
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def rule_violations(rule: Callable[..., Any], **kwargs: Any) -> list[Violation]:
    """The violations of :func:`check_rule` alone."""
    return check_rule(rule, **kwargs).violations


def _run(world: Any, fn: Callable[..., Any], args: tuple, limit: float, budget: float,
         directory: str, name: str, what: str) -> list[Any] | Violation:
    """``world.run`` with a backstop deadline past the task's own limits. A failure while a rank
    was calling the rule is the rule's violation (``hangs`` or ``crashed``); any other failure is a
    :class:`SetupError`."""
    from ddpcheck._internal.world import WorldFailure

    for entry in os.listdir(directory):  # no progress of an earlier task may be read as this one's
        os.unlink(os.path.join(directory, entry))
    try:
        backstop = budget + max(limit + HARD_GRACE, HARD_FLOOR) + HARD_REFRESH + WORLD_MARGIN
        return world.run(fn, *args, deadline=backstop, what=f"fuzz-rule {name}")
    except WorldFailure as failure:
        for state in failure.ranks:
            calling = _read(os.path.join(directory, f"rank{state.rank}.calling"))
            if state.status == "returned" or not calling.startswith("calling\n"):
                continue
            call, where = calling[len("calling\n"):].split("\n", 1)
            stack = _trim_stack(_read(os.path.join(directory, f"rank{state.rank}.hung")))
            if stack or state.status == "stuck":
                kind = "hangs"
                detail = (f"{call} {_hang_text(limit)} (not even on the alarm signal: stuck in C "
                          f"code?), so its process was killed; it was here:\n"
                          f"{_indent(stack or _trim_stack(state.detail))}")
            else:
                kind = "crashed"
                detail = (f"{call} ended its process ({state.detail or state.status}); a rule "
                          "must return, not exit or crash the interpreter")
                if state.log_tail:
                    detail += f"; last output:\n{_indent(state.log_tail)}"
            return Violation(kind, f"{kind}: {name} {where}: {detail}")
        raise SetupError(f"fuzz-rule could not finish {what}, and no call of the rule was running "
                         f"when it failed, so nothing was decided about the rule:\n"
                         f"{failure}") from None


def _cross_rank(rule: Any, name: str, world_size: int,
                lists: list[tuple[str | None, Sequence[ParamSpec]]], deadline: float,
                directory: str) -> Violation | None:
    """Every rank of a world of ``world_size`` answers each list; the first disagreement, or the
    first failure common to every rank, if any."""
    from ddpcheck._internal.world import get_world

    world = get_world(world_size)
    answers = _run(world, _answers_in_rank, (rule, lists, deadline, directory, CROSS_BUDGET),
                   deadline, CROSS_BUDGET, directory, name,
                   f"the cross-rank check in a world of {world_size} processes")
    if isinstance(answers, Violation):
        return answers
    if any(answer[0] == "hangs" for mine in answers for answer in mine):
        world.kill()  # the interrupted call may have left the rank in any state
    for i in range(min(len(mine) for mine in answers)):
        where = f"in a world of {world_size} processes on {describe(lists[i][1], lists[i][0])}"
        first = answers[0][i]
        for rank, mine in enumerate(answers[1:], 1):
            if mine[i] != first:
                return Violation(
                    "rank-dependent",
                    f"rank-dependent: {name} {where}: answered {_shown(first)} on rank 0 but "
                    f"{_shown(mine[i])} on rank {rank}; every rank must compute the same owners "
                    "without communicating (do not read the rank, a random generator or the "
                    "clock)")
        if first[0] != "ok":  # the same failure on every rank, only inside a real world
            return Violation(first[0], f"{first[0]}: {name} {where}: on every rank, {first[1]}")
    return None


def _shown(answer: tuple[str, Any]) -> str:
    status, value = answer
    return _brief(value) if status == "ok" else f"({status}: {value})"


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def _trim_stack(dump: str) -> str:
    """A faulthandler dump without its header and the frames below the rule (ddpcheck's,
    Hypothesis's, multiprocessing's)."""
    import multiprocessing

    import hypothesis

    below = (f'File "{_HERE}', 'File "<string>"',
             f'File "{os.path.dirname(os.path.abspath(hypothesis.__file__))}',
             f'File "{os.path.dirname(os.path.abspath(multiprocessing.__file__))}')
    return "\n".join(line for line in dump.strip().splitlines()
                     if not line.lstrip().startswith(below) and not line.startswith("Timeout ("))


def _indent(text: str, prefix: str = "    ") -> str:
    return "\n".join(prefix + line for line in text.rstrip().splitlines())


# ---------------------------------------------------------------------------------------------
# Helpers


def rule_name(rule: Any) -> str:
    """How messages name a rule: ``module.qualname`` when it has one, else its repr."""
    name = getattr(rule, "__qualname__", None) or getattr(rule, "__name__", None)
    module = getattr(rule, "__module__", None)
    return f"{module}.{name}" if name and module else repr(rule)


def _brief(answer: Sequence[int], limit: int = 12) -> str:
    text = ", ".join(map(str, list(answer)[:limit]))
    return f"[{text}{', ...' if len(answer) > limit else ''}]"


def balance(owners: Sequence[int], params: Sequence[ParamSpec], world_size: int) -> float:
    """Bytes of the most loaded rank over the ideal share (1.0 is perfect), for owners a rule
    returned (the rule itself is not called here)."""
    loads = [0] * world_size
    for p, owner in zip(params, owners):
        loads[int(owner)] += p.nbytes
    total = sum(loads)
    return max(loads) * world_size / total if total else 1.0

"""Collective-sequence diagnosis: the first collective where the ranks of a world disagree.

Invariant: :func:`diagnose` returns ``None`` exactly when, for every process group, every member
rank's sequence of collectives on that group has the same length and the same
:meth:`ddpcheck._rank.recorder.Collective.signature` at every index. Otherwise it returns
the *first* disagreement -- earliest index, world group before subgroups -- with each member's
collective at that index (or "issued nothing").

Sequences come from the per-rank sequence files ``ddpcheck._rank.recorder`` appends to
before each collective goes on the wire, so they survive a rank that hangs or is killed. Collectives
issued from C++ (torch DDP's Reducer) are not in them.

Whether a disagreement is *the* failure or a consequence of one is decided by :attr:`mismatched`:
two ranks issued different collectives at the same index, or a rank that finished its task
normally issued fewer than the others (they wait for a collective it will never issue). A rank
that raised, died or slept before reaching a collective also "issued nothing" there, but that is
its failure, not a mismatch.
"""

from __future__ import annotations

import ast
import collections
import dataclasses
import functools
from collections.abc import Iterable, Sequence

from ddpcheck._language.records import Collective

__all__ = ["NO_COLLECTIVE", "Disagreement", "diagnose", "parse", "same_texts"]

#: :func:`agreement_summary` of ranks that issued none (a failure before any collective)
NO_COLLECTIVE = "no rank issued a collective through torch.distributed's Python API"


def parse(text: str) -> list[Collective]:
    """The collectives of one sequence file (a torn last line, from a killed rank, is dropped),
    each with the call site the recorder wrote after the signature fields."""
    return [c for line in text.splitlines() if (c := _parse_line(line)) is not None]


@functools.lru_cache(maxsize=4096)
def _parse_line(line: str) -> Collective | None:
    """One line, parsed once: the wait reads the files every 0.3 s while ranks run, and a
    tensor-parallel step repeats a few lines many times (DTensor's collectives)."""
    try:
        op, dtypes, shapes, root, group, reduce_op, *site = ast.literal_eval(line)
    except (ValueError, SyntaxError, TypeError):
        return None
    return Collective(
        op=op,
        nbytes=0,
        dtypes=tuple(dtypes),
        shapes=tuple(tuple(s) for s in shapes),
        root=root,
        group=None if group is None else tuple(group),
        reduce_op=reduce_op,
        async_op=False,
        launched=0.0,
        site=site[0] if site else "",
    )


def same_texts(texts: Sequence[str]) -> bool:
    """Fast path: identical files mean identical sequences (no parsing needed)."""
    return all(t == texts[0] for t in texts)


@dataclasses.dataclass(frozen=True)
class Disagreement:
    """The first index at which the members of one group issued different collectives."""

    index: int  # position in the group's own sequence, 0-based
    group: tuple[int, ...] | None  # None: the default (world) group
    entries: dict[int, Collective | None]  # member rank -> its collective there (None: nothing)
    lengths: dict[int, int]  # member rank -> collectives it issued on this group
    finished: frozenset[int]  # ranks that returned normally from the task
    #: member rank -> what it issued on this group from ``index`` on: whether a side *never*
    #: issued the other's collective, or issued it later
    rest: dict[int, tuple[Collective, ...]] = dataclasses.field(default_factory=dict)

    @property
    def mismatched(self) -> bool:
        """True when the disagreement itself is a bug, not the echo of a rank's failure."""
        issued = {c.signature() for c in self.entries.values() if c is not None}
        if len(issued) > 1:
            return True
        return any(c is None and r in self.finished for r, c in self.entries.items())

    @property
    def deviants(self) -> list[int]:
        """Ranks outside the majority at ``index`` (ties: the side of the lowest rank is right).
        Never evidence of guilt: in a DDP that skips a bucket's all-reduce on the ranks with no
        gradient for it, the majority is the side that is wrong."""
        by_entry: dict[tuple | None, list[int]] = collections.defaultdict(list)
        for rank in sorted(self.entries):
            entry = self.entries[rank]
            by_entry[None if entry is None else entry.signature()].append(rank)
        majority = max(by_entry.values(), key=lambda ranks: (len(ranks), -ranks[0]))
        return [r for r in sorted(self.entries) if r not in majority]

    @property
    def behind(self) -> list[int]:
        """Ranks that issued nothing at ``index`` (for a hang: the ones the others wait for)."""
        return [r for r, c in sorted(self.entries.items()) if c is None]

    def describe(self) -> str:
        where = "the world group" if self.group is None else f"group {list(self.group)}"
        verdict = "ranks issued different collectives" if self.mismatched else "ranks disagree"
        lines = [f"first collective where {verdict}: index {self.index} on {where}"]
        for rank, entry in sorted(self.entries.items()):
            if entry is None:
                lines.append(
                    f"    rank {rank} issued nothing at index {self.index} "
                    f"(it issued {self.lengths[rank]} collectives on {where})"
                )
            else:
                lines.append(f"    rank {rank}: {entry.brief()}")
        if self.mismatched:
            lines += [f"    {line}" for line in self.sides()]
        return "\n".join(lines)

    def sides(self) -> list[str]:
        """What the evidence shows, side by side, blaming nobody: for each collective one side
        issued at ``index``, the ranks that never issued it from there on and where they went
        instead ("ranks 1, 2 never issued the all_reduce that rank 0 issued at mydp.py:80 in
        _launch; they went on to mydp.py:90 in finish")."""
        by_entry: dict[tuple | None, list[int]] = collections.defaultdict(list)
        for rank in sorted(self.entries):
            by_entry[_key(self.entries[rank])].append(rank)
        lines, said = [], set()
        for ranks in by_entry.values():
            entry = self.entries[ranks[0]]
            if entry is None:
                continue
            never = [
                r
                for r in sorted(self.entries)
                if r not in ranks and not any(_key(c) == _key(entry) for c in self.rest.get(r, ()))
            ]
            # the mirror of a line already said ("rank 0 never issued theirs") adds nothing
            if never and (tuple(never), tuple(ranks)) not in said:
                said.add((tuple(ranks), tuple(never)))
                at = f" at {entry.site}" if entry.site else ""
                lines.append(
                    f"{_ranks(never)} never issued the {entry.op} that {_ranks(ranks)} issued{at}; "
                    f"{self._went_on(never)}"
                )
        return lines

    def _went_on(self, ranks: list[int]) -> str:
        """Where ``ranks`` went instead, together when they went to the same place."""
        where = {r: self._next(r) for r in ranks}
        if len(set(where.values())) == 1:
            return f"{'they' if len(ranks) > 1 else 'it'} {where[ranks[0]]}"
        return ", ".join(f"rank {r} {text}" for r, text in where.items())

    def _next(self, rank: int) -> str:
        entry = self.entries[rank]
        if entry is None:
            done = " and returned" if rank in self.finished else ""
            return f"issued no further collective{done}"
        return f"went on to {entry.site or entry.brief()}"


def _key(entry: Collective | None) -> tuple | None:
    """A collective as two sides must agree on it: what pairs, and where it was issued."""
    return None if entry is None else (entry.signature(), entry.site)


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def diagnose(
    sequences: Sequence[Sequence[Collective]], finished: Iterable[int] = ()
) -> Disagreement | None:
    """The first disagreement between the ranks' sequences (rank r's at ``sequences[r]``)."""
    world = len(sequences)
    by_group: dict[tuple[int, ...] | None, dict[int, list[Collective]]] = {None: {}}
    for rank, seq in enumerate(sequences):
        by_group[None].setdefault(rank, [])
        for c in seq:
            if c.group == ():  # a group this rank is not in: nothing to pair
                continue
            by_group.setdefault(c.group, {}).setdefault(rank, []).append(c)
    done = frozenset(finished)
    found = []
    for group, per_rank in by_group.items():
        members = range(world) if group is None else [r for r in group if 0 <= r < world]
        seqs = {r: per_rank.get(r, []) for r in members}
        longest = max((len(s) for s in seqs.values()), default=0)
        for i in range(longest):
            entries = {r: s[i] if i < len(s) else None for r, s in seqs.items()}
            if len({None if c is None else c.signature() for c in entries.values()}) > 1:
                found.append(
                    Disagreement(
                        i,
                        group,
                        entries,
                        {r: len(s) for r, s in seqs.items()},
                        done,
                        {r: tuple(s[i:]) for r, s in seqs.items()},
                    )
                )
                break
    if not found:
        return None
    # World first, then the earliest index; a real mismatch beats the echo of a failure.
    return min(found, key=lambda d: (not d.mismatched, d.group is not None, d.index))


def agreement_summary(sequences: Sequence[Sequence[Collective]]) -> str:
    """One line for sequences that agree: how many collectives, and the last one."""
    lengths = [len(s) for s in sequences]
    if not any(lengths):
        return NO_COLLECTIVE
    longest = max(range(len(sequences)), key=lambda r: lengths[r])
    return (
        f"every rank issued the same {lengths[longest]} collectives; the last was "
        f"index {lengths[longest] - 1}: {sequences[longest][-1].brief()}"
    )

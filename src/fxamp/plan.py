"""The precision plan: one decision per node, its text form, and diffs between plans."""
from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch

from .errors import PlanFormatError
from .policy import dtype_name, parse_dtype

FORMAT = "fxamp precision plan v1"
COLUMNS = ("node", "op", "module", "dtype", "inputs", "rule", "reason")


@dataclass(frozen=True)
class NodePrecision:
    """What one node computes in and why.

    dtype: the node's floating output dtype. rule: "autocast" when it is what torch.autocast
    does for the target, else the fxamp pass (or "user", "runtime") that decided.
    reason: one sentence. op: torch-level label. module: module path ("" for the root).
    inputs: the dtype its floating inputs are cast to (None: left as they come).
    """

    dtype: torch.dtype
    rule: str
    reason: str
    op: str = ""
    module: str = ""
    inputs: Optional[torch.dtype] = None


@dataclass
class Plan:
    """The decisions of one rewrite, keyed by source node name, in graph order."""

    nodes: Dict[str, NodePrecision] = field(default_factory=dict)
    header: Dict[str, str] = field(default_factory=dict)

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, Plan) and self.header == other.header
                and list(self.nodes.items()) == list(other.nodes.items()))

    @property
    def policy(self) -> str:
        """The policy string the plan was made with."""
        return self.header.get("policy", "")

    def count(self, dtype: torch.dtype) -> int:
        """How many nodes compute in ``dtype``."""
        return sum(1 for p in self.nodes.values() if p.dtype == dtype)

    def to_text(self) -> str:
        """One line per node in graph order, aligned columns, a short stable header."""
        out = [f"# {FORMAT}"]
        out += [f"# {key}: {value}" for key, value in self.header.items()]
        rows = [("# " + COLUMNS[0],) + COLUMNS[1:]] + [
            (name, p.op or "-", p.module or "-", dtype_name(p.dtype), dtype_name(p.inputs),
             p.rule, p.reason)
            for name, p in self.nodes.items()
        ]
        widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS) - 1)]
        for row in rows:
            cells = [cell.ljust(widths[j]) for j, cell in enumerate(row[:-1])]
            out.append("  ".join(cells + [row[-1]]).rstrip())
        return "\n".join(out) + "\n"

    @classmethod
    def from_text(cls, text: str) -> "Plan":
        """Parse the text form (data only). Raises PlanFormatError naming the bad line."""
        lines = text.splitlines()
        if not lines or lines[0].strip() != f"# {FORMAT}":
            first = lines[0] if lines else "(empty file)"
            raise PlanFormatError(f"line 1: expected '# {FORMAT}', found {first!r}; "
                                  "is this a plan written by `fxamp plan`?")
        plan = cls()
        saw_columns = False
        for number, line in enumerate(lines[1:], start=2):
            if not line.strip():
                continue
            if line.startswith("#"):
                body = line[1:].strip()
                if body.split()[:1] == ["node"]:
                    saw_columns = True
                    continue
                key, sep, value = body.partition(": ")
                if not sep:
                    raise PlanFormatError(f"line {number}: header line must be '# key: value', "
                                          f"found {line!r}")
                plan.header[key] = value
                continue
            if not saw_columns:
                raise PlanFormatError(f"line {number}: node line before the column header")
            parts = line.split(None, 6)
            if len(parts) != 7:
                raise PlanFormatError(f"line {number}: expected 7 columns ({' '.join(COLUMNS)}),"
                                      f" found {len(parts)}: {line!r}")
            name, op, module, dtype, inputs, rule, reason = parts
            if name in plan.nodes:
                raise PlanFormatError(f"line {number}: node {name!r} appears twice")
            try:
                plan.nodes[name] = NodePrecision(
                    dtype=parse_dtype(dtype), rule=rule, reason=reason,
                    op="" if op == "-" else op, module="" if module == "-" else module,
                    inputs=None if inputs == "-" else parse_dtype(inputs))
            except ValueError as err:
                raise PlanFormatError(f"line {number}: {err}") from None
        if not saw_columns:
            raise PlanFormatError("the plan has no column header line (# node op module ...);"
                                  " the file may be truncated")
        return plan

    def save(self, path: str) -> None:
        """Write the text form to ``path``."""
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(self.to_text())

    @classmethod
    def load(cls, path: str) -> "Plan":
        """Read a plan file written by :meth:`save` or ``fxamp plan``."""
        with open(path, encoding="utf-8") as fh:
            return cls.from_text(fh.read())


_VERSION_KEYS = ("fxamp", "torch")


def _describe(p: NodePrecision) -> str:
    return f"{dtype_name(p.dtype)} {p.rule}: {p.reason}"


def diff(a: Plan, b: Plan) -> str:
    """A readable diff of two plans; the empty string when they decide the same.

    Versions in the header are ignored; other header lines, changed, added and removed nodes
    are listed, then a one-line summary.
    """
    out: List[str] = []
    for key in dict.fromkeys(list(a.header) + list(b.header)):
        if key in _VERSION_KEYS:
            continue
        va, vb = a.header.get(key, "-"), b.header.get(key, "-")
        if va != vb:
            out.append(f"{key}: {va} -> {vb}")
    moves: collections.Counter = collections.Counter()
    changed = added = removed = 0
    for name, pa in a.nodes.items():
        pb = b.nodes.get(name)
        if pb is None:
            removed += 1
            out.append(f"- {name}  {pa.op}  {_describe(pa)}")
        elif pa != pb:
            changed += 1
            if pa.dtype != pb.dtype:
                moves[(dtype_name(pa.dtype).upper(), dtype_name(pb.dtype).upper())] += 1
                out.append(f"~ {name}  {pb.op}  {dtype_name(pa.dtype)} -> {dtype_name(pb.dtype)}"
                           f"  ({pa.rule} -> {pb.rule}: {pb.reason})")
            else:
                out.append(f"~ {name}  {pb.op}  was {_describe(pa)}; now {_describe(pb)}")
    for name, pb in b.nodes.items():
        if name not in a.nodes:
            added += 1
            out.append(f"+ {name}  {pb.op}  {_describe(pb)}")
    if not out:
        return ""
    n_moves = sum(moves.values())
    summary = f"{n_moves} node{'s' if n_moves != 1 else ''} changed precision"
    if moves:
        summary += ": " + ", ".join(f"{n} {src}\u2192{dst}" for (src, dst), n in sorted(moves.items()))
    extra = [f"{changed - n_moves} changed rule/reason" if changed - n_moves else "",
             f"{added} added" if added else "", f"{removed} removed" if removed else ""]
    summary += "".join(f"; {e}" for e in extra if e)
    out.append(summary)
    return "\n".join(out) + "\n"

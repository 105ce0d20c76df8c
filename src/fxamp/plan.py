"""The precision plan: one decision per node, its text form, and diffs between plans."""
from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

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


@dataclass(frozen=True)
class RangeStats:
    """What one node produced on calibration batches (all its floating outputs)."""

    max_abs: float
    underflow: float  # fraction of non-zero values below the low dtype's smallest normal
    nonfinite: int

    def __str__(self) -> str:
        return (f"max_abs={self.max_abs:.6g} underflow={self.underflow:.4f} "
                f"nonfinite={self.nonfinite}")

    @classmethod
    def parse(cls, text: str) -> "RangeStats":
        """Inverse of ``str``: ``max_abs=... underflow=... nonfinite=...``."""
        fields = dict(part.split("=", 1) for part in text.split())
        return cls(float(fields["max_abs"]), float(fields["underflow"]), int(fields["nonfinite"]))


@dataclass
class Plan:
    """The decisions of one rewrite, keyed by source node name, in graph order.

    ``ranges`` holds the calibration statistics the rewrite used (if any), so a later
    rewrite can reuse them without data: ``amp_rewrite(..., calibration_data=plan)``.
    """

    nodes: Dict[str, NodePrecision] = field(default_factory=dict)
    header: Dict[str, str] = field(default_factory=dict)
    ranges: Dict[str, RangeStats] = field(default_factory=dict)

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, Plan) and self.header == other.header
                and list(self.nodes.items()) == list(other.nodes.items())
                and list(self.ranges.items()) == list(other.ranges.items()))

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
        out += [f"@range {name} {stats}" for name, stats in self.ranges.items()]
        return "\n".join(out) + "\n"

    @classmethod
    def from_text(cls, text: str) -> "Plan":
        """Parse the text form (data only). Raises PlanFormatError naming the bad line."""
        lines = text.splitlines()
        if lines and lines[0].startswith("# fxamp precision plan v") and \
                lines[0].strip() != f"# {FORMAT}":
            raise PlanFormatError(
                f"line 1: {lines[0].strip()[2:]!r} is not this fxamp's format ({FORMAT!r}); "
                "regenerate the file with `fxamp check MODULE:FACTORY --plan FILE --update` "
                "(or `fxamp plan ... -o FILE`)")
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
            if line.startswith("@range "):
                parts = line.split(None, 2)
                try:
                    plan.ranges[parts[1]] = RangeStats.parse(parts[2])
                except (IndexError, KeyError, ValueError):
                    raise PlanFormatError(f"line {number}: expected '@range NODE max_abs=X "
                                          f"underflow=Y nonfinite=Z', found {line!r}") from None
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


@dataclass
class _Change:
    kind: str  # "~" changed, "+" added, "-" removed
    name: str
    old: Optional[NodePrecision]
    new: Optional[NodePrecision]


def _changes(a: Plan, b: Plan) -> Tuple[List[Tuple[str, str, str]], List[_Change]]:
    headers = []
    for key in dict.fromkeys(list(a.header) + list(b.header)):
        va, vb = a.header.get(key, "-"), b.header.get(key, "-")
        if key not in _VERSION_KEYS and va != vb:
            headers.append((key, va, vb))
    changes = [_Change("-" if name not in b.nodes else "~", name, pa, b.nodes.get(name))
               for name, pa in a.nodes.items() if b.nodes.get(name) != pa]
    changes += [_Change("+", name, None, pb) for name, pb in b.nodes.items()
                if name not in a.nodes]
    return headers, changes


def _summary(changes: List[_Change]) -> str:
    moves: collections.Counter = collections.Counter(
        (dtype_name(c.old.dtype).upper(), dtype_name(c.new.dtype).upper())
        for c in changes if c.kind == "~" and c.old.dtype != c.new.dtype)  # type: ignore[union-attr]
    n_moves = sum(moves.values())
    kinds = collections.Counter(c.kind for c in changes)
    summary = f"{n_moves} node{'s' if n_moves != 1 else ''} changed precision"
    if moves:
        summary += ": " + ", ".join(f"{n} {src}\u2192{dst}"
                                    for (src, dst), n in sorted(moves.items()))
    extra = [f"{kinds['~'] - n_moves} changed rule/reason" if kinds["~"] - n_moves else "",
             f"{kinds['+']} added" if kinds["+"] else "",
             f"{kinds['-']} removed" if kinds["-"] else ""]
    return summary + "".join(f"; {e}" for e in extra if e)


def _text_line(c: _Change) -> str:
    if c.kind == "-":
        return f"- {c.name}  {c.old.op}  {_describe(c.old)}"  # type: ignore[union-attr]
    if c.kind == "+":
        return f"+ {c.name}  {c.new.op}  {_describe(c.new)}"  # type: ignore[union-attr]
    old, new = c.old, c.new
    if old.dtype != new.dtype:  # type: ignore[union-attr]
        return (f"~ {c.name}  {new.op}  {dtype_name(old.dtype)} -> {dtype_name(new.dtype)}"
                f"  ({old.rule} -> {new.rule}: {new.reason})")  # type: ignore[union-attr]
    return f"~ {c.name}  {new.op}  was {_describe(old)}; now {_describe(new)}"  # type: ignore


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def diff(a: Plan, b: Plan, fmt: str = "text") -> str:
    """A readable diff of two plans; the empty string when they decide the same.

    Versions in the header are ignored; other header lines, changed, added and removed nodes
    are listed, then a one-line summary. ``fmt="markdown"`` gives a table for a pull request.
    """
    if fmt not in ("text", "markdown"):
        raise ValueError(f"unknown diff format {fmt!r}; valid: text, markdown")
    headers, changes = _changes(a, b)
    if not headers and not changes:
        return ""
    if fmt == "text":
        out = [f"{key}: {va} -> {vb}" for key, va, vb in headers]
        out += [_text_line(c) for c in changes]
        out.append(_summary(changes))
        return "\n".join(out) + "\n"
    out = [f"**fxamp plan diff** \u2014 {_summary(changes)}", ""]
    out += [f"- `{key}`: `{va}` \u2192 `{vb}`" for key, va, vb in headers]
    if changes:
        out += ["", "| | node | op | before | after | rule | reason |",
                "|---|---|---|---|---|---|---|"]
        for c in changes:
            ref = c.new or c.old
            before = dtype_name(c.old.dtype) if c.old else ""
            after = dtype_name(c.new.dtype) if c.new else ""
            rule = (c.old.rule + " \u2192 " + c.new.rule if c.old and c.new and
                    c.old.rule != c.new.rule else ref.rule)  # type: ignore[union-attr]
            out.append(f"| {c.kind} | `{c.name}` | `{_cell(ref.op)}` | {before} | {after} | "
                       f"{rule} | {_cell(ref.reason)} |")  # type: ignore[union-attr]
    return "\n".join(out) + "\n"

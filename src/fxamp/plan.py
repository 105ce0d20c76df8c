"""The precision plan: one decision per node, its text form, and diffs between plans."""
from __future__ import annotations

import collections
import os
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch

from .errors import PlanFormatError
from .plan_text import (COLUMNS, FORMAT, FORMAT_V1, REGENERATE_ADVICE, escape_text,  # noqa: F401
                        quote_rest, parse, quote_token)
from .plan_records import NodePrecision, RangeStats  # noqa: F401 - re-exported
from .policy import dtype_name


@dataclass
class Plan:
    """The decisions of one rewrite, keyed by source node name, in graph order.

    ``fxamp.plan_of(gm)`` gives a rewrite's plan; ``Plan.load`` / ``Plan.from_text`` read
    a saved one.

    Attributes:
        nodes: source node name -> its ``NodePrecision``, in graph order.
        header: the header lines (policy, target, dtype, front end, versions...).
        ranges: the calibration statistics the rewrite used (if any), so a later rewrite
            can reuse them without data: ``RewriteConfig.make(calibration_data=plan)``.
        format_version: the text format the plan was read from (2 for plans made in
            memory); a version-1 file has no end marker, so its truncation cannot be
            detected.
    """

    nodes: Dict[str, NodePrecision] = field(default_factory=dict)
    header: Dict[str, str] = field(default_factory=dict)
    ranges: Dict[str, RangeStats] = field(default_factory=dict)
    format_version: int = field(default=2, repr=False)

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, Plan) and self.header == other.header
                and list(self.nodes.items()) == list(other.nodes.items())
                and list(self.ranges.items()) == list(other.ranges.items()))

    @property
    def policy(self) -> str:
        """The policy string the plan was made with."""
        return self.header.get("policy", "")

    @property
    def truncation_checked(self) -> bool:
        """Whether the text this plan was read from proved complete (v2 end marker)."""
        return self.format_version >= 2

    def count(self, dtype: torch.dtype) -> int:
        """How many nodes compute in ``dtype``.

        Args:
            dtype: a floating dtype (``torch.float16``).

        Returns:
            The number of nodes whose ``NodePrecision.dtype`` is ``dtype``.
        """
        return sum(1 for p in self.nodes.values() if p.dtype == dtype)

    def to_text(self) -> str:
        """One line per node in graph order, aligned columns, a short stable header and an
        end marker with the node and range counts (format v2; see the README)."""
        out = [f"# {FORMAT}"]
        for key, value in self.header.items():
            name = quote_token(key) if ":" not in key else escape_text(key)
            out.append(f"# {name}: {quote_rest(value)}")
        rows = [("# " + COLUMNS[0],) + COLUMNS[1:]] + [
            (quote_token(name), quote_token(p.op) if p.op else "-",
             quote_token(p.module) if p.module else "-", dtype_name(p.dtype),
             dtype_name(p.inputs), quote_token(p.rule), quote_rest(p.reason))
            for name, p in self.nodes.items()
        ]
        widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS) - 1)]
        for row in rows:
            cells = [cell.ljust(widths[j]) for j, cell in enumerate(row[:-1])]
            out.append("  ".join(cells + [row[-1]]).rstrip())
        out += [f"@range {quote_token(name)} {stats}" for name, stats in self.ranges.items()]
        out.append(f"# end of plan: {len(self.nodes)} nodes, {len(self.ranges)} ranges")
        return "\n".join(out) + "\n"

    @classmethod
    def from_text(cls, text: str) -> "Plan":
        """Parse the text form (data only).

        Args:
            text: a plan's text, as ``to_text`` writes it.

        Returns:
            The plan; ``Plan.from_text(plan.to_text()) == plan``.

        Raises:
            PlanFormatError: a line that is not a plan line (the message names it), or a
                v2 text that stops before its end marker (a truncated file).
        """
        return parse(text, cls)

    def save(self, path: str) -> None:
        """Write the text form to ``path`` atomically (the old file survives a failure).

        Args:
            path: the file to write.

        Raises:
            OutputFileError: the file cannot be written (the message names the cause).
        """
        from .fileio import atomic_write_text
        atomic_write_text(path, self.to_text())

    @classmethod
    def load(cls, path: str) -> "Plan":
        """Read a plan file written by ``Plan.save`` or ``fxamp plan``.

        Args:
            path: the plan file.

        Returns:
            The plan.

        Raises:
            OSError: the file cannot be read.
            PlanFormatError: it is not a complete plan, including bytes that are not UTF-8
                (the message names the line).
        """
        with open(path, "rb") as fh:
            data = fh.read()
        try:
            text = data.decode("utf-8-sig")
        except UnicodeDecodeError as err:
            line = data.count(b"\n", 0, err.start) + 1
            raise PlanFormatError(
                f"line {line}: byte 0x{data[err.start]:02x} at offset {err.start} is not "
                "UTF-8: this is a binary file or another encoding, not a plan; "
                + REGENERATE_ADVICE) from None
        return cls.from_text(text)


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


@dataclass
class _RangeChange:
    kind: str  # "~" changed, "+" added, "-" removed
    name: str
    old: Optional[RangeStats]
    new: Optional[RangeStats]


def _range_changes(a: Plan, b: Plan) -> List[_RangeChange]:
    """The ``@range`` lines that differ: a range decides fp16 vs fp32 when the plan is
    reused as ``calibration_data``."""
    changes = [_RangeChange("-" if name not in b.ranges else "~", name, ra,
                            b.ranges.get(name))
               for name, ra in a.ranges.items() if b.ranges.get(name) != ra]
    changes += [_RangeChange("+", name, None, rb) for name, rb in b.ranges.items()
                if name not in a.ranges]
    return changes


def _range_line(c: _RangeChange) -> str:
    if c.kind == "~":
        return f"~ @range {c.name}  {c.old} -> {c.new}"
    return f"{c.kind} @range {c.name}  {c.old if c.kind == '-' else c.new}"


def _summary(changes: List[_Change], ranges: Sequence[_RangeChange] = ()) -> str:
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
    range_kinds = collections.Counter(c.kind for c in ranges)
    for kind, word in (("~", "changed"), ("+", "added"), ("-", "removed")):
        n = range_kinds[kind]
        extra.append(f"{n} range{'s' if n != 1 else ''} {word}" if n else "")
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


def _as_plan(plan: Union[Plan, str, "os.PathLike[str]"], which: str) -> Plan:
    if isinstance(plan, Plan):
        return plan
    if isinstance(plan, (str, os.PathLike)):
        return Plan.load(os.fspath(plan))
    raise TypeError(f"diff takes Plans or plan file paths; {which} is a "
                    f"{type(plan).__name__}")


def diff(a: Union[Plan, str, "os.PathLike[str]"], b: Union[Plan, str, "os.PathLike[str]"],
         fmt: str = "text") -> str:
    """A readable diff of two plans; the empty string when they decide the same.

    Versions in the header are ignored; other header lines, changed, added and removed nodes
    and ``@range`` lines (a range decides fp16 vs fp32 when the plan is reused as
    ``calibration_data``) are listed, then a one-line summary.

    Args:
        a: the plan before: a ``Plan`` or the path of a plan file (read with
            ``Plan.load``).
        b: the plan after, the same way.
        fmt: ``"text"`` (one line per change) or ``"markdown"`` (a table for a pull
            request).

    Returns:
        The diff; ``""`` when the plans decide the same.

    Raises:
        ValueError: an unknown ``fmt``.
        TypeError: ``a`` or ``b`` is neither a Plan nor a path.
        PlanFormatError: a plan file is not a complete plan.
    """
    if fmt not in ("text", "markdown"):
        raise ValueError(f"unknown diff format {fmt!r}; valid: text, markdown")
    a, b = _as_plan(a, "the first"), _as_plan(b, "the second")
    headers, changes = _changes(a, b)
    ranges = _range_changes(a, b)
    if not headers and not changes and not ranges:
        return ""
    if fmt == "text":
        out = [f"{key}: {va} -> {vb}" for key, va, vb in headers]
        out += [_text_line(c) for c in changes]
        out += [_range_line(c) for c in ranges]
        out.append(_summary(changes, ranges))
        return "\n".join(out) + "\n"
    out = [f"**fxamp plan diff** \u2014 {_summary(changes, ranges)}", ""]
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
    if ranges:
        out += ([""] if changes else []) + ["| | range of node | before | after |",
                                            "|---|---|---|---|"]
        out += [f"| {c.kind} | `{c.name}` | {c.old or ''} | {c.new or ''} |" for c in ranges]
    return "\n".join(out) + "\n"

"""The precision plan: one decision per node, its text form, and diffs between plans."""
from __future__ import annotations

import collections
import dataclasses
import os
import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch

from .errors import NotPlannedError, PlanFormatError
from .plan_text import (COLUMNS, FORMAT, FORMAT_V1, REGENERATE_ADVICE, escape_text,  # noqa: F401
                        quote_rest, parse, quote_token)
from .plan_records import NodePrecision, RangeStats  # noqa: F401 - re-exported
from .policy import dtype_name

#: the header key that marks a skeleton: ``planned: no`` (absent in a plan made by planning)
PLANNED_KEY = "planned"
#: its value in a skeleton
NOT_PLANNED = "no"


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
    def planned(self) -> bool:
        """False for a skeleton: the plan of a model in block mode before its first call
        (header ``planned: no``), which lists the blocks and the policy but no decision;
        True for any plan made by planning."""
        return self.header.get(PLANNED_KEY) != NOT_PLANNED

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
    #: a change made alike in several blocks of a block-mode plan: their paths (``name``
    #: then spells them ``model.layers.{0..31}/linear_6``), and how many blocks their
    #: container holds; empty for a change of one line
    blocks: Tuple[str, ...] = ()
    total: int = 0

    @property
    def weight(self) -> int:
        """How many plan lines the change stands for."""
        return len(self.blocks) or 1

    @property
    def scope(self) -> str:
        """``[all 32 blocks]`` / ``[2 of 32 blocks]`` for a grouped change, else ``""``."""
        if not self.blocks:
            return ""
        n = len(self.blocks)
        return f"[all {n} blocks]" if n == self.total else f"[{n} of {self.total} blocks]"


def skeleton_refusal(which: str) -> NotPlannedError:
    """The error for a skeleton (:attr:`Plan.planned` False) given where a real plan is
    needed.

    Args:
        which: the plan's name in the message (``the first plan``, a file's path).
    """
    return NotPlannedError(
        f"{which} is a skeleton (its header says '{PLANNED_KEY}: {NOT_PLANNED}'): the plan of "
        "a model in block mode before its first call, which lists the blocks and the policy "
        "but no block's decisions, so there is nothing to compare. what to do: call the "
        "model once (a forward on a real batch) and take fxamp.plan_of(model) again (save "
        "that one in place of the skeleton's file)")


def _changes(a: Plan, b: Plan) -> Tuple[List[Tuple[str, str, str]], List[_Change]]:
    blocks = _is_blocks(a) and _is_blocks(b)
    headers = []
    for key in dict.fromkeys(list(a.header) + list(b.header)):
        va, vb = a.header.get(key, "-"), b.header.get(key, "-")
        # (block mode: which blocks list their own lines is in the lines compared below)
        if key not in _VERSION_KEYS and va != vb and not (blocks and key == "nested"):
            headers.append((key, va, vb))
    if blocks:
        return headers, _block_changes(a, b)
    return headers, _line_changes(a.nodes, b.nodes)


def _line_changes(a: Dict[str, NodePrecision], b: Dict[str, NodePrecision]) -> List[_Change]:
    """The lines of ``a`` changed or removed in ``b``, then those ``b`` adds, by name."""
    changes = [_Change("-" if name not in b else "~", name, pa, b.get(name))
               for name, pa in a.items() if b.get(name) != pa]
    changes += [_Change("+", name, None, pb) for name, pb in b.items() if name not in a]
    return changes


# -- block-mode plans (frontend "blocks", rewriter/blocks.py): one line per block, the lines
# of each distinct block plan once under the first block that has it ("P/node"), the other
# blocks' lines naming it. A diff compares each block's lines (its own or the ones it
# shares), relative to the block, and lists a change made alike in several blocks once.

#: a block line's reason when the block computes with another block's plan (written by
#: ``BlocksRoot.compose``): the group is that block's path
_SAME_PLAN = re.compile(r"the same plan as (\S+) \(its lines \1/\*\)")


def _is_blocks(plan: Plan) -> bool:
    return plan.header.get("frontend") == "blocks"


def _relative(p: NodePrecision, block: str, to: str = "") -> NodePrecision:
    """``p`` (a line of ``block``'s plan) with ``block``'s path in its module and reason
    made ``to`` (``""``: relative to the block)."""
    module = p.module
    if module == block:
        module = to
    elif module.startswith(block + "."):
        module = f"{to}.{module[len(block) + 1:]}" if to else module[len(block) + 1:]
    reason = p.reason.replace(f"{block}/", f"{to}/" if to else "").replace(
        f"{block}.", f"{to}." if to else "")
    return dataclasses.replace(p, module=module, reason=reason)


class _Blocks:
    """A block-mode plan read block by block: each block's lines, relative to it."""

    def __init__(self, plan: Plan) -> None:
        nodes = plan.nodes
        self.paths = [name for name, p in nodes.items() if "/" not in name and p.rule == "nested"]
        known = set(self.paths)
        own: Dict[str, List[str]] = {}
        self.rest: Dict[str, NodePrecision] = {}
        for name, p in nodes.items():
            head = name.split("/", 1)[0]
            if head in known and "/" in name:
                own.setdefault(head, []).append(name)
            elif name not in known:
                self.rest[name] = p
        #: block -> the block whose lines it computes with (None: not planned yet)
        self.source: Dict[str, Optional[str]] = {}
        for path in self.paths:
            same = _SAME_PLAN.search(nodes[path].reason)
            self.source[path] = (path if path in own else same.group(1)
                                 if same and same.group(1) in own else None)
        self.relative = {path: {name[len(path) + 1:]: _relative(nodes[name], path)
                                for name in names} for path, names in own.items()}
        self.nodes = nodes

    def lines(self, path: str) -> Dict[str, NodePrecision]:
        """``path``'s lines by their name relative to it (``{}``: not planned, or not in
        the plan), with module paths and reasons relative to it."""
        source = self.source.get(path)
        return self.relative.get(source, {}) if source else {}

    def shown(self, path: str, rel: str) -> NodePrecision:
        """The line ``rel`` of block ``path`` as its own plan would spell it (``rel`` ""
        is the block's line)."""
        if not rel:
            return self.nodes[path]
        source = self.source[path]
        assert source is not None
        line = self.nodes[f"{source}/{rel}"]
        return line if source == path else _relative(line, source, path)


def _spelled(container: str, paths: Sequence[str]) -> str:
    """``model.layers.{0..31}`` for the paths ``model.layers.0`` ... ``model.layers.31``:
    numeric names in runs (``{0..3,7}``), others listed."""
    names = [path.rpartition(".")[2] for path in paths]
    if all(n.isdigit() for n in names):
        numbers = sorted(set(int(n) for n in names))
        runs: List[List[int]] = []
        for n in numbers:
            if runs and n == runs[-1][-1] + 1:
                runs[-1].append(n)
            else:
                runs.append([n])
        parts = [f"{r[0]}..{r[-1]}" if len(r) > 2 else ",".join(map(str, r)) for r in runs]
        spec = ",".join(parts)
    else:
        spec = ",".join(names)
    return f"{container}.{{{spec}}}" if container else f"{{{spec}}}"


def _block_changes(a: Plan, b: Plan) -> List[_Change]:
    """The changes between two block-mode plans: the other lines by name, then each block's
    lines compared relative to the block, a change made alike in several blocks of one
    container (same relative line, same before and after) once, naming them."""
    va, vb = _Blocks(a), _Blocks(b)
    changes = _line_changes(va.rest, vb.rest)
    order = list(dict.fromkeys(va.paths + vb.paths))
    totals = collections.Counter(path.rpartition(".")[0] for path in order)
    found: Dict[tuple, List[str]] = {}  # (rel, kind, old, new, container) -> blocks

    def add(path: str, rel: str, old: Optional[NodePrecision],
            new: Optional[NodePrecision]) -> None:
        kind = "-" if new is None else "+" if old is None else "~"
        found.setdefault((rel, kind, old, new, path.rpartition(".")[0]), []).append(path)

    for path in order:
        pa, pb = a.nodes.get(path), b.nodes.get(path)
        # (the block's own line: when it is planned in both, what changed is in its lines)
        if pa != pb and not (va.source.get(path) and vb.source.get(path)):
            add(path, "", pa and _relative(pa, path), pb and _relative(pb, path))
        la, lb = va.lines(path), vb.lines(path)
        for rel, old in la.items():
            if lb.get(rel) != old:
                add(path, rel, old, lb.get(rel))
        for rel, new in lb.items():
            if rel not in la:
                add(path, rel, None, new)
    for (rel, kind, old, new, container), paths in found.items():
        if len(paths) == 1:
            path = paths[0]
            changes.append(_Change(kind, f"{path}/{rel}" if rel else path,
                                   va.shown(path, rel) if old else None,
                                   vb.shown(path, rel) if new else None))
            continue
        name = _spelled(container, paths)
        changes.append(_Change(kind, f"{name}/{rel}" if rel else name, old, new,
                               tuple(paths), totals[container]))
    return changes


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


def _partitions_note(a: Plan, b: Plan) -> str:
    """The summary's note where one plan is in block mode and the other is not: their node
    names differ (``model.layers.0/linear`` against ``linear_3``), so their lines are
    listed as removed and added, not compared ("" where the partitions are alike)."""
    if _is_blocks(a) == _is_blocks(b):
        return ""
    first, second = ("in block mode", "one graph") if _is_blocks(a) else ("one graph",
                                                                          "in block mode")
    return (f"; the first plan is {first} and the second {second}: their node names "
            "differ, so their lines are listed as removed and added, not compared (compare "
            "plans of one partition: fxamp plan --partition blocks or flat)")


def _summary(changes: List[_Change], ranges: Sequence[_RangeChange] = ()) -> str:
    moves: collections.Counter = collections.Counter()
    kinds: collections.Counter = collections.Counter()
    for c in changes:
        kinds[c.kind] += c.weight
        if c.kind == "~" and c.old.dtype != c.new.dtype:  # type: ignore[union-attr]
            moves[(dtype_name(c.old.dtype).upper(),  # type: ignore[union-attr]
                   dtype_name(c.new.dtype).upper())] += c.weight  # type: ignore[union-attr]
    n_moves = sum(moves.values())
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
    line = _one_line(c)
    return f"{line}  {c.scope}" if c.scope else line


def _one_line(c: _Change) -> str:
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

    Two block-mode plans (``frontend: blocks``) are compared block by block, each block's
    lines relative to it (its own, or those of the block whose plan it shares): a change
    made alike in several blocks of one container is one entry naming them,
    ``~ model.layers.{0..31}/linear_6  aten.linear  bf16 -> fp32  (...)  [all 32 blocks]``
    (``[2 of 32 blocks]`` and ``model.layers.{1,5}`` when not all), a change in one block
    the line of that block; the summary counts each block's line.

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
        NotPlannedError: ``a`` or ``b`` is a skeleton (``Plan.planned`` False: a block-mode
            model's plan before its first call), which has no decisions to compare.
    """
    if fmt not in ("text", "markdown"):
        raise ValueError(f"unknown diff format {fmt!r}; valid: text, markdown")
    a, b = _as_plan(a, "the first"), _as_plan(b, "the second")
    for plan, which in ((a, "the first plan"), (b, "the second plan")):
        if not plan.planned:
            raise skeleton_refusal(which)
    headers, changes = _changes(a, b)
    ranges = _range_changes(a, b)
    if not headers and not changes and not ranges:
        return ""
    summary = _summary(changes, ranges) + _partitions_note(a, b)
    if fmt == "text":
        out = [f"{key}: {va} -> {vb}" for key, va, vb in headers]
        out += [_text_line(c) for c in changes]
        out += [_range_line(c) for c in ranges]
        out.append(summary)
        return "\n".join(out) + "\n"
    out = [f"**fxamp plan diff** \u2014 {summary}", ""]
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
            scope = f" {c.scope}" if c.scope else ""
            out.append(f"| {c.kind} | `{c.name}`{scope} | `{_cell(ref.op)}` | {before} | "
                       f"{after} | {rule} | {_cell(ref.reason)} |")  # type: ignore[union-attr]
    if ranges:
        out += ([""] if changes else []) + ["| | range of node | before | after |",
                                            "|---|---|---|---|"]
        out += [f"| {c.kind} | `{c.name}` | {c.old or ''} | {c.new or ''} |" for c in ranges]
    return "\n".join(out) + "\n"

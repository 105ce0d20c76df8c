"""The precision plan: one decision per node, its text form, and diffs between plans."""
from __future__ import annotations

import collections
import json
import logging
import math
import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch

from .errors import PlanFormatError
from .policy import dtype_name, parse_dtype

FORMAT = "fxamp precision plan v2"
FORMAT_V1 = "fxamp precision plan v1"
COLUMNS = ("node", "op", "module", "dtype", "inputs", "rule", "reason")
_END = re.compile(r"# end of plan: (\d+) nodes, (\d+) ranges")  # always plural: a cut shows
_REGENERATE = ("regenerate it with `fxamp check MODULE:FACTORY --plan FILE --update` (or "
               "`fxamp plan ... -o FILE`), or restore it from version control")

log = logging.getLogger(__name__)


def _escape(text: str) -> str:
    """A JSON string literal for ``text`` in which every non-printable character (line
    breaks included) is escaped, so the literal never spans lines."""
    body = json.dumps(text, ensure_ascii=False)[1:-1]
    return '"' + "".join(c if c.isprintable() else json.dumps(c)[1:-1] for c in body) + '"'


def quote_token(text: str) -> str:
    """``text`` as one whitespace-free plan column: itself when it is a plain printable
    word, else a JSON string literal (empty, ``-``, whitespace, quotes, a leading ``#`` or
    ``@``, non-printable characters)."""
    plain = (text and text != "-" and text[0] not in "#@" and
             all(c.isprintable() and not c.isspace() and c != '"' for c in text))
    return text if plain else _escape(text)


def _quote_rest(text: str) -> str:
    """The last column (reason, header value): free text, quoted only when it would not
    read back the same (empty, edge whitespace, a leading quote, non-printable)."""
    plain = (text and text == text.strip() and not text.startswith('"') and
             all(c.isprintable() for c in text))
    return text if plain else _escape(text)


class _Line:
    """A cursor over one line that reads plain or quoted tokens (v2 syntax)."""

    _decoder = json.JSONDecoder()

    def __init__(self, text: str, number: int):
        self.text, self.number, self.pos = text, number, 0

    def error(self, problem: str) -> PlanFormatError:
        return PlanFormatError(f"line {self.number}: {problem}: {self.text!r}")

    def _skip(self) -> None:
        while self.pos < len(self.text) and self.text[self.pos].isspace():
            self.pos += 1

    def _quoted(self) -> str:
        try:
            value, self.pos = self._decoder.raw_decode(self.text, self.pos)
        except json.JSONDecodeError as err:
            raise self.error(f"bad quoted string at column {self.pos + 1} ({err.msg})") from None
        if not isinstance(value, str):
            raise self.error(f"expected a quoted string at column {self.pos + 1}")
        return value

    def token(self, what: str) -> Tuple[str, bool]:
        """The next column and whether it was quoted."""
        self._skip()
        if self.pos >= len(self.text):
            raise self.error(f"expected 7 columns ({' '.join(COLUMNS)}), the {what} is "
                             "missing")
        if self.text[self.pos] == '"':
            value = self._quoted()
            if self.pos < len(self.text) and not self.text[self.pos].isspace():
                raise self.error(f"text right after the quoted {what}")
            return value, True
        start = self.pos
        while self.pos < len(self.text) and not self.text[self.pos].isspace():
            self.pos += 1
        return self.text[start:self.pos], False

    def rest(self, what: str) -> str:
        """The remainder of the line as one value (quoted or plain)."""
        self._skip()
        if self.pos < len(self.text) and self.text[self.pos] == '"':
            value = self._quoted()
            if self.text[self.pos:].strip():
                raise self.error(f"text after the quoted {what}")
            return value
        value = self.text[self.pos:].rstrip()
        if not value:
            raise self.error(f"the {what} is missing")
        return value


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
        """Inverse of ``str``: ``max_abs=... underflow=... nonfinite=...``. Raises
        ValueError unless the three fields are there once each, finite and non-negative
        (``underflow`` a fraction, ``nonfinite`` an integer count)."""
        pairs = [part.split("=", 1) for part in text.split()]
        if any(len(p) != 2 for p in pairs) or \
                sorted(k for k, _ in pairs) != ["max_abs", "nonfinite", "underflow"]:
            raise ValueError("expected max_abs=X underflow=Y nonfinite=Z, each once")
        fields = dict(pairs)  # type: ignore[arg-type]
        max_abs, underflow = float(fields["max_abs"]), float(fields["underflow"])
        nonfinite = int(fields["nonfinite"])
        for key, value in (("max_abs", max_abs), ("underflow", underflow)):
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{key}={fields[key]} must be finite and non-negative")
        if underflow > 1:
            raise ValueError(f"underflow={fields['underflow']} is a fraction: at most 1")
        if nonfinite < 0:
            raise ValueError(f"nonfinite={fields['nonfinite']} is a count: not negative")
        return cls(max_abs, underflow, nonfinite)


@dataclass
class Plan:
    """The decisions of one rewrite, keyed by source node name, in graph order.

    ``ranges`` holds the calibration statistics the rewrite used (if any), so a later
    rewrite can reuse them without data: ``amp_rewrite(..., calibration_data=plan)``.
    ``format_version`` is the text format the plan was read from (2 for plans made in
    memory); a version-1 file has no end marker, so its truncation cannot be detected.
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
        """How many nodes compute in ``dtype``."""
        return sum(1 for p in self.nodes.values() if p.dtype == dtype)

    def to_text(self) -> str:
        """One line per node in graph order, aligned columns, a short stable header and an
        end marker with the node and range counts (format v2; see the README)."""
        out = [f"# {FORMAT}"]
        for key, value in self.header.items():
            name = quote_token(key) if ":" not in key else _escape(key)
            out.append(f"# {name}: {_quote_rest(value)}")
        rows = [("# " + COLUMNS[0],) + COLUMNS[1:]] + [
            (quote_token(name), quote_token(p.op) if p.op else "-",
             quote_token(p.module) if p.module else "-", dtype_name(p.dtype),
             dtype_name(p.inputs), quote_token(p.rule), _quote_rest(p.reason))
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
        """Parse the text form (data only). Raises PlanFormatError naming the bad line; a
        v2 text that stops before its end marker (a truncated file) is an error too."""
        lines = text.splitlines()
        nul = text.find("\x00")
        if nul >= 0:
            raise PlanFormatError(f"line {text.count(chr(10), 0, nul) + 1}: a NUL byte: this "
                                  "is a binary file, not a plan; " + _REGENERATE)
        first = lines[0].strip() if lines else ""
        if first == f"# {FORMAT_V1}":
            log.warning("reading a version-1 plan: it has no end marker, so a truncated file "
                        "cannot be detected; rewrite it with `fxamp check ... --update` to "
                        "get version 2")
            return _parse_v1(cls, lines)
        if first.startswith("# fxamp precision plan v") and first != f"# {FORMAT}":
            raise PlanFormatError(
                f"line 1: {first[2:]!r} is not a format this fxamp reads ({FORMAT!r} or "
                f"{FORMAT_V1!r}); " + _REGENERATE)
        if first != f"# {FORMAT}":
            raise PlanFormatError(f"line 1: expected '# {FORMAT}', found "
                                  f"{lines[0] if lines else '(empty file)'!r}; is this a plan "
                                  "written by `fxamp plan`?")
        return _parse_v2(cls, lines)

    def save(self, path: str) -> None:
        """Write the text form to ``path`` atomically (the old file survives a failure;
        OutputFileError names the cause)."""
        from .fileio import atomic_write_text
        atomic_write_text(path, self.to_text())

    @classmethod
    def load(cls, path: str) -> "Plan":
        """Read a plan file written by :meth:`save` or ``fxamp plan``. OSError when it
        cannot be read; PlanFormatError (naming the line) when it is not a complete plan,
        including bytes that are not UTF-8."""
        with open(path, "rb") as fh:
            data = fh.read()
        try:
            text = data.decode("utf-8-sig")
        except UnicodeDecodeError as err:
            line = data.count(b"\n", 0, err.start) + 1
            raise PlanFormatError(
                f"line {line}: byte 0x{data[err.start]:02x} at offset {err.start} is not "
                "UTF-8: this is a binary file or another encoding, not a plan; "
                + _REGENERATE) from None
        return cls.from_text(text)


def _parse_v2(cls: type, lines: List[str]) -> Plan:
    plan = cls()
    saw_columns = False
    end: Optional[int] = None
    for number, raw in enumerate(lines[1:], start=2):
        if not raw.strip():
            continue
        if end is not None:
            raise PlanFormatError(f"line {number}: text after the end marker (line {end}): "
                                  f"{raw!r}; the file holds more than one plan or was edited")
        line = _Line(raw, number)
        if raw.startswith("# end of plan"):
            match = _END.fullmatch(raw.rstrip())
            if not match:
                raise line.error("malformed end marker (expected '# end of plan: N nodes, "
                                 "M ranges'); the file may be truncated")
            n_nodes, n_ranges = int(match.group(1)), int(match.group(2))
            if (n_nodes, n_ranges) != (len(plan.nodes), len(plan.ranges)):
                raise line.error(f"the end marker counts {n_nodes} nodes and {n_ranges} "
                                 f"ranges, the file has {len(plan.nodes)} and "
                                 f"{len(plan.ranges)}: lines are missing or were added")
            end = number
            continue
        if raw.startswith("#"):
            body = raw[1:].strip()
            if body.split()[:1] == ["node"]:
                if saw_columns:
                    raise line.error("a second column header line")
                saw_columns = True
                continue
            if saw_columns:
                raise line.error("header line after the column header")
            line.pos = raw.index(body[0]) if body else len(raw)
            if body.startswith('"'):
                key = line._quoted()
                if not raw[line.pos:].startswith(": "):
                    raise line.error("header line must be '# key: value'")
                line.pos += 2
            else:
                key, sep, _ = body.partition(": ")
                if not sep:
                    raise line.error("header line must be '# key: value'")
                line.pos = raw.index(": ") + 2
            plan.header[key] = line.rest("header value") if raw[line.pos:].strip() else ""
            continue
        if raw.startswith("@range"):
            line.pos = len("@range")
            if not raw[line.pos:line.pos + 1].isspace():
                raise line.error("expected '@range NODE max_abs=X underflow=Y nonfinite=Z'")
            name, _ = line.token("range node")
            if name in plan.ranges:
                raise line.error(f"a second range for node {name!r}")
            try:
                plan.ranges[name] = RangeStats.parse(raw[line.pos:])
            except ValueError as err:
                raise line.error(f"bad range ({err})") from None
            continue
        if not saw_columns:
            raise line.error("node line before the column header")
        if plan.ranges:
            raise line.error("node line after the @range lines")
        cells = [line.token(column) for column in COLUMNS[:-1]]
        reason = line.rest("reason")
        (name, _), (op, op_q), (module, mod_q) = cells[:3]
        (dtype, _), (inputs, _), (rule, _) = cells[3:]
        if name in plan.nodes:
            raise line.error(f"node {name!r} appears twice")
        try:
            plan.nodes[name] = NodePrecision(
                dtype=parse_dtype(dtype), rule=rule, reason=reason,
                op="" if op == "-" and not op_q else op,
                module="" if module == "-" and not mod_q else module,
                inputs=None if inputs == "-" else parse_dtype(inputs))
        except ValueError as err:
            raise line.error(str(err)) from None
    if end is None:
        last = len(lines)
        raise PlanFormatError(
            f"line {last}: the plan ends without its end marker ('# end of plan: N nodes, M "
            f"ranges'; last line: {lines[-1]!r}): the file is truncated; " + _REGENERATE)
    if not saw_columns:
        raise PlanFormatError("the plan has no column header line (# node op module ...)")
    return plan


def _parse_v1(cls: type, lines: List[str]) -> Plan:
    """Version 1: whitespace-separated columns, no quoting, no end marker."""
    plan = cls(format_version=1)
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
            except (IndexError, KeyError, ValueError) as err:
                raise PlanFormatError(f"line {number}: expected '@range NODE max_abs=X "
                                      f"underflow=Y nonfinite=Z' ({err}), found "
                                      f"{line!r}") from None
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

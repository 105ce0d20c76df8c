"""The plan's text form, format v2: quoting, the end marker, and the parsers (v2 and v1).

A column that is not a plain printable word is a JSON string literal; the file ends with
``# end of plan: N nodes, M ranges`` so a cut anywhere is detected. See the README section
"The plan file format: what it guarantees".
"""
from __future__ import annotations

import json
import logging
import re
from typing import Any, List, Optional, Tuple

from .errors import PlanFormatError, excerpt
from .plan_records import NodePrecision, RangeStats
from .policy import parse_dtype

log = logging.getLogger(__name__)

FORMAT = "fxamp precision plan v2"
FORMAT_V1 = "fxamp precision plan v1"
COLUMNS = ("node", "op", "module", "dtype", "inputs", "rule", "reason")
_END = re.compile(r"# end of plan: (\d+) nodes, (\d+) ranges")  # always plural: a cut shows
_COUNT_DIGITS = 18  # an end-marker count longer than this is no count (int() refuses 4300)
REGENERATE_ADVICE = ("regenerate it with `fxamp check MODULE:FACTORY --plan FILE --update` (or "
               "`fxamp plan ... -o FILE`), or restore it from version control")

def escape_text(text: str) -> str:
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
    return text if plain else escape_text(text)


def quote_rest(text: str) -> str:
    """The last column (reason, header value): free text, quoted only when it would not
    read back the same (empty, edge whitespace, a leading quote, non-printable)."""
    plain = (text and text == text.strip() and not text.startswith('"') and
             all(c.isprintable() for c in text))
    return text if plain else escape_text(text)


class _Line:
    """A cursor over one line that reads plain or quoted tokens (v2 syntax)."""

    _decoder = json.JSONDecoder()

    def __init__(self, text: str, number: int):
        self.text, self.number, self.pos = text, number, 0

    def error(self, problem: str) -> PlanFormatError:
        return PlanFormatError(f"line {self.number}: {problem}: {excerpt(self.text)}")

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


def parse(text: str, cls: type) -> Any:
    """Parse a plan's text form into ``cls`` (a :class:`fxamp.plan.Plan`): v2, or v1 with a
    warning. Raises PlanFormatError naming the line."""
    lines = text.splitlines()
    nul = text.find("\x00")
    if nul >= 0:
        raise PlanFormatError(f"line {text.count(chr(10), 0, nul) + 1}: a NUL byte: this "
                              "is a binary file, not a plan; " + REGENERATE_ADVICE)
    first = lines[0].strip() if lines else ""
    if first == f"# {FORMAT_V1}":
        log.warning("reading a version-1 plan: it has no end marker, so a truncated file "
                    "cannot be detected; rewrite it with `fxamp check ... --update` to "
                    "get version 2")
        return _parse_v1(cls, lines)
    if first.startswith("# fxamp precision plan v") and first != f"# {FORMAT}":
        raise PlanFormatError(
            f"line 1: {excerpt(first[2:])} is not a format this fxamp reads ({FORMAT!r} or "
            f"{FORMAT_V1!r}); " + REGENERATE_ADVICE)
    if first != f"# {FORMAT}":
        raise PlanFormatError(f"line 1: expected '# {FORMAT}', found "
                              f"{excerpt(lines[0] if lines else '(empty file)')}; is this a "
                              "plan written by `fxamp plan`?")
    return _parse_v2(cls, lines)


def _parse_v2(cls: type, lines: List[str]) -> Any:
    """Version 2: header, column line, node lines, @range lines, end marker (checked)."""
    plan = cls()
    saw_columns = False
    end: Optional[int] = None
    for number, raw in enumerate(lines[1:], start=2):
        if not raw.strip():
            continue
        if end is not None:
            raise PlanFormatError(f"line {number}: text after the end marker (line {end}): "
                                  f"{excerpt(raw)}; the file holds more than one plan or was "
                                  "edited")
        line = _Line(raw, number)
        if raw.startswith("# end of plan"):
            match = _END.fullmatch(raw.rstrip())
            if not match:
                raise line.error("malformed end marker (expected '# end of plan: N nodes, "
                                 "M ranges'); the file may be truncated")
            if max(len(match.group(1)), len(match.group(2))) > _COUNT_DIGITS:
                raise line.error(f"the end marker's counts have more than {_COUNT_DIGITS} "
                                 "digits: the file was edited or corrupted; " + REGENERATE_ADVICE)
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
                raise line.error("a '#' line after the column header (only node lines, "
                                 "@range lines and the end marker follow it); the file may "
                                 "be truncated or edited")
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
                raise line.error(f"a second range for node {excerpt(name)}")
            if name not in plan.nodes:
                raise line.error(f"a range for node {excerpt(name)}, which the plan has no "
                                 "line for (a range belongs to a node of the plan); "
                                 + REGENERATE_ADVICE)
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
            raise line.error(f"node {excerpt(name)} appears twice")
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
            f"ranges'; last line: {excerpt(lines[-1])}): the file is truncated; "
            + REGENERATE_ADVICE)
    if not saw_columns:
        raise PlanFormatError("the plan has no column header line (# node op module ...)")
    return plan


def _parse_v1(cls: type, lines: List[str]) -> Any:
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
                                      f"found {excerpt(line)}")
            plan.header[key] = value
            continue
        if line.startswith("@range "):
            parts = line.split(None, 2)
            try:
                plan.ranges[parts[1]] = RangeStats.parse(parts[2])
            except (IndexError, KeyError, ValueError) as err:
                raise PlanFormatError(f"line {number}: expected '@range NODE max_abs=X "
                                      f"underflow=Y nonfinite=Z' ({err}), found "
                                      f"{excerpt(line)}") from None
            continue
        if not saw_columns:
            raise PlanFormatError(f"line {number}: node line before the column header")
        parts = line.split(None, 6)
        if len(parts) != 7:
            raise PlanFormatError(f"line {number}: expected 7 columns ({' '.join(COLUMNS)}),"
                                  f" found {len(parts)}: {excerpt(line)}")
        name, op, module, dtype, inputs, rule, reason = parts
        if name in plan.nodes:
            raise PlanFormatError(f"line {number}: node {excerpt(name)} appears twice")
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
    unknown = [name for name in plan.ranges if name not in plan.nodes]
    if unknown:
        raise PlanFormatError(f"a range for node {excerpt(unknown[0])}, which the plan has "
                              "no line for (a range belongs to a node of the plan); "
                              + REGENERATE_ADVICE)
    return plan

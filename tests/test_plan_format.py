"""Plan text format v2: quoting, end marker, truncation anywhere, bad bytes, bad ranges, v1."""
import logging

import pytest
import torch
import torch.nn as nn

import fxamp
from fxamp.demo import small_cnn
from fxamp.plan import NodePrecision, Plan, RangeStats

ODD_NAMES = ["m fp32", 'a"b', "gr\u00f6\u00dfe", "\u5c42.0", "-", "#hash", "@range", "back\\slash",
             "tab\there", "new\nline", "sep\u2028arator", "nbsp\u00a0x", " lead", ""]


@pytest.fixture(scope="module")
def real_plan():
    model, inputs = small_cnn()
    plan = fxamp.plan_of(fxamp.amp_rewrite(model, inputs))
    # two range lines too, so that section is cut as well
    plan.ranges = {"conv1": RangeStats(12.5, 0.0125, 0), "fc": RangeStats(3.0, 0.0, 2)}
    return plan


def test_truncation_at_every_line_and_every_character_is_detected(real_plan):
    text = real_plan.to_text()
    assert Plan.from_text(text) == real_plan
    lines = text.splitlines(keepends=True)
    assert len(lines) == 20  # 5 header lines, columns, 11 nodes, 2 ranges, end marker
    for n in range(len(lines)):
        with pytest.raises(fxamp.PlanFormatError, match=r"^line \d+: "):
            Plan.from_text("".join(lines[:n]))
    # cut anywhere inside a line, including inside the end marker
    for cut in range(len(text) - 1):
        with pytest.raises(fxamp.PlanFormatError, match=r"^line \d+: "):
            Plan.from_text(text[:cut])
    assert Plan.from_text(text[:-1]) == real_plan  # only the final newline gone: complete


def test_truncation_names_the_last_line():
    model, inputs = small_cnn()
    text = fxamp.plan_of(fxamp.amp_rewrite(model, inputs)).to_text()
    cut = "".join(text.splitlines(keepends=True)[:9])
    with pytest.raises(fxamp.PlanFormatError, match=r"^line 9: the plan ends without its end "
                       r"marker .*last line: 'bn1 .*truncated"):
        Plan.from_text(cut)
    # cut inside the header: no node at all is a truncation too (v1 read it as 0 nodes)
    with pytest.raises(fxamp.PlanFormatError, match=r"^line 3: .*truncated"):
        Plan.from_text("".join(text.splitlines(keepends=True)[:3]))


def test_odd_names_round_trip_one_line_per_node():
    nodes = {}
    for i, name in enumerate(ODD_NAMES):
        nodes[name or "x"] = NodePrecision(torch.float16, "autocast" if i % 2 else "my rule",
                                           f"reason {name}" if i % 3 else name,
                                           op=name, module=name, inputs=torch.float32)
    plan = Plan(nodes=nodes, header={"policy": "fp32:m fp32", "note": " spaced ",
                                     "key: colon": "", "node": "x"},
                ranges={name or "x": RangeStats(1.5, 0.25, 1) for name in ODD_NAMES})
    text = plan.to_text()
    again = Plan.from_text(text)
    assert again == plan and again.to_text() == text
    assert len(text.splitlines()) == 1 + 4 + 1 + len(nodes) + len(ODD_NAMES) + 1
    assert '"m fp32"' in text and '"a\\"b"' in text
    assert "gr\u00f6\u00dfe" in text  # printable unicode stays readable, unquoted


def test_a_plain_plan_needs_no_quotes(real_plan):
    assert '"' not in real_plan.to_text()


class OddNames(nn.Module):
    def __init__(self):
        super().__init__()
        self.add_module("m fp32", nn.Linear(8, 8))
        self.add_module('a"b', nn.Linear(8, 8))
        self.add_module("gr\u00f6\u00dfe", nn.LayerNorm(8))

    def forward(self, x):
        x = getattr(self, "m fp32")(x)
        x = getattr(self, 'a"b')(x)
        return getattr(self, "gr\u00f6\u00dfe")(x)


def test_module_names_with_spaces_quotes_and_unicode_rewrite_run_and_round_trip(tmp_path):
    model, x = OddNames(), torch.randn(4, 8)
    gm = fxamp.amp_rewrite(model, (x,), "fp32:m fp32")
    plan = fxamp.plan_of(gm)
    assert {p.module for p in plan.nodes.values()} >= {"m fp32", 'a"b', "gr\u00f6\u00dfe"}
    assert [p.dtype for p in plan.nodes.values() if p.module == "m fp32"] == [torch.float32]
    assert [p.dtype for p in plan.nodes.values() if p.module == 'a"b'] == [torch.float16]
    with torch.no_grad():
        assert torch.allclose(gm(x), model(x), atol=1e-2)
    path = tmp_path / "odd.plan"
    plan.save(str(path))
    assert Plan.load(str(path)) == plan
    assert fxamp.diff(Plan.load(str(path)), plan) == ""


@pytest.mark.parametrize("stats, problem", [
    ("max_abs=nan underflow=0.0000 nonfinite=0", "max_abs=nan must be finite"),
    ("max_abs=inf underflow=0.0000 nonfinite=0", "max_abs=inf must be finite"),
    ("max_abs=-1 underflow=0.0000 nonfinite=0", "max_abs=-1 must be finite and non-negative"),
    ("max_abs=1 underflow=inf nonfinite=0", "underflow=inf must be finite"),
    ("max_abs=1 underflow=1.5 nonfinite=0", "underflow=1.5 is a fraction"),
    ("max_abs=1 underflow=0 nonfinite=-3", "nonfinite=-3 is a count"),
    ("max_abs=1 underflow=0", "each once"),
    ("max_abs=1 underflow=0 nonfinite=0 max_abs=2", "each once"),
])
def test_bad_range_values_name_the_line(real_plan, stats, problem):
    text = real_plan.to_text().replace(f"@range fc {real_plan.ranges['fc']}",
                                       f"@range fc {stats}")
    assert stats in text
    with pytest.raises(fxamp.PlanFormatError, match=rf"^line 19: bad range \(.*{problem}"):
        Plan.from_text(text)


def test_non_utf8_and_binary_files_are_plan_format_errors(tmp_path, real_plan):
    latin = tmp_path / "latin1.plan"
    latin.write_bytes(real_plan.to_text().replace("model input", "mod\u00e8le").encode("latin-1"))
    with pytest.raises(fxamp.PlanFormatError, match=r"^line 7: byte 0xe8 at offset \d+ is not "
                       "UTF-8"):
        Plan.load(str(latin))
    binary = tmp_path / "weights.plan"
    binary.write_bytes(bytes(range(256)) * 4)
    with pytest.raises(fxamp.PlanFormatError, match=r"^line 2: byte 0x80 at offset 128 is "
                       "not UTF-8"):  # bytes 0-127 are ASCII, with one newline
        Plan.load(str(binary))
    nul = tmp_path / "nul.plan"
    nul.write_bytes(real_plan.to_text().encode() + b"\x00\x00")
    with pytest.raises(fxamp.PlanFormatError, match=r"^line 21: a NUL byte: this is a binary"):
        Plan.load(str(nul))


def test_version_1_files_still_load_and_say_truncation_is_unchecked(real_plan, caplog):
    v2 = real_plan.to_text()
    v1 = v2.replace("plan v2", "plan v1").replace("# end of plan: 11 nodes, 2 ranges\n", "")
    with caplog.at_level(logging.WARNING, logger="fxamp.plan_text"):
        old = Plan.from_text(v1)
    assert old == real_plan and old.format_version == 1 and not old.truncation_checked
    assert "cannot be detected" in caplog.text
    assert Plan.from_text(v2).truncation_checked
    assert old.to_text() == v2  # saving it again writes version 2


def test_the_readme_plan_block_is_real_output():
    from pathlib import Path
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    block = readme.split("## The plan\n", 1)[1].split("```\n", 2)[1]
    model, inputs = small_cnn()
    assert fxamp.plan_of(fxamp.amp_rewrite(
        model, inputs, fxamp.RewriteConfig.make(target="cuda"))).to_text() == block

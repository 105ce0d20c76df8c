"""``@range`` lines in diffs and when reading: a range decides fp16 vs fp32 when a plan is
reused as ``calibration_data``, so a changed range is a difference, and a range for a node
the plan does not have is an error naming the line."""
import pytest
import torch.nn as nn

import fxamp
from fxamp.cli import main
from fxamp.plan import Plan, RangeStats


class Wide(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x) * 1000.0


@pytest.fixture(scope="module")
def calibrated():
    import torch
    torch.manual_seed(0)
    model, x = Wide(), (torch.randn(2, 4),)
    return model, x, fxamp.plan_of(fxamp.amp_rewrite(
        model, x, fxamp.RewriteConfig.make(calibration_data=[x])))


def _with_range(plan, name, **change):
    text = Plan.from_text(plan.to_text())
    old = text.ranges[name]
    text.ranges[name] = RangeStats(**{**old.__dict__, **change})
    return text


def test_a_changed_range_is_a_difference(calibrated):
    _, _, plan = calibrated
    assert plan.ranges and set(plan.ranges) <= set(plan.nodes)
    other = _with_range(plan, "mul", max_abs=70000.0)
    assert fxamp.diff(plan, plan) == ""
    text = fxamp.diff(plan, other)
    old = plan.ranges["mul"]
    assert f"~ @range mul  {old} -> max_abs=70000 underflow={old.underflow:.4f} nonfinite=0" \
        in text.splitlines()
    assert text.splitlines()[-1] == "0 nodes changed precision; 1 range changed"
    table = fxamp.diff(plan, other, fmt="markdown")
    assert f"| ~ | `mul` | {old} | max_abs=70000 underflow=" in table
    assert "1 range changed" in table.splitlines()[0]


def test_the_changed_range_changes_what_a_reuse_decides(calibrated):
    """Why a range is part of the plan: reusing the edited plan keeps mul in FP32."""
    import torch
    model, x, plan = calibrated
    other = _with_range(plan, "mul", max_abs=70000.0)
    reused = fxamp.plan_of(fxamp.amp_rewrite(model, x,
                                             fxamp.RewriteConfig.make(calibration_data=other)))
    assert reused.nodes["mul"].dtype == torch.float32 != plan.nodes["mul"].dtype


def test_added_and_removed_ranges(calibrated):
    _, _, plan = calibrated
    bare = Plan(nodes=dict(plan.nodes), header=dict(plan.header))
    added = fxamp.diff(bare, plan)
    assert f"+ @range fc  {plan.ranges['fc']}" in added.splitlines()
    assert added.splitlines()[-1].endswith(f"{len(plan.ranges)} ranges added")
    assert f"- @range fc  {plan.ranges['fc']}" in fxamp.diff(plan, bare).splitlines()


def test_a_range_for_a_node_the_plan_does_not_have_is_an_error(calibrated, tmp_path):
    _, _, plan = calibrated
    lines = plan.to_text().splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("@range fc "))
    lines[at] = lines[at].replace("@range fc ", "@range fc_typo ")
    with pytest.raises(fxamp.PlanFormatError, match=rf"line {at + 1}: a range for node "
                                                    "'fc_typo', which the plan has no line"):
        Plan.from_text("\n".join(lines) + "\n")
    v1 = [line.replace("plan v2", "plan v1") for line in lines[:-1]]  # v1: no end marker
    with pytest.raises(fxamp.PlanFormatError, match="a range for node 'fc_typo'"):
        Plan.from_text("\n".join(v1) + "\n")


def test_fxamp_diff_exits_1_on_a_changed_range(calibrated, tmp_path, capsys):
    _, _, plan = calibrated
    a, b = tmp_path / "a.plan", tmp_path / "b.plan"
    plan.save(str(a))
    _with_range(plan, "fc", nonfinite=3).save(str(b))
    assert main(["diff", str(a), str(a)]) == 0
    assert main(["diff", str(a), str(b)]) == 1
    out = capsys.readouterr().out
    assert "~ @range fc " in out and "nonfinite=3" in out


def test_check_of_a_calibrated_plan_uses_its_ranges_and_update_keeps_them(tmp_path, capsys):
    from fxamp.demo import small_cnn
    model, inputs = small_cnn()
    plan = fxamp.plan_of(fxamp.amp_rewrite(model, inputs,
                                           fxamp.RewriteConfig.make(target="cuda",
                                                                    calibration_data=[inputs])))
    assert plan.ranges
    path = tmp_path / "model.plan"
    plan.save(str(path))
    assert main(["check", "fxamp.demo:small_cnn", "--plan", str(path)]) == 0
    assert main(["check", "fxamp.demo:small_cnn", "--plan", str(path), "--update"]) == 0
    assert Plan.load(str(path)).ranges == plan.ranges
    capsys.readouterr()


def test_ranges_of_nodes_a_reused_plan_no_longer_has_are_left_out(calibrated, tmp_path):
    model, x, plan = calibrated
    stale = dict(plan.ranges)
    stale["gone"] = plan.ranges["fc"]
    reused = fxamp.plan_of(fxamp.amp_rewrite(model, x,
                                             fxamp.RewriteConfig.make(calibration_data=stale)))
    assert set(reused.ranges) == set(plan.ranges)
    reused.save(str(tmp_path / "p.plan"))
    assert Plan.load(str(tmp_path / "p.plan")).ranges == reused.ranges  # still readable

"""Plan text form, round trips, diffs, malformed files."""
import pytest
import torch

import fxamp
from fxamp.demo import small_cnn
from fxamp.plan import NodePrecision, Plan


@pytest.fixture(scope="module")
def plan():
    model, inputs = small_cnn()
    return fxamp.plan_of(fxamp.amp_rewrite(model, inputs))


def test_text_round_trips_exactly(plan):
    text = plan.to_text()
    again = Plan.from_text(text)
    assert again == plan
    assert again.to_text() == text


def test_one_line_per_node_in_graph_order(plan):
    lines = [l for l in plan.to_text().splitlines() if not l.startswith("#")]
    assert [l.split()[0] for l in lines] == list(plan.nodes)


def test_identical_runs_give_identical_text():
    texts = []
    for _ in range(2):
        model, inputs = small_cnn()
        texts.append(fxamp.plan_of(fxamp.amp_rewrite(model, inputs)).to_text())
    assert texts[0] == texts[1]
    assert "0x" not in texts[0]  # no memory addresses


def test_diff_empty_for_equal_plans(plan):
    assert fxamp.diff(plan, Plan.from_text(plan.to_text())) == ""


def test_one_override_changes_one_line_and_diff_names_it():
    model, inputs = small_cnn()
    a = fxamp.plan_of(fxamp.amp_rewrite(model, inputs))
    b = fxamp.plan_of(fxamp.amp_rewrite(model, inputs, "fp32:fc"))
    changed = [(x, y) for x, y in zip(a.to_text().splitlines(), b.to_text().splitlines())
               if x != y]
    assert len(changed) == 2  # the policy header line and the fc line
    assert changed[1][1].split()[0] == "fc"
    text = fxamp.diff(a, b)
    assert "~ fc" in text and "fp16 -> fp32" in text
    assert text.strip().splitlines()[-1] == "1 node changed precision: 1 FP16\u2192FP32"


def test_diff_takes_plan_files_as_paths_or_path_objects(tmp_path):
    model, inputs = small_cnn()
    a = fxamp.plan_of(fxamp.amp_rewrite(model, inputs))
    b = fxamp.plan_of(fxamp.amp_rewrite(model, inputs, "fp32:fc"))
    a.save(str(tmp_path / "a.plan"))
    b.save(str(tmp_path / "b.plan"))
    expected = fxamp.diff(a, b)
    assert "~ fc" in expected
    assert fxamp.diff(str(tmp_path / "a.plan"), tmp_path / "b.plan") == expected
    assert fxamp.diff(a, str(tmp_path / "b.plan"), fmt="markdown") == fxamp.diff(
        a, b, fmt="markdown")
    assert fxamp.diff(tmp_path / "a.plan", a) == ""
    with pytest.raises(TypeError, match="the second is a dict"):
        fxamp.diff(a, {})


def test_diff_lists_added_and_removed_nodes(plan):
    other = Plan(nodes=dict(plan.nodes), header=dict(plan.header))
    removed = next(iter(other.nodes))
    del other.nodes[removed]
    other.nodes["extra"] = NodePrecision(torch.float32, "user", "added by hand", "nn.Linear")
    text = fxamp.diff(plan, other)
    assert f"- {removed}" in text and "+ extra" in text
    assert "1 added; 1 removed" in text.splitlines()[-1]


def test_diff_ignores_version_lines(plan):
    other = Plan.from_text(plan.to_text().replace("# torch: ", "# torch: 9"))
    assert other != plan
    assert fxamp.diff(plan, other) == ""


@pytest.mark.parametrize("mutate, where", [
    (lambda t: "", "^line 1: expected '# fxamp precision plan v2', found '.empty file.'"),
    (lambda t: t.replace("# fxamp precision plan v2", "# fxamp precision plan v0"),
     "^line 1: 'fxamp precision plan v0' is not a format .* --update"),
    (lambda t: t.replace("fp16    autocast", "fp61    autocast", 1),
     r"^line 8: unknown dtype 'fp61'.*: \"conv1 .*fp61"),
    (lambda t: "\n".join(t.splitlines()[:5]) + "\n",
     "^line 5: the plan ends without its end marker .* the file is truncated"),
    (lambda t: t + "conv1  nn.Conv2d\n", r"^line 19: text after the end marker \(line 18\)"),
    (lambda t: t.replace("# end of plan", "conv9  nn.Conv2d\n# end of plan"),
     r"^line 18: expected 7 columns \(node op module dtype inputs rule reason\), the module "
     "is missing"),
    (lambda t: t.replace("# end of plan: 11 nodes", "# end of plan: 12 nodes"),
     r"^line 18: the end marker counts 12 nodes and 0 ranges, the file has 11 and 0"),
])
def test_malformed_plans_raise_a_clear_error_naming_the_line(plan, mutate, where):
    assert len(plan.nodes) == 11 and len(plan.to_text().splitlines()) == 18
    with pytest.raises(fxamp.PlanFormatError, match=where):
        Plan.from_text(mutate(plan.to_text()))


def test_save_and_load(tmp_path, plan):
    path = tmp_path / "model.plan"
    plan.save(str(path))
    assert Plan.load(str(path)) == plan

"""Policy overrides that match no node raise PolicyError naming the closest names; overrides
reach the nodes of nested rewrites by the names the plan shows for them."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import fxamp
from fxamp.rewriter.search import search

from test_frontends import BF16, ListRoot, Mixed

ROOT = Path(__file__).resolve().parents[1]


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x))


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.ModuleList([Layer(), Layer()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layer:
            x = layer(x)
        return x


class Bertish(nn.Module):
    """Module paths like a Hugging Face task model's: bert.encoder.layer.N..."""

    def __init__(self) -> None:
        super().__init__()
        self.bert = nn.Module()
        self.bert.encoder = Encoder()
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.bert.encoder(x))


def test_an_override_that_matches_nothing_names_the_closest_paths() -> None:
    model, x = Bertish(), torch.randn(2, 8)
    with pytest.raises(fxamp.PolicyError) as info:
        fxamp.amp_rewrite(model, (x,), "fp32:encoder.layer.0.*")
    text = str(info.value)
    assert "'fp32:encoder.layer.0.*' matches no node" in text
    closest = text.split("closest node names / module paths: ")[1].splitlines()[0]
    assert closest.split(", ")[0] == "bert.encoder.layer.0.*"
    assert "e.g. 'fp32:bert.encoder.layer.0.*'" in text
    # the suggestion is right: it matches the layer's nodes
    plan = fxamp.plan_of(fxamp.amp_rewrite(model, (x,), "fp32:bert.encoder.layer.0.*"))
    assert {n for n, p in plan.nodes.items() if p.rule == "user"} == {
        "bert_encoder_layer_0_fc", "relu"}


def test_each_unmatched_override_is_named_and_matched_ones_are_not() -> None:
    model, x = Bertish(), torch.randn(2, 8)
    with pytest.raises(fxamp.PolicyError) as info:
        fxamp.amp_rewrite(model, (x,), "fp32:head,fp32:hed,fp16:nn.Linearr")
    text = str(info.value)
    assert "'fp32:hed' matches no node" in text and "paths: head" in text
    assert "'fp16:nn.Linearr' matches no node" in text and "paths: nn.Linear" in text
    assert "'fp32:head' matches" not in text
    # an override that a later one overrides everywhere still matched: no error
    fxamp.amp_rewrite(model, (x,), "fp32:head,fp16:nn.Linear")


@pytest.mark.slow
def test_overrides_reach_nested_rewrites_by_their_plan_names() -> None:
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    # partial tracing: "shape" is rewritten on its own; its plan lines are shape/...
    for pattern in ("shape/linear", "shape.lin"):
        plan = fxamp.plan_of(fxamp.amp_rewrite(Mixed(), (x,),
                                               fxamp.RewriteConfig.make(policy=f"fp32:{pattern}",
                                                                        **BF16)))
        assert plan.nodes["shape/linear"].dtype == torch.float32
        assert plan.nodes["shape/linear"].rule == "user"
    # eager front end: each child is rewritten on its own
    images = [torch.rand(3, 8, 8)]
    plan = fxamp.plan_of(fxamp.amp_rewrite(ListRoot(), (images,),
                                           fxamp.RewriteConfig.make(policy="fp32:backbone.0",
                                                                    **BF16)))
    assert plan.header["frontend"] == "eager"
    assert (plan.nodes["backbone/_0"].dtype, plan.nodes["backbone/_0"].rule) == (
        torch.float32, "user")
    with pytest.raises(fxamp.PolicyError,
                       match=r"closest node names / module paths: [^\n]*backbone\.0"):
        fxamp.amp_rewrite(ListRoot(), (images,),
                          fxamp.RewriteConfig.make(policy="fp32:backbone.9", **BF16))


def test_an_override_of_a_child_that_runs_under_autocast_says_so() -> None:
    images = [torch.rand(3, 8, 8)]
    with pytest.raises(fxamp.PolicyError, match=r"names only gate, which run\(s\) under "
                       r"torch\.autocast at run time"):
        fxamp.amp_rewrite(ListRoot(), (images,),
                          fxamp.RewriteConfig.make(policy="fp32:gate", **BF16))


def test_the_search_and_the_audit_refuse_unmatched_overrides_too() -> None:
    model, x = Bertish(), torch.randn(2, 8)
    with pytest.raises(fxamp.PolicyError, match="'fp32:nothing_here' matches no node"):
        search(model, (x,), [(x,)], "fp32:nothing_here", rtol=1.0)
    with pytest.raises(fxamp.PolicyError, match="'fp32:nothing_here' matches no node"):
        fxamp.audit(model, (x,), "fp32:nothing_here")


@pytest.mark.slow
def test_readme_override_example_matches_a_real_bert() -> None:
    import transformers  # a test dependency: no skip
    readme = (ROOT / "README.md").read_text()
    policy = re.search(r'"(compute=bf16,target=cpu,fp32:[^"]+)"', readme).group(1)
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(transformers.BertConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        vocab_size=100)).eval()
    ids = torch.randint(0, 100, (2, 8))
    plan = fxamp.plan_of(fxamp.amp_rewrite(model, (ids,), policy))
    users = {p.module for p in plan.nodes.values() if p.rule == "user"}
    assert "bert.encoder.layer.0.attention.self.query" in users
    assert all(m.startswith("bert.encoder.layer.0") for m in users)
    # the README's error line (the CLI's, on examples/tiny_bert.py) is the real message
    shown = next(line.split("error: ", 1)[1] for line in readme.splitlines()
                 if line.startswith("fxamp plan: error: policy override 'fp32:encoder.layer"))
    with pytest.raises(fxamp.PolicyError) as info:
        fxamp.amp_rewrite(model, (ids,), policy.replace("bert.encoder", "encoder"))
    assert str(info.value).splitlines()[0] == shown

"""torch.fx code generation of module names that are not identifiers (``_torch.format_target``,
``_torch.spell_names``)."""
import copy
import pickle

import torch
import torch.fx.graph as fx_graph
import torch.nn as nn

import fxamp
from fxamp._torch import format_target


def test_format_target_spells_every_name_as_python_that_reads_it_back():
    assert format_target("self", "a.b") == "self.a.b"
    assert format_target("self", "m fp32.0") == 'getattr(getattr(self, "m fp32"), "0")'
    for name in ['a"b', "back\\slash", "new\nline", "it's", "gr\u00f6\u00dfe x"]:
        obj = type("O", (), {name: 7})()
        assert eval(format_target("o", name), {}, {"o": obj}) == 7  # noqa: S307
    assert fx_graph._format_target is not format_target  # nothing replaced at import


def test_a_rewritten_module_with_quoted_names_survives_deepcopy_pickle_and_recompile():
    model = nn.Sequential()
    model.add_module('a"b', nn.Linear(4, 4))
    model.add_module("back\\slash", nn.Linear(4, 4))
    x = torch.randn(2, 4)
    torch_own = fx_graph._format_target
    gm = fxamp.amp_rewrite(model, (x,),
                           fxamp.RewriteConfig.make(target="cpu", dtype=torch.bfloat16))
    assert fx_graph._format_target is torch_own  # (the module's graph spells its names)
    with torch.no_grad():
        ref = gm(x)
        gm.recompile()
        assert torch.equal(gm(x), ref)
        assert torch.equal(copy.deepcopy(gm)(x), ref)
        assert torch.equal(pickle.loads(pickle.dumps(gm))(x), ref)
    assert {p.module for p in fxamp.plan_of(gm).nodes.values()} >= {'a"b', "back\\slash"}

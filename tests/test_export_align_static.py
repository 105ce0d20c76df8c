"""The export front end's static eval-mode graph aligns with the symbolic train-mode one where
the two spell the same thing differently (a full slice as ``alias``, a slice start None as
0), so a model that reads ``training`` costs two exports, not three, and follows
train()/eval() as before."""
import torch
import torch.nn as nn

import fxamp


class TokenModel(nn.Module):
    """Token and position embeddings (``position_ids[:, :seq]``), dropout, and the last
    positions kept as Hugging Face's ``logits_to_keep=0`` does (``h[:, -0:, :]``)."""

    def __init__(self, vocab=50, dim=16, seq=32):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq, dim)
        self.register_buffer("position_ids", torch.arange(seq).expand(1, -1), persistent=False)
        self.drop = nn.Dropout(0.5)
        self.lin = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids):
        pos = self.position_ids[:, :ids.shape[1]]
        h = self.drop(torch.relu(self.lin(self.tok(ids) + self.pos(pos))))
        return self.head(h[:, slice(-0, None), :])


def test_eval_model_is_exported_twice_and_follows_train_and_eval(export_calls):
    torch.manual_seed(0)
    model = TokenModel().eval()
    ids = torch.randint(0, 50, (2, 8))
    gm = fxamp.amp_rewrite(model, (ids,),
                           fxamp.RewriteConfig.make(dtype=torch.bfloat16, target="cpu",
                                                    frontend="export"))
    assert len(export_calls) == 2  # train (symbolic batch and sequence) + static eval
    assert fxamp.plan_of(gm).header["frontend"] == "export"
    with torch.no_grad():
        ref = model(ids)
        out = gm(ids)
        assert torch.allclose(out.float(), ref, rtol=0.05, atol=0.05)
        assert torch.equal(gm(ids), out)  # eval: no dropout
        gm.train()
        a, b = gm(ids), gm(ids)
    assert not torch.equal(a, b)  # train(): dropout follows the flag
    # other batch and sequence sizes (the symbolic dimensions)
    gm.eval()
    other = torch.randint(0, 50, (3, 5))
    with torch.no_grad():
        assert torch.allclose(gm(other).float(), model(other), rtol=0.05, atol=0.05)


def test_train_mode_model_follows_eval_without_the_one_mode_warning(caplog):
    torch.manual_seed(0)
    model = TokenModel().train()
    ids = torch.randint(0, 50, (2, 8))
    with caplog.at_level("INFO", logger="fxamp"):
        gm = fxamp.amp_rewrite(model, (ids,),
                               fxamp.RewriteConfig.make(dtype=torch.bfloat16, target="cpu",
                                                        frontend="export"))
    assert "differently in train and eval mode" not in caplog.text
    assert fxamp.rewritten(gm) is gm and gm.fxamp_result.mode is None  # (both modes)
    gm.eval()
    model.eval()
    with torch.no_grad():
        out = gm(ids)
        assert torch.equal(gm(ids), out)  # the eval graph's behaviour: no dropout
        assert torch.allclose(out.float(), model(ids), rtol=0.05, atol=0.05)

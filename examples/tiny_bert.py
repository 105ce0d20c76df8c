"""A Hugging Face BERT classifier from a tiny config (random weights), for the README's
policy examples: its module paths are bert.embeddings..., bert.encoder.layer.N..., classifier.

Run: fxamp plan examples/tiny_bert.py:build --dtype bf16 --target cpu --policy 'fp32:bert.encoder.layer.0.*'
"""
import torch
import transformers


def build():
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=2, intermediate_size=64,
                                     max_position_embeddings=32)
    model = transformers.BertForSequenceClassification(config).eval()
    return model, (torch.randint(0, 100, (2, 8)),)

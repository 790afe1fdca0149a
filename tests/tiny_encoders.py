"""Tiny BERT encoders written here, never downloaded (issue 57): a Hugging Face folder the way the Hub ships an
embedder (`BertModel`, e.g. sentence-transformers/all-MiniLM-L6-v2) or a cross-encoder reranker
(`BertForSequenceClassification`, e.g. cross-encoder/ms-marco-MiniLM-L6-v2): config.json, model.safetensors under
the Hub's own tensor names, and a WordPiece tokenizer.json with BERT's [CLS] A [SEP] B [SEP] pair template.
Random weights: the tests check the serving path and the shapes, not what the vectors mean."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

HIDDEN = 64
LAYERS = 2
HEADS = 2
INTERMEDIATE = 128
MAX_POSITIONS = 512
TYPE_VOCAB = 2
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = ("the a an of to in is it and for on that with as was this be by are from at or llama model server engine "
         "quick brown fox jumps over lazy dog cat sat mat paris capital france weather today rain sun cold warm "
         "python code function class test file endpoint vector embedding search query document rank score").split()


def vocab() -> list[str]:
    """Special tokens, single characters (each also as a ## continuation) and whole words: any ASCII text
    tokenizes without [UNK]."""
    chars = [chr(c) for c in range(33, 127)]
    return [*SPECIAL, *chars, *(f"##{c}" for c in chars), *WORDS]


def tokenizer() -> Tokenizer:
    words = vocab()
    tok = Tokenizer(models.WordPiece({w: i for i, w in enumerate(words)}, unk_token="[UNK]",
                                     max_input_chars_per_word=100))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    cls, sep = words.index("[CLS]"), words.index("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    return tok


def bert_config(classifier: bool = False) -> dict[str, object]:
    """The config the Hub ships for a BERT embedder (or, with `classifier`, a one-label cross-encoder)."""
    config: dict[str, object] = {
        "architectures": ["BertForSequenceClassification" if classifier else "BertModel"],
        "model_type": "bert", "hidden_size": HIDDEN, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
        "intermediate_size": INTERMEDIATE, "hidden_act": "gelu", "max_position_embeddings": MAX_POSITIONS,
        "type_vocab_size": TYPE_VOCAB, "vocab_size": len(vocab()), "layer_norm_eps": 1e-12,
        "hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1, "initializer_range": 0.02,
        "pad_token_id": 0, "position_embedding_type": "absolute", "torch_dtype": "float32",
    }
    if classifier:
        config.update({"id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0}})
    return config


def bert_tensors(classifier: bool = False, seed: int = 57) -> dict[str, np.ndarray]:
    """Every tensor of the checkpoint under the Hub's names (the reranker's under `bert.`, plus its classifier)."""
    rng = np.random.default_rng(seed)
    prefix = "bert." if classifier else ""

    def normal(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.05).astype(np.float32)

    def ones(n: int) -> np.ndarray:
        return np.ones(n, dtype=np.float32)

    def zeros(n: int) -> np.ndarray:
        return np.zeros(n, dtype=np.float32)

    out = {
        "embeddings.word_embeddings.weight": normal(len(vocab()), HIDDEN),
        "embeddings.position_embeddings.weight": normal(MAX_POSITIONS, HIDDEN),
        "embeddings.token_type_embeddings.weight": normal(TYPE_VOCAB, HIDDEN),
        "embeddings.LayerNorm.weight": ones(HIDDEN), "embeddings.LayerNorm.bias": zeros(HIDDEN),
        "pooler.dense.weight": normal(HIDDEN, HIDDEN), "pooler.dense.bias": zeros(HIDDEN),
    }
    for layer in range(LAYERS):
        at = f"encoder.layer.{layer}."
        for name in ("query", "key", "value"):
            out[f"{at}attention.self.{name}.weight"] = normal(HIDDEN, HIDDEN)
            out[f"{at}attention.self.{name}.bias"] = zeros(HIDDEN)
        out[f"{at}attention.output.dense.weight"] = normal(HIDDEN, HIDDEN)
        out[f"{at}attention.output.dense.bias"] = zeros(HIDDEN)
        out[f"{at}attention.output.LayerNorm.weight"] = ones(HIDDEN)
        out[f"{at}attention.output.LayerNorm.bias"] = zeros(HIDDEN)
        out[f"{at}intermediate.dense.weight"] = normal(INTERMEDIATE, HIDDEN)
        out[f"{at}intermediate.dense.bias"] = zeros(INTERMEDIATE)
        out[f"{at}output.dense.weight"] = normal(HIDDEN, INTERMEDIATE)
        out[f"{at}output.dense.bias"] = zeros(HIDDEN)
        out[f"{at}output.LayerNorm.weight"] = ones(HIDDEN)
        out[f"{at}output.LayerNorm.bias"] = zeros(HIDDEN)
    tensors = {prefix + name: value for name, value in out.items()}
    if classifier:
        tensors["classifier.weight"] = normal(1, HIDDEN)
        tensors["classifier.bias"] = zeros(1)
    return tensors


def write_bert(folder: Path, classifier: bool = False) -> Path:
    """A Hub-shaped BERT folder at `folder` (an embedder, or with `classifier` a cross-encoder reranker)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(bert_config(classifier), indent=2), encoding="utf-8")
    save_file(bert_tensors(classifier), str(folder / "model.safetensors"), metadata={"format": "pt"})
    tokenizer().save(str(folder / "tokenizer.json"))
    (folder / "vocab.txt").write_text("\n".join(vocab()) + "\n", encoding="utf-8")
    specials = {"unk_token": "[UNK]", "sep_token": "[SEP]", "pad_token": "[PAD]", "cls_token": "[CLS]",
                "mask_token": "[MASK]"}
    (folder / "special_tokens_map.json").write_text(json.dumps(specials), encoding="utf-8")
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "BertTokenizerFast", "do_lower_case": True, "model_max_length": MAX_POSITIONS,
        **specials}), encoding="utf-8")
    return folder


def bert_params(classifier: bool = False) -> int:
    """Parameters of the tiny checkpoint, counted from the tensors written (an outside count for the estimate)."""
    return sum(int(np.prod(t.shape)) for t in bert_tensors(classifier).values())

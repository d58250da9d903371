"""Sequence classification in the torch twin: a classifier directory written by `jax-llama
finetune` (tasks.classification), loaded and run. The twin of jax_llama.classify's Classifier,
load_classifier and predict; fine-tuning itself runs in JAX."""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch

from tasks.classification import encode_texts, read_head
from bridge.formats.torch_files import from_numpy as to_torch
from bridge.inputs import length_batches, pad_rows
from bridge.tokenizer import Tokenizer, find_tokenizer

from .checkpoint import load
from .heads import LlamaClassifier


@dataclass
class Classifier:
    """A LlamaClassifier (in eval mode) with its labels, tokenizer and text length."""

    model: LlamaClassifier
    labels: list[str]
    tokenizer: Tokenizer
    max_len: int  # tokens per text, BOS and EOS included


def load_classifier(path: str | os.PathLike, device: str | torch.device = "auto",
                    dtype=None) -> Classifier:
    """A classifier directory written by `jax-llama finetune`: the backbone as `load` reads it,
    the head from classifier.safetensors, the labels and max_len from classifier.json."""
    backbone = load(path, device=device, dtype=dtype)
    meta, weight, bias = read_head(path, backbone.config)
    param = next(backbone.parameters())
    with torch.device("meta"):
        model = LlamaClassifier(backbone.config, len(meta["labels"]), float(meta.get("dropout", 0.0)))
    model.llama = backbone
    model.classifier.weight = torch.nn.Parameter(to_torch(weight).to(param.device, param.dtype))
    model.classifier.bias = torch.nn.Parameter(to_torch(bias).to(param.device, param.dtype))
    return Classifier(model.eval(), list(meta["labels"]), find_tokenizer(path),
                      int(meta["max_len"]))


def predict(clf: Classifier, texts: list[str], batch_size: int = 64):
    """(predicted label indices (N,), log-probabilities (N, C) float32, texts cut to max_len),
    as jax_llama.classify.predict: texts of similar length share a right-padded batch."""
    rows, cut = encode_texts(clf.tokenizer, texts, clf.max_len)
    lengths = np.array([len(r) for r in rows])
    out = np.zeros((len(rows), len(clf.labels)), np.float32)
    device = next(clf.model.parameters()).device
    with torch.inference_mode():
        for idx in length_batches(lengths, batch_size, None):
            tokens, mask = pad_rows([rows[i] for i in idx])
            logp = clf.model(torch.from_numpy(tokens).to(device), torch.from_numpy(mask).to(device))
            out[idx] = logp.float().cpu().numpy()
    return out.argmax(-1), out, cut

"""Policies: load from a hub id / local folder / GGUF file, or build tiny Qwen2 models offline."""

from logra_pl.models.load import PolicyLoadError, ResolvedSource, load_policy, resolve_source, smollm2_gguf_path
from logra_pl.models.tiny import PRESETS, TinyModelSpec, build_tiny_model, cache_root
from logra_pl.models.tokenizer import CHAT_TEMPLATE, reasoning_gym_corpus, train_bpe_tokenizer

__all__ = [
    "CHAT_TEMPLATE",
    "PRESETS",
    "PolicyLoadError",
    "ResolvedSource",
    "TinyModelSpec",
    "build_tiny_model",
    "cache_root",
    "load_policy",
    "reasoning_gym_corpus",
    "resolve_source",
    "smollm2_gguf_path",
    "train_bpe_tokenizer",
]

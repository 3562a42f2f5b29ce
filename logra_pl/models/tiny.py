"""Tiny Qwen2 causal LMs built fully offline, saved so that transformers and vLLM both load the folder.

``head_dim`` is 64 because vLLM's CPU attention kernels accept only a few head sizes. Each build is cached by
a hash of its spec: the same spec gives the same folder, built once.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from logra_pl.models.tokenizer import DEFAULT_CORPUS_TASKS, reasoning_gym_corpus, train_bpe_tokenizer

BUILD_VERSION = 2  # bump when the build procedure changes, so cached folders are rebuilt


@dataclass(frozen=True)
class TinyModelSpec:
    """Architecture and build recipe of a tiny offline Qwen2.

    Arguments:
        hidden_size: model width; ``num_heads * head_dim`` need not equal it (Qwen2 projects).
        num_layers: decoder layers.
        num_heads: attention heads.
        num_kv_heads: key/value heads (grouped-query attention when fewer than ``num_heads``).
        head_dim: per-head size; 64 for vLLM's CPU kernels.
        intermediate_size: MLP width.
        vocab_size: BPE vocabulary size (the tokenizer is trained to this size).
        max_position_embeddings: longest sequence.
        tie_word_embeddings: share the input embedding and ``lm_head``.
        seed: weight initialisation seed.
        corpus_tasks: reasoning-gym tasks whose text trains the tokenizer.
        corpus_per_task: samples per task for the tokenizer corpus.
    """

    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 2
    num_kv_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 512
    vocab_size: int = 512
    max_position_embeddings: int = 1024
    tie_word_embeddings: bool = True
    seed: int = 0
    corpus_tasks: tuple[str, ...] = DEFAULT_CORPUS_TASKS
    corpus_per_task: int = 300

    def digest(self) -> str:
        """12 hex digits identifying this spec and build version (the cache key)."""
        blob = json.dumps({"v": BUILD_VERSION, **dataclasses.asdict(self)}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]

    def qwen2_config(self, vocab_size: int, pad_id: int, eos_id: int) -> Qwen2Config:
        """The transformers config of this spec."""
        return Qwen2Config(
            vocab_size=vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=self.tie_word_embeddings,
            pad_token_id=pad_id,
            eos_token_id=eos_id,
            bos_token_id=None,
            rms_norm_eps=1e-6,
            rope_theta=10000.0,
            torch_dtype="float32",
        )


# Named sizes for configs and the CLI: ``tiny`` (~0.7M params) for tests and the CPU demo, ``small`` (~5M),
# ``medium`` (~50M, the memory/speed benchmark's model: large enough that training state dominates the process).
PRESETS: dict[str, TinyModelSpec] = {
    "tiny": TinyModelSpec(),
    "small": TinyModelSpec(
        hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=1024, vocab_size=1024
    ),
    "medium": TinyModelSpec(
        hidden_size=640, num_layers=10, num_heads=10, num_kv_heads=2, intermediate_size=2048, vocab_size=2048
    ),
}


def cache_root() -> Path:
    """Where built models live: ``$LOGRA_PL_CACHE`` or ``~/.cache/logra-pl``."""
    return Path(os.environ.get("LOGRA_PL_CACHE", Path.home() / ".cache" / "logra-pl"))


def build_tiny_model(spec: TinyModelSpec | str = "tiny", cache_dir: str | Path | None = None) -> Path:
    """Build (or find in the cache) a tiny Qwen2 with its tokenizer; return the folder.

    The folder holds ``config.json``, ``model.safetensors``, ``generation_config.json`` and the tokenizer files,
    as ``save_pretrained`` writes them. A build goes to a temporary folder first and is renamed into place,
    so an interrupted build never leaves a half-written cache entry.
    """
    if isinstance(spec, str):
        if spec not in PRESETS:
            raise ValueError(f"unknown tiny model preset {spec!r}: choose one of {sorted(PRESETS)}")
        spec = PRESETS[spec]
    root = Path(cache_dir) if cache_dir is not None else cache_root() / "models"
    target = root / f"tiny-qwen2-{spec.digest()}"
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tokenizer = train_bpe_tokenizer(
        reasoning_gym_corpus(spec.corpus_tasks, spec.corpus_per_task, seed=spec.seed), vocab_size=spec.vocab_size
    )
    config = spec.qwen2_config(len(tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id)
    gen = torch.random.fork_rng(devices=[])
    with gen:
        torch.manual_seed(spec.seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = None
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=root))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "logra_spec.json").write_text(json.dumps(dataclasses.asdict(spec), indent=2))
        try:
            tmp.rename(target)
        except OSError:  # another process finished the same build first
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target

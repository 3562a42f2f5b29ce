"""``RewardModelVerifier``: a Hugging Face reward model as the reward — a scalar score of (prompt, response), batched.

Supported heads: any model ``AutoModelForSequenceClassification`` loads — encoder classifiers (DeBERTa, RoBERTa:
the pooled first token) and decoder LMs with a scalar head (``Qwen2ForSequenceClassification``,
``LlamaForSequenceClassification``, …: the score of the last token that is not padding, as transformers computes it
and as TRL's ``RewardTrainer`` trains it). The head has one output, or ``label`` names the output to read (its
logit). Reward models with their own code load with ``trust_remote_code: true`` when their output has ``logits``.
TRL's ``AutoModelForCausalLMWithValueHead`` files (a ``v_head`` beside a causal LM) are not read: save such a model
as a ``*ForSequenceClassification`` first.

The model is loaded once, in the training process, on the first batch (never in the scoring workers: the runner calls
:meth:`RewardModelVerifier.score_batch` in process), on ``device`` with ``dtype``. A model that cannot be loaded
raises :class:`~logra_pl.errors.ConfigError`, which stops the run at its first update with the reason.

Text the model reads: with a chat template in the reward model's tokenizer (``chat_template: null`` or ``true``), the
item's ``messages`` followed by ``{"role": "assistant", "content": response}``, templated and tokenized, keeping the
last ``max_length`` tokens; without one, the prompt (the messages' contents, blank-line separated) and the response
as a text pair, truncated by the tokenizer to ``max_length`` (longest first).

Normalisation (the reward the policy sees): ``none`` (the raw score), ``fixed`` (``(s − mean) / std`` with given
values, e.g. measured on a reference set), or ``running`` (``(s − μ) / σ`` with the mean and standard deviation of
every score so far, this batch included: Chan et al.'s parallel update of count, mean and sum of squared deviations,
in float64). The running statistics are the verifier's state (``state_dict``), kept in checkpoints, so a resumed run
normalises exactly as the uninterrupted one.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from logra_pl.errors import ConfigError, check_int, check_range
from logra_pl.runtime.dtypes import dtypes_of

Normalize = Literal["none", "running", "fixed"]
DTYPES = (*dtypes_of("float32", "bfloat16", "float16"), "auto")


def prompt_text(item: Mapping[str, Any]) -> str:
    """The prompt as plain text: the contents of ``item["messages"]`` separated by blank lines (else ``question``)."""
    messages = item.get("messages") if isinstance(item, Mapping) else None
    if isinstance(messages, Sequence) and messages:
        return "\n\n".join(str(m.get("content", "")) for m in messages if isinstance(m, Mapping))
    return str(item.get("question", "")) if isinstance(item, Mapping) else ""


class RunningMoments:
    """Count, mean and sum of squared deviations of every value added (float64), merged batch by batch.

    Chan, Golub & LeVeque (1979): for a batch of ``n_b`` values with mean ``m_b`` and squared deviations ``M_b``,
    ``δ = m_b − m``, ``m ← m + δ·n_b/(n + n_b)``, ``M ← M + M_b + δ²·n·n_b/(n + n_b)``, ``n ← n + n_b``.
    """

    def __init__(self) -> None:
        self.count, self.mean, self.m2 = 0, 0.0, 0.0

    def add(self, values: Sequence[float]) -> None:
        """Merge ``values`` into the statistics."""
        n_b = len(values)
        if not n_b:
            return
        m_b = math.fsum(values) / n_b
        m2_b = math.fsum((v - m_b) ** 2 for v in values)
        total = self.count + n_b
        delta = m_b - self.mean
        self.mean += delta * n_b / total
        self.m2 += m2_b + delta * delta * self.count * n_b / total
        self.count = total

    @property
    def std(self) -> float:
        """The population standard deviation (0 before two values)."""
        return math.sqrt(self.m2 / self.count) if self.count > 1 else 0.0

    def state_dict(self) -> dict[str, float]:
        return {"count": self.count, "mean": self.mean, "m2": self.m2}

    def load_state_dict(self, state: Mapping[str, float]) -> None:
        self.count, self.mean, self.m2 = int(state["count"]), float(state["mean"]), float(state["m2"])


class RewardModelVerifier:
    """The reward is a reward model's score of the response to the item's prompt (see the module docstring).

    Arguments:
        model: a folder written by ``save_pretrained`` or a hub id (read from the local cache when offline).
        device: where the model runs: ``cpu``, ``cuda``, ``cuda:N``, or ``auto`` (CUDA when available).
        dtype: ``float32``, ``bfloat16``, ``float16``, or ``auto`` (the folder's).
        batch_size: sequences per forward pass.
        max_length: tokens per sequence at most (see the module docstring for which are kept).
        label: the head output read as the score, by index or by its ``id2label`` name; None: the head must have
            exactly one output.
        chat_template: None (use the tokenizer's chat template when it has one), ``true`` (require one) or
            ``false`` (the text-pair form).
        normalize: ``none``, ``fixed`` (with ``mean``, ``std``) or ``running``.
        mean: the score subtracted by ``normalize: fixed``.
        std: the divisor of ``normalize: fixed`` (> 0).
        trust_remote_code: let transformers run the model folder's own code.

    The verifier has no ``correct``: a response is correct when its (normalised) reward reaches
    ``scoring.correct_threshold`` — set it to a score that means "good" for your model, or pair the model with a
    rule-based check in :class:`~logra_pl.rewards.WeightedRewards` (``correct_part``).

    Example (YAML, under ``model:``)::

        verifier:
          class_path: logra_pl.rewards.RewardModelVerifier
          init_args: {model: Skywork/Skywork-Reward-V2-Qwen3-0.6B, device: cuda, dtype: bfloat16}
    """

    def __init__(
        self,
        model: str,
        device: str = "auto",
        dtype: Literal["float32", "bfloat16", "float16", "auto"] = "float32",
        batch_size: int = 16,
        max_length: int = 2048,
        label: int | str | None = None,
        chat_template: bool | None = None,
        normalize: Normalize = "none",
        mean: float = 0.0,
        std: float = 1.0,
        trust_remote_code: bool = False,
    ) -> None:
        if not isinstance(model, str | Path) or not str(model):
            raise ConfigError(f"RewardModelVerifier model must be a folder or a hub id, got {model!r}")
        if dtype not in DTYPES:
            raise ConfigError(f"RewardModelVerifier dtype must be one of {DTYPES}, got {dtype!r}")
        if normalize not in ("none", "running", "fixed"):
            raise ConfigError(f"RewardModelVerifier normalize must be none, running or fixed, got {normalize!r}")
        if chat_template not in (None, True, False):
            raise ConfigError(f"RewardModelVerifier chat_template must be null, true or false, got {chat_template!r}")
        check_int("RewardModelVerifier batch_size", batch_size, 1)
        check_int("RewardModelVerifier max_length", max_length, 2)
        check_range("RewardModelVerifier mean", mean)
        check_range("RewardModelVerifier std", std, 0.0, low_open=True)
        self.model = str(model)
        self.device = device
        self.dtype = dtype
        self.batch_size = batch_size
        self.max_length = max_length
        self.label = label
        self.chat_template = chat_template
        self.normalize = normalize
        self.mean = float(mean)
        self.std = float(std)
        self.trust_remote_code = trust_remote_code
        self.moments = RunningMoments()
        self._loaded: tuple[Any, Any, int] | None = None  # (model, tokenizer, output index), on first use

    # -- loading ---------------------------------------------------------------------------------------------------

    def _load(self) -> tuple[Any, Any, int]:
        if self._loaded is None:
            self._loaded = self._load_model()
        return self._loaded

    def _load_model(self) -> tuple[Any, Any, int]:
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        from logra_pl.models.load import hub_unavailable, is_hub_id

        folder = Path(self.model).expanduser()
        if not folder.is_dir() and not is_hub_id(self.model):
            raise ConfigError(f"reward model {self.model!r}: no such folder (and not a hub id of the form org/name)")
        dtype = "auto" if self.dtype == "auto" else getattr(torch, self.dtype)
        try:
            tokenizer = AutoTokenizer.from_pretrained(self.model, trust_remote_code=self.trust_remote_code)
            model = AutoModelForSequenceClassification.from_pretrained(
                self.model, dtype=dtype, trust_remote_code=self.trust_remote_code
            )
        except OSError as err:
            hint = hub_unavailable(self.model) if not folder.is_dir() else f"{type(err).__name__}: {err}"
            raise ConfigError(f"reward model {self.model!r} cannot be loaded: {hint}") from err
        except ValueError as err:  # e.g. an architecture without a sequence-classification head
            raise ConfigError(
                f"reward model {self.model!r} has no sequence-classification head transformers can load ({err}): "
                "save it as a *ForSequenceClassification"
            ) from err
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        if model.config.pad_token_id is None:  # a decoder head finds each sequence's last token by it
            model.config.pad_token_id = tokenizer.pad_token_id
        if self.chat_template is True and not getattr(tokenizer, "chat_template", None):
            raise ConfigError(f"reward model {self.model!r}: chat_template is true but its tokenizer has none")
        model.to(self._device()).eval()
        return model, tokenizer, self._output_index(model.config)

    def _device(self) -> Any:
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        try:
            return torch.device(self.device)
        except RuntimeError as err:
            raise ConfigError(f"RewardModelVerifier device {self.device!r} is not a torch device: {err}") from None

    def _output_index(self, config: Any) -> int:
        labels = int(config.num_labels)
        names = {str(v): int(k) for k, v in (getattr(config, "id2label", None) or {}).items()}
        if self.label is None:
            if labels != 1:
                raise ConfigError(
                    f"reward model {self.model!r} has {labels} outputs ({sorted(names)}): name the one to read with "
                    "label (an index or a name)"
                )
            return 0
        if isinstance(self.label, str) and not self.label.lstrip("-").isdigit():
            if self.label not in names:
                raise ConfigError(f"reward model {self.model!r} has no label {self.label!r}: it has {sorted(names)}")
            return names[self.label]
        index = int(self.label)
        if not 0 <= index < labels:
            raise ConfigError(f"reward model {self.model!r}: label {index} is out of range for {labels} outputs")
        return index

    # -- text --------------------------------------------------------------------------------------------------------

    def uses_chat_template(self, tokenizer: Any) -> bool:
        """Whether the text is the chat-templated conversation (else the prompt/response text pair)."""
        return self.chat_template is True or (self.chat_template is None and bool(tokenizer.chat_template))

    def encode(self, tokenizer: Any, response: str, item: Mapping[str, Any]) -> list[int]:
        """The token ids the model scores for ``response`` to ``item`` (see the module docstring)."""
        if self.uses_chat_template(tokenizer):
            messages = [dict(m) for m in (item.get("messages") or [])]
            messages.append({"role": "assistant", "content": response})
            text = tokenizer.apply_chat_template(messages, tokenize=False)
            ids = tokenizer(text, add_special_tokens=False).input_ids
            return list(ids[-self.max_length :])
        pair = tokenizer(prompt_text(item), response, truncation="longest_first", max_length=self.max_length)
        return list(pair.input_ids)

    # -- scoring -----------------------------------------------------------------------------------------------------

    def raw_scores(self, responses: Sequence[str], items: Sequence[Mapping[str, Any]]) -> list[float]:
        """The model's scores, before normalisation, ``batch_size`` sequences per forward pass (right-padded)."""
        import torch

        model, tokenizer, index = self._load()
        device = next(model.parameters()).device
        encoded = [self.encode(tokenizer, r, it) for r, it in zip(responses, items, strict=True)]
        pad = int(model.config.pad_token_id)
        out: list[float] = []
        with torch.inference_mode():
            for start in range(0, len(encoded), self.batch_size):
                chunk = encoded[start : start + self.batch_size]
                width = max(len(ids) for ids in chunk)
                input_ids = torch.full((len(chunk), width), pad, dtype=torch.long)
                attention = torch.zeros((len(chunk), width), dtype=torch.long)
                for row, ids in enumerate(chunk):
                    input_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
                    attention[row, : len(ids)] = 1
                logits = model(input_ids=input_ids.to(device), attention_mask=attention.to(device)).logits
                out += logits[:, index].double().cpu().tolist()
        return out

    def normalized(self, scores: Sequence[float]) -> list[float]:
        """``scores`` under :attr:`normalize` (``running`` adds them to the statistics first)."""
        if self.normalize == "fixed":
            return [(s - self.mean) / self.std for s in scores]
        if self.normalize == "running":
            self.moments.add([s for s in scores if math.isfinite(s)])
            std = self.moments.std or 1.0
            return [(s - self.moments.mean) / std for s in scores]
        return list(scores)

    def score_batch(self, responses: Sequence[str], items: Sequence[Mapping[str, Any]]) -> list[float]:
        """The rewards of a batch (the runner's batch seam: called in the training process)."""
        return self.normalized(self.raw_scores(responses, items))

    def __call__(self, response: str, item: Mapping[str, Any]) -> float:
        """The reward of one response (a batch of one)."""
        return self.score_batch([response], [item])[0]

    # -- state -------------------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The running normalisation's statistics (empty for the other modes)."""
        return {"moments": self.moments.state_dict()} if self.normalize == "running" else {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved."""
        if "moments" in state:
            self.moments.load_state_dict(state["moments"])

    def __getstate__(self) -> dict[str, Any]:
        # A copy (hyper-parameters in a checkpoint, a deepcopy) never carries the loaded model: it loads its own.
        state = self.__dict__.copy()
        state["_loaded"] = None
        return state

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(model={self.model!r}, device={self.device!r}, dtype={self.dtype!r}, "
            f"normalize={self.normalize!r})"
        )

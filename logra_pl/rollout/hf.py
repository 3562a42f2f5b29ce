"""``HFEngine``: a rollout engine on transformers models, with its own copy of the policy weights.

It samples with a KV cache in an explicit loop (temperature, top-p, a seeded ``torch.Generator``), so the
log-prob it reports for each token is that of the exact distribution it sampled from — no hidden top-k, no
global RNG. Its weights change only through :meth:`apply_payload` (the same merge the trainer uses) or
:meth:`load_weights`, so the trainer/rollout split is real even on one CPU.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel

from logra_pl.config import register
from logra_pl.errors import ConfigError, PolicyDivergedError
from logra_pl.rollout.base import (
    EngineRequest,
    EngineSpec,
    FinishReason,
    Rollout,
    RolloutEngine,
    SamplingConfig,
    SyncReport,
    expand_prompts,
)
from logra_pl.sketch.payload import Payload, apply_payload, weight_tensors


def top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Set logits outside the smallest set of tokens with mass ≥ ``top_p`` to −inf (the top token always stays)."""
    if top_p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    drop_sorted = mass_before >= top_p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


@register("hf")
@dataclass
class HFSettings(EngineSpec):
    """The transformers engine in the trainer process (``model.engine: hf``, the default).

    It has no settings of its own: ``model.rollout.max_batch`` bounds its forward batches and
    ``model.rollout.share_weights`` makes it sample with the trainer's own weights (one process only) instead of a
    private copy.
    """

    def build(self, request: EngineRequest) -> RolloutEngine:
        """An :class:`HFEngine` on a private copy of ``request.model`` (or on the model itself: share_weights)."""
        if request.share_weights and request.world_size > 1:
            raise ConfigError(
                "rollout.share_weights generates with the trainer's weights, which are sharded over "
                f"{request.world_size} ranks: set it to false for data-parallel runs"
            )
        return HFEngine(
            request.model,
            request.eos,
            request.tokenizer.pad_token_id,
            max_batch=request.max_batch,
            copy=not request.share_weights,
        )


class HFEngine:
    """Batched sampling from a private copy of a transformers causal LM.

    Arguments:
        model: the policy; the engine deep-copies it (pass ``copy=False`` to adopt it as is).
        eos_token_id: token (or tokens) that end a response.
        pad_token_id: token used to left-pad prompts.
        max_batch: responses generated per forward batch (bounds memory).
        copy: deep-copy ``model`` so the engine's weights are its own. ``False`` generates with ``model`` itself
            (under ``no_grad``, where sketch hooks do nothing): one copy of the weights less, nothing to sync.
    """

    receivers = 1

    def __init__(
        self,
        model: PreTrainedModel,
        eos_token_id: int | Sequence[int],
        pad_token_id: int,
        max_batch: int = 256,
        copy: bool = True,
    ) -> None:
        self.model = _private_copy(model) if copy else model
        self.shares_weights = not copy
        self.model.eval()
        if copy:  # an adopted model may be the trainer's: its trainable flags are not ours to change
            for p in self.model.parameters():
                p.requires_grad_(False)
        self.eos = {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id)
        self.pad_token_id = pad_token_id
        self.max_batch = max_batch
        self.context_limit = int(getattr(self.model.config, "max_position_embeddings", 1 << 30))

    # ------------------------------------------------------------------------------------------- weights
    def place(self, device: torch.device) -> bool:
        """Move the private copy to the trainer's device; True when it moved (its weights must be resent)."""
        if self.shares_weights or next(self.model.parameters()).device == torch.device(device):
            return False
        self.model.to(device)
        return True

    def close(self) -> None:
        """Nothing to release: the copy is garbage-collected with the engine."""

    def apply_payload(self, payload: Payload) -> SyncReport:
        """``W ← W − F P`` for every matrix of ``payload`` — :func:`apply_payload`, as the trainer merges.

        The report counts the payload's serialized size, what a separate engine would receive.
        """
        start = time.perf_counter()
        apply_payload(payload, self.model)
        seconds = time.perf_counter() - start
        return SyncReport(bytes=len(payload.to_bytes()), receivers=1, seconds=seconds)

    def load_weights(self, tensors: Mapping[str, torch.Tensor]) -> SyncReport:
        """Copy the named tensors (``<module>.weight`` etc., wrapper prefixes ignored) into the engine's model.

        ``tensors`` may gather each value when it is read (:class:`~logra_pl.methods.base.GatheredState`): every
        value is read once, and the report counts the bytes of the values read.
        """
        start = time.perf_counter()
        by_name = self.model.state_dict(keep_vars=True)  # tied weights appear under every name
        canon = weight_tensors(self.model)
        sent = 0
        with torch.no_grad():
            for key, value in tensors.items():
                sent += value.numel() * value.element_size()
                if key in by_name:
                    by_name[key].data.copy_(value)
                elif key.endswith(".weight") and key[: -len(".weight")] in canon:
                    canon[key[: -len(".weight")]].data.copy_(value)
                else:
                    raise KeyError(f"engine model has no tensor {key!r}")
        return SyncReport(bytes=sent, receivers=1, seconds=time.perf_counter() - start)

    # ------------------------------------------------------------------------------------------ sampling
    @torch.no_grad()
    def generate(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig, prompt_seeds: Sequence[int] | None = None
    ) -> Rollout:
        """Sample ``sampling.n`` responses per prompt; rows are grouped by prompt (prompt 0 × n, prompt 1 × n...).

        With ``prompt_seeds`` each response draws from its own generator, seeded by its prompt's seed and its
        index among the prompt's ``n`` responses: a prompt gets the same responses whatever batch, rank or
        process layout it is sampled in (data-parallel runs then equal single-process ones).
        """
        start = time.perf_counter()
        rows, index, seeds = expand_prompts(prompts, sampling, self.context_limit, prompt_seeds)
        gens: list[torch.Generator] | torch.Generator
        if seeds is None:
            gens = torch.Generator(device="cpu").manual_seed(sampling.seed)
        else:
            gens = [torch.Generator(device="cpu").manual_seed(seed) for seed in seeds]
        responses: list[list[int]] = []
        logprobs: list[list[float]] = []
        reasons: list[FinishReason] = []
        for lo in range(0, len(rows), self.max_batch):
            gen = gens if isinstance(gens, torch.Generator) else gens[lo : lo + self.max_batch]
            r, lp, fr = self._generate_batch(rows[lo : lo + self.max_batch], sampling, gen)
            responses += r
            logprobs += lp
            reasons += fr
        return Rollout.sampled(rows, index, responses, logprobs, reasons, start)

    def _generate_batch(
        self, rows: list[list[int]], sampling: SamplingConfig, gen: torch.Generator | list[torch.Generator]
    ) -> tuple[list[list[int]], list[list[float]], list[FinishReason]]:
        device = next(self.model.parameters()).device
        width = max(len(r) for r in rows)
        ids = torch.tensor([[self.pad_token_id] * (width - len(r)) + r for r in rows], device=device)
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache()
        out = self.model(
            input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True
        )
        logits = out.logits[:, -1, :]
        batch = len(rows)
        done = torch.zeros(batch, dtype=torch.bool)
        tokens: list[list[int]] = [[] for _ in rows]
        lps: list[list[float]] = [[] for _ in rows]
        reasons: list[FinishReason] = ["length"] * batch
        eos = torch.tensor(sorted(self.eos))
        next_pos = positions[:, -1:] + 1
        for _ in range(sampling.max_new_tokens):
            if not bool(torch.isfinite(logits).all()):
                raise PolicyDivergedError(
                    "the rollout engine's logits hold inf/NaN: the policy weights are no longer finite"
                )
            tok, lp = sample_tokens(logits.float(), sampling.temperature, sampling.top_p, gen)
            for b in torch.nonzero(~done).flatten().tolist():
                tokens[b].append(int(tok[b]))
                lps[b].append(float(lp[b]))
            finished_now = torch.isin(tok.cpu(), eos) & ~done
            for b in torch.nonzero(finished_now).flatten().tolist():
                reasons[b] = "stop"
            done |= finished_now
            if bool(done.all()):
                break
            tok = torch.where(done.to(device), torch.full_like(tok, self.pad_token_id), tok)
            mask = torch.cat([mask, torch.ones(batch, 1, dtype=mask.dtype, device=device)], dim=1)
            out = self.model(
                input_ids=tok.unsqueeze(1),
                attention_mask=mask,
                position_ids=next_pos,
                past_key_values=cache,
                use_cache=True,
            )
            logits = out.logits[:, -1, :]
            next_pos = next_pos + 1
        return tokens, lps, reasons


def sample_tokens(
    logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator | list[torch.Generator]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row; return it and its log-prob under the distribution it was drawn from.

    ``gen`` is one generator for the batch, or one per row. Greedy (``temperature == 0``) takes the argmax and
    reports its log-prob under the raw logits.
    """
    if temperature == 0:
        logp = torch.log_softmax(logits, dim=-1)
        tok = logits.argmax(dim=-1)
        return tok, logp.gather(-1, tok.unsqueeze(-1)).squeeze(-1)
    logp = torch.log_softmax(top_p_filter(logits / temperature, top_p), dim=-1)
    probs = logp.exp().cpu()
    if isinstance(gen, torch.Generator):
        tok = torch.multinomial(probs, 1, generator=gen).squeeze(-1)
    else:
        tok = torch.cat([torch.multinomial(probs[i : i + 1], 1, generator=g).squeeze(-1) for i, g in enumerate(gen)])
    tok = tok.to(logits.device)
    return tok, logp.gather(-1, tok.unsqueeze(-1)).squeeze(-1)


def _private_copy(model: PreTrainedModel) -> PreTrainedModel:
    """A deep copy without sketch hooks or autograd state: the engine must never feed the trainer's sketches."""
    clone = copy.deepcopy(model)
    for module in clone.modules():
        module._forward_hooks.clear()
        module._forward_pre_hooks.clear()
    return clone

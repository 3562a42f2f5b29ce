"""``HeldOutKL``: the realized KL of every update on fixed prompts and responses that no loss sees.

``PredictedKLControl`` prices (and, with ``calibrate``, measures) each update's KL on responses of the update's own
batch, whose tokens are also in the gradient. A step made mostly of the batch's own gradient moves exactly those
contexts, while a step made mostly of history (a first moment, a carried state) moves them less than it moves the
policy elsewhere: two methods held to the same in-batch KL need not change the policy by the same amount. This
callback measures the change where no loss looks: on responses to held-out prompts (the data module's first
evaluation problems), sampled once by the policy as training starts and kept fixed for the whole run (saved in the
checkpoint, so a resumed run measures on the very same tokens).

After every training step it logs::

    kl/heldout_realized          = mean over the held-out response positions of KL(π_before ‖ π_after)
    kl/heldout_gain_per_sqrt_kl  = method.last_gain / sqrt(kl/heldout_realized)   (where the method measures its gain)

``π`` at the sampling temperature, from full distributions (algorithm.md §6's realized KL, summed in float64), the
policy's log-probabilities after each step kept for the next one in float32 (positions × vocabulary × 4 bytes: 38 MB
for 192 positions of SmolLM2's 49,152 tokens; ``max_positions`` caps it; float32 storage puts the KL within ~1e-5 of
its float64 value): one no-grad forward per step. Under several ranks every rank holds the same contexts and the
sums are all-reduced.
"""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from logra_pl.callbacks.contract import require_view, view_of
from logra_pl.errors import ConfigError, check_int, check_range
from logra_pl.rollout.base import SamplingConfig
from logra_pl.runtime.ranks import all_reduce_sum
from logra_pl.train.logprobs import pack_responses


def kl_from_logprobs(before: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    """Per position ``KL(p ‖ q) = Σ_v p_v (log p_v − log q_v)`` from log-probabilities ``(N, V)``, in float64."""
    lp, lq = before.to(torch.float64), after.to(torch.float64)
    return (lp.exp() * (lp - lq)).sum(dim=-1)


class HeldOutKL(pl.Callback):
    """Measure each update's realized KL on held-out prompts and responses outside every loss.

    Arguments:
        prompts: held-out prompts: the first ``prompts`` evaluation problems of the data module (``eval_items``).
        responses_per_prompt: responses sampled per prompt, once, by the policy as training starts.
        max_new_tokens: their length limit; None: the run's ``rollout.max_new_tokens``.
        temperature: the sampling (and KL) temperature; None: the run's training temperature.
        seed: the sampling seed of the held-out responses.
        max_positions: the most response positions measured (the responses are cut, in order, to fit): the kept
            log-probabilities hold ``max_positions × vocabulary`` floats.
        rows_per_forward: rows per no-grad forward (bounds the logits' memory).
    """

    READS = ("policy", "method", "sampler", "rollout_settings", "tokenizer")

    def __init__(
        self,
        prompts: int = 8,
        responses_per_prompt: int = 1,
        max_new_tokens: int | None = None,
        temperature: float | None = None,
        seed: int = 0,
        max_positions: int = 1024,
        rows_per_forward: int = 8,
    ) -> None:
        check_int("prompts", prompts, 1)
        check_int("responses_per_prompt", responses_per_prompt, 1)
        if max_new_tokens is not None:
            check_int("max_new_tokens", max_new_tokens, 1)
        if temperature is not None:
            check_range("temperature", temperature, 0.0, low_open=True)
        check_int("seed", seed, 0)
        check_int("max_positions", max_positions, 1)
        check_int("rows_per_forward", rows_per_forward, 1)
        self.prompts, self.responses_per_prompt = prompts, responses_per_prompt
        self.max_new_tokens, self.temperature, self.seed = max_new_tokens, temperature, seed
        self.max_positions, self.rows_per_forward = max_positions, rows_per_forward
        self.contexts: dict[str, list[list[int]]] | None = None  # prompt_ids, response_ids (checkpoint state)
        self.history: list[float] = []
        self._before: torch.Tensor | None = None
        self._temperature = 1.0

    # ---------------------------------------------------------------------------------------- contexts
    def _sample(self, trainer: pl.Trainer, view: Any) -> dict[str, list[list[int]]]:
        """Sample the held-out responses with the policy as it is (the engine holds the trainer's weights)."""
        items = list(getattr(trainer.datamodule, "eval_items", None) or [])
        if not items:
            raise ConfigError(
                "HeldOutKL takes its prompts from the data module's evaluation problems (eval_items), and this data "
                "module has none: give it evaluation problems (data.eval_size > 0) or remove the callback"
            )
        items = items[: self.prompts]
        settings = view.rollout_settings
        sampling = SamplingConfig(
            n=self.responses_per_prompt,
            temperature=self._temperature,
            max_new_tokens=self.max_new_tokens or settings.max_new_tokens,
            seed=self.seed,
        )
        seeds = [(self.seed * 1_000_003 + i) % 2**31 for i in range(len(items))]
        rollout = view.sampler.generate(view.sampler.encode(items), sampling, seeds)
        contexts: dict[str, list[list[int]]] = {"prompt_ids": [], "response_ids": []}
        budget = self.max_positions
        for prompt, response in zip(rollout.prompt_ids, rollout.response_ids, strict=True):
            if response and budget > 0:
                contexts["prompt_ids"].append(list(prompt))
                contexts["response_ids"].append(list(response[:budget]))
                budget -= len(contexts["response_ids"][-1])
        return contexts

    @torch.no_grad()
    def logprobs(self, pl_module: Any) -> torch.Tensor:
        """The policy's log-probabilities ``(positions, V)`` (float32) at every held-out response position."""
        view = view_of(pl_module, self.READS)
        assert view is not None and self.contexts is not None
        pad = view.tokenizer.pad_token_id
        prompts, responses = self.contexts["prompt_ids"], self.contexts["response_ids"]
        device, out = pl_module.device, []
        with torch.autocast(device_type=device.type, enabled=False):  # the policy's own precision, as the probe
            for lo in range(0, len(prompts), self.rows_per_forward):
                hi = lo + self.rows_per_forward
                packed = pack_responses(prompts[lo:hi], responses[lo:hi], pad)
                logits = view.policy(
                    input_ids=packed.input_ids.to(device),
                    attention_mask=packed.attention_mask.to(device),
                    position_ids=packed.position_ids.to(device),
                    use_cache=False,
                ).logits
                for b in range(logits.shape[0]):
                    start, n = int(packed.starts[b]), int(packed.lengths[b])
                    rows = logits[b, start : start + n].to(torch.float64) / self._temperature
                    out.append(torch.log_softmax(rows, dim=-1).to(torch.float32))
        return torch.cat(out)

    # ------------------------------------------------------------------------------------------- hooks
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Refuse a module without the parts of the policy contract this callback reads."""
        require_view(pl_module, "HeldOutKL", self.READS)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Sample the held-out responses (unless a checkpoint brought them) and take the policy's log-probs on them."""
        view = require_view(pl_module, "HeldOutKL", self.READS)
        temperature = self.temperature or view.rollout_settings.temperature
        self._temperature = temperature if temperature > 0 else 1.0
        if self.contexts is None:
            self.contexts = self._sample(trainer, view)
            tokens = sum(len(r) for r in self.contexts["response_ids"])
            rank_zero_info(f"HeldOutKL: {len(self.contexts['response_ids'])} held-out responses, {tokens} positions")
        self._before = self.logprobs(pl_module)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """KL of the step just taken (all its updates) on the held-out positions; the new log-probs are kept."""
        if self._before is None:
            return
        after = self.logprobs(pl_module)
        terms = kl_from_logprobs(self._before, after)
        total = torch.tensor([float(terms.sum()), float(terms.numel())], dtype=torch.float64)
        total = all_reduce_sum(trainer, total, pl_module.device)
        realized = float(total[0] / total[1]) if float(total[1]) > 0 else 0.0
        self._before = after
        self.history.append(realized)
        log = {"kl/heldout_realized": realized}
        gain = pl_module.method.last_gain
        if gain is not None and realized > 0:
            log["kl/heldout_gain_per_sqrt_kl"] = gain / math.sqrt(realized)
        pl_module.log_dict(log, on_step=True, batch_size=1)

    @override
    def state_dict(self) -> dict[str, Any]:
        """The held-out contexts (a resumed run measures on the same tokens) and the KL of every step so far."""
        return {"contexts": self.contexts, "history": list(self.history)}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.contexts = state_dict.get("contexts")
        self.history = list(state_dict.get("history", []))

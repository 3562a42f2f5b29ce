"""The reward contract: what a verifier is, how the runner treats it, and small verifiers built on it.

A verifier is anything callable as ``verifier(response, item) -> float`` — nothing to subclass. :class:`Verifier`
states the contract; :func:`check_verifier` checks an object against it when a run is configured (before any model
is loaded), with a message that names the class. The item schema every data source emits:

- ``messages``: the chat prompt, a list of ``{"role": …, "content": …}``;
- ``answer``: the gold answer, a string;
- ``task``: the task or source name;
- ``id``: a stable string id;
- ``metadata``: a free dict.

Reasoning-gym items also keep reasoning-gym's own entry keys (``question``, ``answer``, ``metadata`` with
``source_dataset``), since its scorers need the whole entry. A verifier reads only these keys.
"""

from __future__ import annotations

import inspect
import logging
import math
import re
from collections.abc import Mapping
from decimal import Decimal, InvalidOperation
from typing import Any, Protocol, runtime_checkable

from logra_pl.config import build_class_path
from logra_pl.errors import ConfigError

log = logging.getLogger(__name__)

EXPECTED = "a class with __call__(response, item) -> float"


@runtime_checkable
class Verifier(Protocol):
    """The reward contract: ``verifier(response, item) -> float``.

    Arguments:
        response: the model's decoded response (the sampled completion, without the prompt).
        item: the data item the response answers, in the shared schema (``messages``, ``answer``, ``task``, ``id``,
            ``metadata``; reasoning-gym items also keep their own entry keys). Read it, never modify it.

    The contract:

    - **Range.** Return any finite float: a 0/1 check, partial credit, a reward model's logit. Nothing clamps it.
    - **Failures are never trained on.** Raise when a response cannot be scored: the runner
      (:class:`~logra_pl.rewards.BoundedVerifier`) counts the call in ``verifier/errors``, a non-finite value in
      ``verifier/nan``, a call past the time limit in ``verifier/timeouts``, and leaves the response out of the
      update (:mod:`logra_pl.rewards.failures`); too many failing updates in a row stop the run
      (``scoring.max_failure_rate``, ``scoring.max_failed_updates``). A value you return is a reward, even one you
      chose after catching an error. Raise a :class:`~logra_pl.errors.ConfigError` when the verifier cannot work at
      all (a missing model): that stops the run at once, with your message.
    - **Correctness (optional).** A method ``correct(response, item, reward) -> bool`` says whether a scored response
      counts as correct for ``val/pass@k`` (and the baselines' outcome, when they take it from the verifier). Without
      it, or when it returns None, a response is correct when ``reward >= scoring.correct_threshold`` (1.0 by
      default, so a [0, 1] verifier's 1 means "right").
    - **Batches (optional).** A method ``score_batch(responses, items) -> list`` scores a whole batch at once, in
      the training process (a reward model on a GPU, concurrent requests to a judge): the runner then calls it,
      once per batch, instead of ``__call__`` in worker processes, so the model is loaded once, not in every worker.
      Return one value per response; an element may be an exception instance for a response that failed (a
      ``TimeoutError`` counts as a timeout), and raising fails the whole batch. There is no runner time limit on
      it (a thread cannot be killed): bound its own time (request timeouts). ``__call__`` stays the one-response
      form of the same reward.
    - **Picklable.** Per-call verifiers are sent to worker processes once each, so they must pickle: a module-level
      class instance or function, not a lambda or closure (drop unpicklable caches in ``__getstate__``).
    - **Counters (optional).** Integer attributes ``errors`` (malformed items, scorer failures) and
      ``long_answers`` (answers over a length cap, rejected unscored). Incremented inside a worker, they are sent
      back with each reward and added to the caller's copy, which is logged as ``verifier/errors`` and
      ``verifier/long_answers``; the runner may also set them (checkpoint restore).
    - **Components (optional).** A method ``components(response, item) -> dict[str, float]`` reports named parts of
      the reward, which the runner averages over each batch's scored responses (``BoundedVerifier.last_components``)
      and the module logs as ``reward/<name>``. It is called after the reward on the same ``(response, item)``, so a
      verifier may reuse what that call computed.
    - **State (optional).** ``state_dict() -> dict`` and ``load_state_dict(state)``: kept in checkpoints (e.g. a
      reward model's running normalisation), restored on resume.
    - **Time.** A per-call verifier's call may be killed after ``scoring.timeout_s``; it then counts as a timeout.

    Example — a complete verifier::

        class LengthPenalty:
            def __call__(self, response: str, item: Mapping[str, Any]) -> float:
                return 1.0 if len(response) < 200 else -0.5
    """

    # Positional-only and typed ``Any`` on purpose: the contract is "called as verifier(response, item)", so a user's
    # class matches whatever it names its parameters and whether or not it annotates them (jsonargparse checks
    # a class_path against this signature when a config chooses the verifier).
    def __call__(self, response: Any, item: Any, /) -> Any:
        """The reward for ``response`` (str) to ``item`` (the item mapping): a finite float."""
        ...


def batch_scorer(verifier: Any) -> Any:
    """The verifier's ``score_batch`` when it has a callable one (it is then scored in batches, in this process),
    else None."""
    found = getattr(verifier, "score_batch", None)
    return found if callable(found) else None


def ask_correct(verifier: Any, response: str, item: Any, reward: float) -> bool | None:
    """The verifier's own verdict on a scored response: its ``correct(response, item, reward)`` as a bool, or None
    when it has no such method or returns None (the runner then compares the reward with the threshold)."""
    found = getattr(verifier, "correct", None)
    if not callable(found):
        return None
    said = found(response, item, reward)
    return None if said is None else bool(said)


def check_verifier(obj: Any) -> None:
    """Raise :class:`~logra_pl.errors.ConfigError` unless ``obj`` can be called as ``obj(response, item)``.

    Arguments:
        obj: the configured verifier (an instance, or a function).

    A class itself (rather than an instance), a non-callable object, and a callable whose signature cannot take
    exactly two positional arguments are refused with a message naming the class. Callables whose signature Python
    cannot inspect (some builtins) are accepted.
    """
    if inspect.isclass(obj):
        raise ConfigError(
            f"verifier {obj.__module__}.{obj.__qualname__} is a class, not an instance: expected {EXPECTED}, "
            "given as an instance (in YAML: class_path + init_args)"
        )
    name = _describe(obj)
    if not callable(obj):
        raise ConfigError(f"verifier {name} is not callable: expected {EXPECTED}")
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):
        return
    try:
        signature.bind("response", {})
    except TypeError as err:
        raise ConfigError(
            f"verifier {name} cannot be called as verifier(response, item) ({err}; its signature is "
            f"{signature}): expected {EXPECTED}"
        ) from None


def _describe(obj: Any) -> str:
    if inspect.isfunction(obj) or inspect.ismethod(obj):
        return f"function {obj.__module__}.{obj.__qualname__}"
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def _snake_case(name: str) -> str:
    name = re.sub(r"([A-Z]+)([A-Z][a-z])", r"\1_\2", name)
    return re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name).lower()


def verifier_name(obj: Any) -> str:
    """A short name for ``obj``: its ``name`` attribute if it is a non-empty string, else its class name in snake case.

    Arguments:
        obj: a verifier (a function gives its ``__name__``).

    Example: ``verifier_name(MathVerifier())`` is ``"math_verifier"``.
    """
    name = getattr(obj, "name", None)
    if isinstance(name, str) and name:
        return name
    if inspect.isfunction(obj) or inspect.ismethod(obj) or inspect.isclass(obj):
        return _snake_case(obj.__name__)
    return _snake_case(type(obj).__name__)


# ------------------------------------------------------------------------------------------------------------------
# Answer extraction, shared by verifiers.

_ANSWER_TAGS = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_BOXED = re.compile(r"\\boxed\s*\{")


def extract_final_answer(response: str) -> str | None:
    """The final answer a response states, stripped, or None when it states none.

    Arguments:
        response: the model's response.

    The content of the last ``<answer>…</answer>`` pair if there is one; otherwise the content of the last
    ``\\boxed{…}`` (braces balanced, so ``\\boxed{\\frac{1}{2}}`` gives ``\\frac{1}{2}``; a box nested in another
    belongs to the outer one); otherwise None. A last box whose braces never close (a truncated response) gives None
    rather than an earlier box.
    """
    tagged = _ANSWER_TAGS.findall(response)
    if tagged:
        return tagged[-1].strip()
    last: str | None = None
    position = 0
    while (match := _BOXED.search(response, position)) is not None:
        depth, start = 1, match.end()
        end = start
        while end < len(response) and depth:
            char = response[end]
            if char == "\\":  # an escaped character (\{, \}) does not count as a brace
                end += 2
                continue
            depth += (char == "{") - (char == "}")
            end += 1
        if depth:
            return None
        last = response[start : end - 1].strip()
        position = end
    return last


# ------------------------------------------------------------------------------------------------------------------
# Exact match.

_NUMBER = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?")


def _gold_answer(item: Any) -> str:
    """``item["answer"]`` as a string (numbers are converted); ValueError when the item has no usable answer."""
    if not isinstance(item, Mapping):
        raise ValueError(f"item is a {type(item).__name__}, not a mapping")
    if "answer" not in item:
        raise ValueError(f"item has no 'answer' (keys: {sorted(map(str, item))})")
    answer = item["answer"]
    if isinstance(answer, str):
        return answer
    if isinstance(answer, int | float) and not isinstance(answer, bool):
        return str(answer)
    raise ValueError(f"item 'answer' is a {type(answer).__name__}, not a string")


def _item_label(item: Any) -> str:
    if isinstance(item, Mapping):
        for key in ("id", "task"):
            if isinstance(item.get(key), str):
                return f"{key} {item[key]!r}"
    return "?"


def normalize_answer(text: str) -> str:
    """``text`` stripped, whitespace runs collapsed to one space, casefolded, one trailing period dropped.

    Arguments:
        text: an answer.
    """
    text = " ".join(text.split()).casefold()
    if text.endswith("."):
        text = text[:-1].rstrip()
    return text


def _same_number(a: str, b: str) -> bool | None:
    """Whether two plain decimal numbers are equal (exactly, as decimals); None unless both are such numbers."""
    if not (_NUMBER.fullmatch(a) and _NUMBER.fullmatch(b)):
        return None
    try:
        return Decimal(a) == Decimal(b)
    except InvalidOperation:
        return None


class ExactMatch:
    """Reward 1 when the response's final answer equals ``item["answer"]``, else 0.

    Arguments:
        normalize: compare after :func:`normalize_answer` (strip, collapse whitespace, casefold, drop a trailing
            period), and compare plain decimal numbers by value (``"3.0"`` equals ``"3"``, ``"1e3"`` equals
            ``"1000"``; exact decimal comparison, no float rounding). ``False`` compares the stripped strings.
        max_answer_chars: an extracted answer longer than this scores 0 and increments :attr:`long_answers`.

    The final answer is :func:`extract_final_answer` of the response (``<answer>`` tags, else the last
    ``\\boxed{}``), or the whole stripped response when it has neither. An item without a usable ``answer`` (not a
    mapping, no ``answer``, an answer that is not a string or number) scores 0, increments :attr:`errors` and logs a
    warning.
    """

    def __init__(self, normalize: bool = True, max_answer_chars: int = 1000) -> None:
        if not isinstance(normalize, bool):
            raise ConfigError(f"normalize must be true or false, got {normalize!r}")
        if isinstance(max_answer_chars, bool) or not isinstance(max_answer_chars, int) or max_answer_chars < 1:
            raise ConfigError(f"max_answer_chars must be an integer >= 1, got {max_answer_chars!r}")
        self.normalize = normalize
        self.max_answer_chars = max_answer_chars
        self.errors = 0
        self.long_answers = 0

    def extract(self, response: str) -> str:
        """The answer compared with the gold one: tags, else the last box, else the whole response (stripped)."""
        answer = extract_final_answer(response)
        return response.strip() if answer is None else answer

    def __call__(self, response: str, item: Mapping[str, Any]) -> float:
        """1.0 when the final answer of ``response`` matches ``item["answer"]``, else 0.0."""
        try:
            gold = _gold_answer(item)
        except ValueError as err:
            self.errors += 1
            log.warning("malformed verifier item: %s (reward 0)", err)
            return 0.0
        answer = self.extract(response)
        if len(answer) > self.max_answer_chars:
            self.long_answers += 1
            return 0.0
        if not self.normalize:
            return float(answer == gold.strip())
        answer, gold = normalize_answer(answer), normalize_answer(gold)
        same = _same_number(answer, gold)
        return float(answer == gold if same is None else same)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(normalize={self.normalize}, max_answer_chars={self.max_answer_chars})"


# ------------------------------------------------------------------------------------------------------------------
# A weighted combination.


def build_verifier(spec: Any) -> Any:
    """A verifier from ``{"class_path": "pkg.mod.Class", "init_args": {...}}``; anything else is returned as is.

    Arguments:
        spec: a verifier object, or a dict in LightningCLI's ``class_path``/``init_args`` form. ``init_args`` values
            that are themselves such dicts are built first (so combinations nest).
    """
    return build_class_path(spec, "verifier")


def _same_item(a: Any, b: Any) -> bool:
    """``a`` is ``b``, or an equal copy (a worker receives each item unpickled)."""
    if a is b:
        return True
    try:
        return bool(a == b)
    except Exception:
        return False


def read_counter(obj: object, name: str) -> int:
    """A verifier's counter ``name`` (``errors``, ``long_answers``, ...): its int value, 0 when it keeps none (or keeps
    something else under that name)."""
    value = getattr(obj, name, 0)
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


class WeightedRewards:
    """A weighted sum of verifiers: ``reward = Σ wᵢ·rᵢ``, each part reported as a component.

    Arguments:
        verifiers: the parts, by name (the names become ``reward/<name>`` in the logs). Each value is a verifier
            object, or — as LightningCLI YAML gives it — a ``{class_path: ..., init_args: ...}`` dict, built here.
        weights: a finite weight per name (any sign: a part may be a penalty); the names must be those of
            ``verifiers``. Default: ``1/n`` each (the mean of the parts).
        correct_part: the name of the part whose verdict is the response's correctness (pass@k): that part's own
            ``correct(response, item, part_reward)`` when it has one, else full credit (``part_reward >= 1``) — e.g.
            the rule-based check in a sum with a reward model. None: the weighted sum against
            ``scoring.correct_threshold``, like any verifier without ``correct``.

    The parts' rewards are used as they are (no clamp). A part that raises fails the whole call (the exception
    carries a note naming the part), and a part's non-finite value makes the sum non-finite: either way the
    response has no reward and is left out of the update, as for any verifier (:mod:`logra_pl.rewards.failures`).
    :meth:`components` returns ``{name: rᵢ}`` (unweighted). :attr:`errors` and :attr:`long_answers` are the sums of
    the parts' counters; setting them (as the runner does) keeps the parts' own counts.

    When a part scores in batches (``score_batch``: a reward model, a judge), so does the sum: :attr:`score_batch` is
    then callable, the runner calls it in the training process, and the other parts are called response by response
    there too (without the worker time limit). Parts' state (``state_dict``) is kept in checkpoints by name.

    Example (Python)::

        WeightedRewards({"math": MathVerifier(), "exact": ExactMatch()}, weights={"math": 0.8, "exact": 0.2})

    Example (YAML, under ``model:``)::

        verifier:
          class_path: logra_pl.rewards.WeightedRewards
          init_args:
            verifiers:
              math: {class_path: logra_pl.rewards.MathVerifier}
              exact: {class_path: logra_pl.rewards.ExactMatch, init_args: {normalize: true}}
            weights: {math: 0.8, exact: 0.2}
            correct_part: math
    """

    def __init__(
        self,
        verifiers: Mapping[str, Verifier | dict[str, Any]],
        weights: Mapping[str, float] | None = None,
        correct_part: str | None = None,
    ) -> None:
        if not isinstance(verifiers, Mapping) or not verifiers:
            raise ConfigError(f"WeightedRewards needs a non-empty mapping of name -> verifier, got {verifiers!r}")
        built: dict[str, Any] = {}
        for name, spec in verifiers.items():
            if not isinstance(name, str) or not name:
                raise ConfigError(f"WeightedRewards verifier names must be non-empty strings, got {name!r}")
            verifier = build_verifier(spec)
            try:
                check_verifier(verifier)
            except ConfigError as err:
                raise ConfigError(f"WeightedRewards part {name!r}: {err}") from None
            built[name] = verifier
        if weights is None:
            weights = {name: 1.0 / len(built) for name in built}
        if not isinstance(weights, Mapping):
            raise ConfigError(f"WeightedRewards weights must be a mapping of name -> weight, got {weights!r}")
        if set(weights) != set(built):
            missing, extra = sorted(set(built) - set(weights)), sorted(set(weights) - set(built))
            raise ConfigError(
                f"WeightedRewards weights must name exactly the verifiers {sorted(built)}: "
                f"missing {missing}, unknown {extra}"
            )
        for name, weight in weights.items():
            if isinstance(weight, bool) or not isinstance(weight, int | float) or not math.isfinite(weight):
                raise ConfigError(f"WeightedRewards weight {name!r} must be a finite number, got {weight!r}")
        if correct_part is not None and correct_part not in built:
            raise ConfigError(
                f"WeightedRewards correct_part {correct_part!r} is not one of the parts {sorted(built)}: name one, "
                "or leave it null (the weighted sum against scoring.correct_threshold)"
            )
        self.verifiers = built
        self.weights = {name: float(weights[name]) for name in built}
        self.correct_part = correct_part
        self._errors = 0
        self._long_answers = 0
        self._last: tuple[str, Any, dict[str, float]] | None = None
        self._batch_parts: dict[tuple[str, int], dict[str, float]] = {}  # the last batch's parts, by (response, item)

    # -- counters: the parts' plus this object's own -------------------------------------------------------------

    def _parts_count(self, name: str) -> int:
        return sum(read_counter(verifier, name) for verifier in self.verifiers.values())

    @property
    def errors(self) -> int:
        """The sum of the parts' ``errors`` counters."""
        return self._parts_count("errors") + self._errors

    @errors.setter
    def errors(self, value: int) -> None:
        self._errors = int(value) - self._parts_count("errors")

    @property
    def long_answers(self) -> int:
        """The sum of the parts' ``long_answers`` counters."""
        return self._parts_count("long_answers") + self._long_answers

    @long_answers.setter
    def long_answers(self, value: int) -> None:
        self._long_answers = int(value) - self._parts_count("long_answers")

    # -- scoring ---------------------------------------------------------------------------------------------------

    def _score_parts(self, response: str, item: Mapping[str, Any]) -> dict[str, float]:
        parts: dict[str, float] = {}
        for name, verifier in self.verifiers.items():
            try:
                parts[name] = float(verifier(response, item))
            except Exception as err:  # the whole call fails: say which part
                err.add_note(f"in WeightedRewards part {name!r}")
                raise
        self._last = (response, item, parts)
        return parts

    def _total(self, parts: Mapping[str, float]) -> float:
        return math.fsum(self.weights[name] * reward for name, reward in parts.items())

    def components(self, response: str, item: Mapping[str, Any]) -> dict[str, float]:
        """``{name: rᵢ}``, each part's reward (reused from the preceding call or batch on an equal pair).

        Arguments:
            response: the model's response.
            item: the item it answers.
        """
        batched = self._batch_parts.get((response, id(item)))
        if batched is not None:
            return dict(batched)
        last = self._last
        if last is not None and last[0] == response and _same_item(last[1], item):
            return dict(last[2])
        return dict(self._score_parts(response, item))

    def __call__(self, response: str, item: Mapping[str, Any]) -> float:
        """``Σ wᵢ·rᵢ`` over the parts."""
        return self._total(self._score_parts(response, item))

    def correct(self, response: str, item: Mapping[str, Any], reward: float) -> bool | None:
        """The verdict of :attr:`correct_part` (its ``correct``, else full credit ``rᵢ >= 1``); None without one (the
        runner then compares the sum with ``scoring.correct_threshold``)."""
        if self.correct_part is None:
            return None
        value = self.components(response, item)[self.correct_part]
        said = ask_correct(self.verifiers[self.correct_part], response, item, value)
        return value >= 1.0 if said is None else said

    @property
    def score_batch(self) -> Any:
        """:meth:`_score_batch` when a part scores in batches, else None (the sum is then scored call by call)."""
        return self._score_batch if any(batch_scorer(v) is not None for v in self.verifiers.values()) else None

    def _score_batch(self, responses: list[str], items: list[Mapping[str, Any]]) -> list[Any]:
        """The sums of a batch: batch parts through their ``score_batch``, the others call by call; a response that
        failed in any part is that part's exception (with a note naming it)."""
        columns: dict[str, list[Any]] = {}
        for name, verifier in self.verifiers.items():
            batch = batch_scorer(verifier)
            if batch is not None:
                values = list(batch(responses, items))
                if len(values) != len(responses):
                    raise ValueError(f"part {name!r}: score_batch returned {len(values)} values for {len(responses)}")
            else:
                values = [_call_or_error(verifier, r, i) for r, i in zip(responses, items, strict=True)]
            columns[name] = values
        self._batch_parts = {}
        out: list[Any] = []
        for k, (response, item) in enumerate(zip(responses, items, strict=True)):
            failed = next(((n, c[k]) for n, c in columns.items() if isinstance(c[k], BaseException)), None)
            if failed is not None:
                failed[1].add_note(f"in WeightedRewards part {failed[0]!r}")
                out.append(failed[1])
                continue
            parts = {name: float(column[k]) for name, column in columns.items()}
            self._batch_parts[(response, id(item))] = parts
            out.append(self._total(parts))
        return out

    def state_dict(self) -> dict[str, Any]:
        """The parts' state, by name (parts without ``state_dict`` left out)."""
        return {name: v.state_dict() for name, v in self.verifiers.items() if callable(getattr(v, "state_dict", None))}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved."""
        for name, part_state in state.items():
            if name in self.verifiers and callable(getattr(self.verifiers[name], "load_state_dict", None)):
                self.verifiers[name].load_state_dict(part_state)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_last"] = None  # the cached last item is not part of the verifier
        state["_batch_parts"] = {}
        return state

    def __repr__(self) -> str:
        parts = ", ".join(f"{name}: {self.weights[name]:g}·{verifier!r}" for name, verifier in self.verifiers.items())
        extra = f", correct_part={self.correct_part!r}" if self.correct_part is not None else ""
        return f"{type(self).__name__}({{{parts}}}{extra})"


def _call_or_error(verifier: Any, response: str, item: Mapping[str, Any]) -> Any:
    """``float(verifier(response, item))``, or the exception it raised (a batch element that failed)."""
    try:
        return float(verifier(response, item))
    except Exception as err:
        return err

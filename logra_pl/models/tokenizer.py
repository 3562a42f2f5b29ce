"""A byte-level BPE tokenizer trained offline from reasoning-gym text, with a ChatML chat template.

Byte-level BPE (like Qwen2's) covers every string, so prompts of any task still tokenize; training it on the
tasks' own questions gives short sequences for the tiny models used in tests and CPU demos.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import reasoning_gym
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD_TOKEN, IM_START, IM_END)

# ChatML, as Qwen2 uses: the assistant turn ends with <|im_end|>, which is also the EOS token.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

DEFAULT_CORPUS_TASKS: tuple[str, ...] = (
    "chain_sum",
    "basic_arithmetic",
    "leg_counting",
    "letter_counting",
    "spell_backward",
    "word_sorting",
    "gsm_symbolic",
)


def reasoning_gym_corpus(tasks: Sequence[str] = DEFAULT_CORPUS_TASKS, per_task: int = 300, seed: int = 0) -> list[str]:
    """Questions and answers of ``per_task`` deterministic samples of each reasoning-gym task, plus role names."""
    texts = ["system", "user", "assistant", "<answer>", "</answer>", "<think>", "</think>"]
    for task in tasks:
        for item in reasoning_gym.create_dataset(task, size=per_task, seed=seed):
            texts.append(item["question"])
            texts.append(str(item["answer"]))
    return texts


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on ``texts`` and wrap it as a transformers fast tokenizer with a chat template.

    Arguments:
        texts: training text.
        vocab_size: target vocabulary size, special tokens and the 256 byte symbols included.
    """
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must be >= {256 + len(SPECIAL_TOKENS)} for a byte-level BPE, got {vocab_size}")
    core = Tokenizer(models.BPE())
    # Digits are split one by one (as Llama/Qwen-style tokenizers do): numbers become sequences of digit
    # tokens, which a tiny model can learn arithmetic on; merged multi-digit tokens it cannot.
    core.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    core.decoder = decoders.ByteLevel()
    core.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(list(texts), trainer=trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token=IM_END,
        pad_token=PAD_TOKEN,
        bos_token=None,
        unk_token=None,
        additional_special_tokens=[IM_START],
        clean_up_tokenization_spaces=False,
    )
    tok.chat_template = CHAT_TEMPLATE
    tok.padding_side = "left"  # generation pads on the left
    return tok

"""A small Qwen-style byte-level BPE tokenizer, trained locally and deterministically.

No hub downloads are possible on this project's machines, so the tiny test/demo checkpoints ship a tokenizer
trained here on a fixed corpus that this module generates in code (English prose, chat-formatted tool-use
trajectories, arithmetic, python snippets, ``\\boxed{}`` answers and numbers).

What matches Qwen2/Qwen3 tokenizers:
- NFC normalizer, the Qwen pre-tokenizer regex (single digits, so ``12*7`` tokenizes digit by digit), then
  byte-level mapping without a prefix space; a byte-level decoder. Every byte is in the base alphabet, so
  any text encodes.
- Chat special tokens ``<|endoftext|>`` (pad, and the bos id written to config.json), ``<|im_start|>``,
  ``<|im_end|>`` (eos). These are "special": ``decode(..., skip_special_tokens=True)`` drops them.
- The ARPO tool tags (``<think>``, ``</think>``, ``<search>``, ... ``</answer>``) are single added tokens
  that are NOT special (like ``<think>`` in Qwen3): decoding with ``skip_special_tokens=True`` keeps them,
  because the reward and the tool loop parse them from decoded text. Added tokens are matched anywhere,
  also glued to other text (``x</search>``).
- The added tokens take the last ids, after the BPE vocabulary, as in Qwen.

Differences from Qwen: a tiny vocabulary (``len(tokenizer) == vocab_size``, 1000 for the tiny configs, so
every id a model emits decodes), ``tokenizer_class`` is the generic ``PreTrainedTokenizerFast`` (loads
tokenizer.json verbatim in transformers 4 and 5 and in vLLM), and a minimal chat template (no default
system prompt, no tool-call or thinking-mode handling).

Determinism: the corpus is generated with a fixed integer PRNG (no ``random``/``hash``), the trainer
starts from the full 256-byte alphabet (so token ids never depend on hash-map order) and breaks count ties
by pair ids; ``tokenizer.json`` serialises vocab and merges in id order. Tested by building twice in
separate processes and comparing bytes.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import Iterator

from megatron_arpo.fsutil import atomic_write

logger = logging.getLogger(__name__)

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
TOOL_TAGS = ("<think>", "</think>", "<search>", "</search>", "<python>", "</python>",
             "<result>", "</result>", "<answer>", "</answer>")
ADDED_TOKENS = SPECIAL_TOKENS + TOOL_TAGS

# Qwen2/Qwen3's split pattern: contractions, letter runs with one optional leading non-letter, single
# digits, punctuation runs, newlines, whitespace.
PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Qwen-style ChatML. `add_generation_prompt` opens the assistant turn; message content is emitted verbatim.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)

MODEL_MAX_LENGTH = 4096

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


# --------------------------------------------------------------------------------------------------------
# Fixed training corpus
# --------------------------------------------------------------------------------------------------------

_PROSE = """\
The river bends twice before it reaches the old mill, and in spring the water is high enough to turn the wheel again.
People in the village still talk about the winter when the lake froze so thick that a horse and cart could cross it.
A good question is often more useful than a quick answer, because it tells you what you do not yet know.
When you are not sure about a fact, look it up in a reliable source and write down where you found it.
The library opens at nine in the morning and closes at six in the evening, except on Sundays.
Scientists measure the speed of light very precisely; it is close to three hundred thousand kilometres per second.
The capital of France is Paris, the capital of Japan is Tokyo, and the capital of Canada is Ottawa.
Mount Everest is the highest mountain on Earth, and the Pacific is the largest ocean.
She wrote the first draft of the novel in a small notebook, then typed it up during the summer.
To solve a problem step by step, first restate it, then split it into smaller parts and check each part.
The train was late, so they walked to the station café and ordered two cups of tea and a slice of cake.
Water boils at one hundred degrees Celsius at sea level, but at a lower temperature on a high mountain.
The committee will meet again next week to review the results and decide on the budget for the project.
Birds migrate south in the autumn because food becomes scarce in the colder months.
He checked the answer twice, found a small mistake in the second step, and corrected it.
The museum has a large collection of paintings, sculptures and ancient coins from many countries.
Reading every day improves vocabulary, and writing every day improves clarity of thought.
The population of the city grew quickly after the new bridge was built across the river.
If the search results do not answer the question, try a different query with more specific words.
A prime number has exactly two divisors: one and itself. The first prime numbers are two, three, five and seven.
The author was born in a small town, studied history at the university, and later became a journalist.
It's important that you don't guess; we'll verify the result, and they're going to check it as well.
Who discovered penicillin? Which year did the war end? Where is the longest river? How many moons does Mars have?
"""

_WORDS = (
    "the answer is result value number total sum product difference first second third compute check "
    "search python code print question find year city country river mountain author book film team "
    "population capital area speed distance time price cost average square root prime factor list "
    "string function return import math range loop variable step final therefore because so we need "
    "let me think about use tool look up verify correct wrong again next then finally"
).split()

_PEOPLE = ("Ada Lovelace", "Alan Turing", "Marie Curie", "Isaac Newton", "Albert Einstein", "Grace Hopper",
           "Leonardo da Vinci", "Jane Austen", "Nikola Tesla", "Charles Darwin")
_PLACES = ("Paris", "London", "Tokyo", "Berlin", "Madrid", "Rome", "Cairo", "Lima", "Oslo", "Ottawa",
           "Beijing", "Sydney", "Nairobi", "Toronto")
_SYSTEM = (
    "You are a helpful assistant. Solve the question step by step. You can use a search tool and a python "
    "interpreter tool while you think. Put your reasoning inside <think> </think>, a search query inside "
    "<search> </search>, python code inside <python> </python>; tool output is given inside <result> "
    "</result>. Give the final answer inside <answer> </answer> as \\boxed{answer}."
)


class _SplitMix64:
    """A tiny integer PRNG; fixed output on every platform and Python version."""

    def __init__(self, seed: int) -> None:
        self.state = seed & 0xFFFFFFFFFFFFFFFF

    def next(self) -> int:
        self.state = (self.state + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
        return z ^ (z >> 31)

    def randint(self, low: int, high: int) -> int:
        return low + self.next() % (high - low + 1)

    def choice(self, seq):
        return seq[self.next() % len(seq)]


_OPS = (("+", lambda a, b: a + b), ("-", lambda a, b: a - b), ("*", lambda a, b: a * b))


def _arithmetic_trajectory(rng: _SplitMix64) -> str:
    a, b = rng.randint(2, 999), rng.randint(2, 99)
    op, fn = rng.choice(_OPS)
    value = fn(a, b)
    question = f"What is {a} {op} {b}?"
    assistant = (
        f"<think>I need to compute {a}{op}{b}. Let me use python.</think>"
        f"<python>print({a}{op}{b})</python> <result>\n{value}\n</result>"
        f"<think>The result is {value}.</think><answer>The final answer is \\boxed{{{value}}}</answer>"
    )
    return _chat(question, assistant)


def _search_trajectory(rng: _SplitMix64) -> str:
    person, place = rng.choice(_PEOPLE), rng.choice(_PLACES)
    year = rng.randint(1500, 2024)
    question = f"In which year did {person} first visit {place}?"
    assistant = (
        f"<think>I should search for {person} and {place}.</think>"
        f"<search>{person} visit {place} year</search> <result>\n{person} travelled to {place} in {year}. "
        f"The visit is described in a letter.\n</result>"
        f"<think>The search says {year}.</think><answer>\\boxed{{{year}}}</answer>"
    )
    return _chat(question, assistant)


def _math_module_trajectory(rng: _SplitMix64) -> str:
    n = rng.randint(2, 40)
    square = n * n
    question = f"What is the square root of {square}?"
    assistant = (
        f"<think>Use the math module.</think>"
        f"<python>import math\nprint(math.sqrt({square}))</python> <result>\n{float(n)}\n</result>"
        f"<think>So the root is {n}.</think><answer>\\boxed{{{n}}}</answer>"
    )
    return _chat(question, assistant)


def _loop_trajectory(rng: _SplitMix64) -> str:
    n = rng.randint(3, 30)
    total = sum(range(1, n + 1))
    question = f"Compute the sum of the integers from 1 to {n}."
    assistant = (
        "<think>A for loop adds them up.</think>"
        f"<python>total = 0\nfor i in range(1, {n} + 1):\n    total += i\nprint(total)</python>"
        f" <result>\n{total}\n</result><think>done</think><answer>\\boxed{{{total}}}</answer>"
    )
    return _chat(question, assistant)


def _chat(question: str, assistant: str) -> str:
    return (f"{IM_START}system\n{_SYSTEM}{IM_END}\n{IM_START}user\n{question}{IM_END}\n"
            f"{IM_START}assistant\n{assistant}{IM_END}\n{ENDOFTEXT}")


def _python_snippets(rng: _SplitMix64) -> str:
    a, b, n = rng.randint(1, 99), rng.randint(1, 99), rng.randint(2, 12)
    name = rng.choice(("x", "y", "values", "result", "count", "items", "total"))
    return "\n".join((
        f"print({a}*{b})",
        f"{name} = [i ** 2 for i in range({n})]",
        f"print(sum({name}), len({name}), max({name}))",
        "def f(x):\n    return x * x + 1\n",
        f"for i in range({n}):\n    if i % 2 == 0:\n        print(i, f(i))",
        f"import math\nprint(math.factorial({n}), math.pi, math.gcd({a}, {b}))",
        f"print(round({a} / {b}, 4))",
        "",
    ))


def _numbers_line(rng: _SplitMix64) -> str:
    nums = [str(rng.randint(0, 10 ** rng.randint(1, 6))) for _ in range(8)]
    a, b = rng.randint(10, 999), rng.randint(10, 999)
    word = " ".join(rng.choice(_WORDS) for _ in range(10))
    return (f"{', '.join(nums)}\n{a} + {b} = {a + b}; {a} * {b} = {a * b}; "
            f"{a} - {b} = {a - b}. The answer is \\boxed{{{a + b}}}.\n{word.capitalize()}.\n")


def iter_training_corpus(num_documents: int = 400) -> Iterator[str]:
    """The fixed training corpus, one document at a time (same output on every machine)."""
    rng = _SplitMix64(20250722)
    makers = (_arithmetic_trajectory, _search_trajectory, _math_module_trajectory, _loop_trajectory)
    for paragraph in _PROSE.splitlines():
        yield paragraph + "\n"
    for i in range(num_documents):
        yield makers[i % len(makers)](rng)
        yield _python_snippets(rng)
        yield _numbers_line(rng)
        yield _PROSE.splitlines()[i % len(_PROSE.splitlines())] + "\n"


_ADDED_TOKEN_SPLIT = re.compile("|".join(re.escape(t) for t in ADDED_TOKENS))


def _training_pieces(documents: Iterator[str]) -> Iterator[str]:
    # At encode time added tokens are cut out before pre-tokenization; train on the same pieces so no
    # merges are spent on fragments like "<|" or "im_start".
    for doc in documents:
        for piece in _ADDED_TOKEN_SPLIT.split(doc):
            if piece:
                yield piece


# --------------------------------------------------------------------------------------------------------
# Build
# --------------------------------------------------------------------------------------------------------

def train_backend_tokenizer(vocab_size: int):
    """Train the ``tokenizers.Tokenizer`` with exactly ``vocab_size`` tokens including the added ones."""
    # deferred: pulls in tokenizers (heavy; this module imports without it)
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    num_added = len(ADDED_TOKENS)
    num_bytes = 256
    if vocab_size < num_bytes + num_added:
        raise ValueError(
            f"vocab_size {vocab_size} is too small for a byte-level tokenizer: it needs the 256 byte tokens "
            f"plus {num_added} added tokens, i.e. vocab_size >= {num_bytes + num_added}"
        )
    bpe_size = vocab_size - num_added
    tokenizer = Tokenizer(models.BPE(unk_token=None, continuing_subword_prefix="", end_of_word_suffix="",
                                     fuse_unk=False, byte_fallback=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=bpe_size,
        min_frequency=2,
        show_progress=False,
        special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        limit_alphabet=num_bytes,
        max_token_length=16,
    )
    tokenizer.train_from_iterator(_training_pieces(iter_training_corpus()), trainer=trainer)
    trained = tokenizer.get_vocab_size(with_added_tokens=False)
    if trained != bpe_size:
        raise RuntimeError(
            f"BPE training produced {trained} tokens, not the {bpe_size} needed for vocab_size {vocab_size} "
            f"({num_added} added tokens); the fixed corpus has too few distinct frequent pairs. Use a smaller "
            f"vocab_size or enlarge iter_training_corpus(num_documents=...)"
        )
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TAGS])
    total = tokenizer.get_vocab_size(with_added_tokens=True)
    if total != vocab_size:
        raise RuntimeError(
            f"tokenizer has {total} tokens after adding {list(ADDED_TOKENS)}, expected {vocab_size}: an added "
            f"token collided with a learned BPE token; this is a bug in {__name__}"
        )
    return tokenizer


def tokenizer_config_dict(tokenizer) -> dict:
    """``tokenizer_config.json`` for transformers' ``AutoTokenizer`` (and vLLM, which uses it)."""
    added = {}
    for token in ADDED_TOKENS:
        added[str(tokenizer.token_to_id(token))] = {
            "content": token, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
            "special": token in SPECIAL_TOKENS,
        }
    return {
        "add_bos_token": False,
        "add_eos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        # Read by transformers 4 and 5 alike; puts <|im_start|> into all_special_ids (bos/eos/pad already
        # are). The tool tags are deliberately absent: they must survive skip_special_tokens=True.
        "additional_special_tokens": [IM_START, IM_END],
        "bos_token": ENDOFTEXT,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": IM_END,
        "errors": "replace",
        "model_max_length": MODEL_MAX_LENGTH,
        "pad_token": ENDOFTEXT,
        "split_special_tokens": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }


def special_tokens_map_dict() -> dict:
    return {"additional_special_tokens": [IM_START, IM_END], "bos_token": ENDOFTEXT, "eos_token": IM_END,
            "pad_token": ENDOFTEXT}


def write_bytes_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same directory, fsync, rename."""
    with atomic_write(path, "wb") as fh:
        fh.write(data)


def dump_json(obj) -> bytes:
    """Canonical JSON bytes (sorted keys, fixed indent, trailing newline) so equal dicts give equal files."""
    return (json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode("utf-8")


def build_tokenizer(vocab_size: int, out_dir: str | os.PathLike) -> dict[str, int]:
    """Train the tokenizer and write tokenizer.json, tokenizer_config.json and special_tokens_map.json.

    Returns the ids of the special tokens: ``{"bos_token_id", "eos_token_id", "pad_token_id"}`` (bos and
    pad are ``<|endoftext|>``, eos is ``<|im_end|>``), for config.json and generation_config.json.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_backend_tokenizer(vocab_size)
    # to_str serialises the vocab, the merges and the added tokens in id order.
    write_bytes_atomic(out / "tokenizer.json", (tokenizer.to_str(pretty=True) + "\n").encode("utf-8"))
    write_bytes_atomic(out / "tokenizer_config.json", dump_json(tokenizer_config_dict(tokenizer)))
    write_bytes_atomic(out / "special_tokens_map.json", dump_json(special_tokens_map_dict()))
    ids = {"bos_token_id": tokenizer.token_to_id(ENDOFTEXT), "eos_token_id": tokenizer.token_to_id(IM_END),
           "pad_token_id": tokenizer.token_to_id(ENDOFTEXT)}
    logger.info("wrote a %d-token byte-level BPE tokenizer to %s (%s)", vocab_size, out, ids)
    return ids

"""Per-request sampling parameters (validated) and the per-step sampling view backends receive."""

from __future__ import annotations

import copy
import functools
import math
import numbers
import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from gemmaserve.errors import InvalidRequestError
from gemmaserve.structured.spec import StructuredOutputs

__all__ = ["VLLM_SAMPLING_OPTIONS_NOT_IMPLEMENTED", "MAX_BAD_WORDS", "MAX_LOGPROBS", "SamplingParams", "RowSampling",
           "allowed_tokens", "MIN_TEMPERATURE", "MIN_REPETITION_PENALTY", "MAX_REPETITION_PENALTY", "SEED_SPACE",
           "MAX_STOP_STRINGS", "MAX_STOP_STRING_CHARS", "MAX_STOP_TOKEN_IDS", "MAX_CHAT_STOP_TOKEN_IDS",
           "MAX_LOGIT_BIAS", "MAX_N", "MAX_ALLOWED_TOKEN_IDS", "all_tokens_mask", "allowed_mask", "mask_allows"]

MIN_TEMPERATURE = 1e-5
"""Temperatures in (0, MIN_TEMPERATURE) are treated as greedy (0): logits / T would overflow."""
MAX_STOP_STRINGS = 16
"""Stop strings per request (each is matched against the text as it streams)."""
MAX_STOP_STRING_CHARS = 4096
"""Characters of one stop string: a request keeps its stop strings while it runs, so without a bound 16 strings of
a million characters each let one client hold gigabytes over a full queue (no reply that long fits a context)."""
MAX_STOP_TOKEN_IDS = 1024
"""Stop token ids per request: more than any tokenizer's special tokens, few enough to check in O(1)."""
MAX_CHAT_STOP_TOKEN_IDS = 16
"""End-of-turn ids a chat adds beyond the request's own ``stop_token_ids`` (``chat_stop_token_ids``)."""
MIN_REPETITION_PENALTY = 0.01
MAX_REPETITION_PENALTY = 100.0
"""``repetition_penalty`` scales a seen token's logit by at most 100 either way: a smaller penalty (vLLM takes any
positive one) multiplies logits past what float16 holds and a denormal one divides them to inf, so the
probabilities become NaN."""
SEED_SPACE = 2**63
"""Seeds the engine draws with: [0, 2**63). A request may give any int64 (:meth:`SamplingParams.__post_init__`)."""
MAX_ALLOWED_TOKEN_IDS = 262_144
"""``allowed_token_ids`` entries per request (Gemma's whole vocabulary)."""
MAX_BAD_WORDS = 128
"""``bad_words`` entries per request (vLLM's limit)."""
MAX_LOGPROBS = 20
"""Most ``logprobs`` alternatives per token (OpenAI's ``top_logprobs`` limit and vLLM's default ``max_logprobs``)."""
MAX_LOGIT_BIAS = 1024
"""Entries of ``logit_bias`` per request (OpenAI documents 300; vLLM accepts more)."""
MAX_N = 64
"""Samples (``n``) per request: each is its own engine request."""


class _DefaultTemperature(float):
    """The type of ``SamplingParams.temperature``'s default (0.0, greedy), to tell it from a 0 the caller gave."""


_GREEDY_BY_DEFAULT = _DefaultTemperature(0.0)


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingParams:
    """How to pick tokens for one request.

    ``temperature == 0`` (the default, unlike vLLM's 1.0) means greedy; so does any temperature below
    ``MIN_TEMPERATURE``. Left at its default, it refuses the options that only change sampling (``n`` > 1,
    ``top_p``, ``top_k``, ``min_p``, ``seed``): a script written for vLLM's default would otherwise get greedy
    copies; give ``temperature`` (0 keeps greedy and accepts them, as vLLM does). ``top_k`` 0 or -1 and
    ``top_p == 1`` disable
    those filters.
    ``min_p`` drops tokens less likely than ``min_p`` times the most likely one (after temperature, top-k and
    top-p; transformers' order). ``min_tokens``: EOS and ``stop_token_ids`` cannot be sampled before that many
    tokens, and a ``stop`` string counts only when it ends after their text (vLLM V1's rule). ``logit_bias`` maps token ids
    to a value in [-100, 100] added to their logits before anything else
    (OpenAI's definition; -100 in practice bans a token). ``structured_outputs`` (a
    :class:`~gemmaserve.structured.StructuredOutputs`, or vLLM's dict of it) constrains the text to a JSON schema,
    regex, choice or grammar; the request stops when the constraint is complete (so it takes no ``min_tokens``).
    Penalties (vLLM's and OpenAI's definitions, applied after ``logit_bias``): ``repetition_penalty`` divides the
    positive logits of tokens seen in the prompt or the output so far by it and multiplies their negative ones (1 =
    off);
    ``frequency_penalty`` subtracts itself times a token's count in the output, ``presence_penalty`` itself once
    for every token the output holds (0 = off).
    ``bad_words`` (vLLM's meaning): words the output must not contain; each is tokenized as it is and with a
    leading space, and the last token of such a sequence cannot be sampled when the tokens generated just before
    it are the rest of the sequence (a one-token word is never sampled).
    ``logprobs`` (vLLM's meaning): None = none; 0 = each generated token's log-probability; k in [1, 20] = that
    and the k most likely tokens at each step with theirs, all under the distribution actually sampled from
    (after ``logit_bias``, the penalties and the masks; before temperature and the filters).
    ``n`` samples of the prompt (at most ``MAX_N``): :class:`gemmaserve.LLM` and the HTTP server run each as its
    own engine request (:meth:`for_sample`: sample ``i`` draws with ``seed + i`` when a seed is given), which share
    the prompt's prefill through the prefix cache; an engine request itself is one sample (``n`` = 1).
    ``seed`` makes sampling reproducible: the same seed, prompt and parameters give the same tokens,
    whatever else is in the batch; any int64 is accepted: -1 means no seed (vLLM's rule), another negative seed s
    is the seed s + 2**63 (so the two give the same text). ``stop_token_ids`` end the request like EOS: the token
    stays in ``token_ids``, its text is left out of the output text (vLLM's rule); ``ignore_eos`` keeps generating
    past EOS (benchmarks). ``stop`` strings end the request at the first match, which is cut from the text (like
    vLLM and OpenAI); they are a text-level feature applied by :class:`gemmaserve.LLM` and the HTTP server (the
    engine itself sees token ids only). ``include_stop_str_in_output`` (vLLM's): keep the matched stop string
    and the text of the EOS / stop token that ended the request. ``skip_special_tokens`` (vLLM's): False shows
    special tokens in the text.
    Keyword-only (vLLM's first positional parameter is ``n``). vLLM options gemmaserve does not implement
    (:data:`VLLM_SAMPLING_OPTIONS_NOT_IMPLEMENTED`) are accepted only at the value that changes nothing.
    """

    max_tokens: int | None = 16
    """Tokens to generate at most; None (vLLM's offline meaning): up to the end of the context, resolved per prompt
    by :class:`gemmaserve.LLM` (an engine request takes an int)."""
    temperature: float = _GREEDY_BY_DEFAULT
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    stop: tuple[str, ...] = field(default_factory=tuple)
    min_p: float = 0.0
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)
    structured_outputs: StructuredOutputs | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None
    bad_words: tuple[str, ...] = field(default_factory=tuple)
    n: int = 1
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    """vLLM's: keep only the prompt's last k tokens (-1: the last the model's context holds; None: all). Applied
    where prompts are tokenized (:class:`gemmaserve.LLM`, the HTTP server); an engine request must already fit it."""
    allowed_token_ids: tuple[int, ...] | None = None
    """vLLM's: only these token ids may be generated (None: any). A backend applies it as the mask structured
    output uses (``capabilities.allowed_token_masks``); it cannot be combined with ``structured_outputs``."""
    chat_stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    """The chat template's end-of-turn ids that :func:`gemmaserve.server.prepare.with_chat_stops` appended to
    ``stop_token_ids`` (those not given already): they end the reply like the others, but do not count toward
    ``MAX_STOP_TOKEN_IDS``, which bounds what a request gives. The tail of ``stop_token_ids``; at most
    ``MAX_CHAT_STOP_TOKEN_IDS``."""

    def __post_init__(self) -> None:
        _plain_numbers(self)
        greedy_by_default = type(self.temperature) is _DefaultTemperature
        if greedy_by_default:
            object.__setattr__(self, "temperature", 0.0)
        spec = self.structured_outputs
        if spec is not None and not isinstance(spec, StructuredOutputs):
            object.__setattr__(self, "structured_outputs", StructuredOutputs.from_mapping(spec))
        object.__setattr__(self, "logit_bias", _logit_bias_pairs(self.logit_bias))
        if self.allowed_token_ids is not None:
            object.__setattr__(self, "allowed_token_ids", _as_tuple(self.allowed_token_ids, "allowed_token_ids", int,
                                                                    "a list of token IDs"))
        for name, single, accepted in (("stop", str, "a string or a list of strings"),
                                       ("bad_words", str, "a list of strings"),
                                       ("stop_token_ids", int, "a list of token IDs"),
                                       ("chat_stop_token_ids", int, "a list of token IDs")):
            object.__setattr__(self, name, _as_tuple(getattr(self, name), name, single, accepted))
        seed = self.seed
        if isinstance(seed, int) and not isinstance(seed, bool) and -SEED_SPACE <= seed < 0:
            object.__setattr__(self, "seed", None if seed == -1 else seed + SEED_SPACE)
        if self.top_k == -1 and not isinstance(self.top_k, bool):  # vLLM's spelling of "disabled"
            object.__setattr__(self, "top_k", 0)
        self.validate()
        if self.allowed_token_ids is not None:  # valid ids by now: distinct, in their order
            object.__setattr__(self, "allowed_token_ids", tuple(dict.fromkeys(self.allowed_token_ids)))
        if greedy_by_default:
            _refuse_sampling_options_under_default_greedy(self)
        if 0.0 < self.temperature < MIN_TEMPERATURE:  # dividing logits by ~0 overflows: that is greedy
            object.__setattr__(self, "temperature", 0.0)

    def validate(self) -> None:
        """Raise :class:`InvalidRequestError` naming the first bad field and the accepted range."""
        if self.max_tokens is not None and (isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int)
                                            or self.max_tokens < 1):
            raise InvalidRequestError(f"max_tokens must be an integer >= 1 or None (up to the end of the context), "
                                      f"got {self.max_tokens!r}")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequestError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if isinstance(self.n, bool) or not isinstance(self.n, int) or not 1 <= self.n <= MAX_N:
            raise InvalidRequestError(f"n must be an integer in [1, {MAX_N}] (samples of the prompt), got {self.n!r}")
        if not _is_real(self.temperature) or not (0.0 <= self.temperature <= 100.0):
            raise InvalidRequestError(
                f"temperature must be a finite number in [0, 100] (0 = greedy), got {self.temperature!r}"
            )
        if not _is_real(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise InvalidRequestError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidRequestError(f"top_k must be an integer >= 0 (0 or -1 = disabled), got {self.top_k!r}")
        if len(self.bad_words) > MAX_BAD_WORDS or not all(isinstance(w, str) and w.strip() and len(w) <= 1024
                                                           for w in self.bad_words):
            raise InvalidRequestError(f"bad_words must be at most {MAX_BAD_WORDS} non-blank strings of at most 1024 "
                                      f"characters, got {len(self.bad_words)} entries")
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise InvalidRequestError(f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}] (the alternatives "
                                      f"returned per token), got {self.logprobs!r}")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int) or not (0 <= self.seed < SEED_SPACE)
        ):
            raise InvalidRequestError(f"seed must be an integer in [-2**63, 2**63) (-1 = no seed), got {self.seed!r}")
        added = self.chat_stop_token_ids
        given = len(self.stop_token_ids) - len(added)
        if len(added) > MAX_CHAT_STOP_TOKEN_IDS or given < 0 or self.stop_token_ids[given:] != added:
            raise InvalidRequestError(
                f"chat_stop_token_ids must be at most {MAX_CHAT_STOP_TOKEN_IDS} ids that end stop_token_ids (the "
                "end-of-turn ids with_chat_stops adds); leave it to with_chat_stops")
        if given > MAX_STOP_TOKEN_IDS:
            raise InvalidRequestError(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids are accepted, got {given}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidRequestError(f"at most {MAX_STOP_STRINGS} stop strings are accepted, got {len(self.stop)}")
        for token_id in self.stop_token_ids:
            if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
                raise InvalidRequestError(f"stop_token_ids must be non-negative integers, got {token_id!r}")
        for text in self.stop:
            if not isinstance(text, str) or not text:
                raise InvalidRequestError(f"stop must hold non-empty strings, got {text!r}")
            if len(text) > MAX_STOP_STRING_CHARS:
                raise InvalidRequestError(f"a stop string has {len(text)} characters; at most {MAX_STOP_STRING_CHARS} "
                                          "are accepted")
        if not _is_real(self.min_p) or not (0.0 <= self.min_p <= 1.0):
            raise InvalidRequestError(f"min_p must be a number in [0, 1] (0 = off), got {self.min_p!r}")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or not (
                0 <= self.min_tokens <= (math.inf if self.max_tokens is None else self.max_tokens)):
            raise InvalidRequestError(
                f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        keep = self.truncate_prompt_tokens
        if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or not (keep == -1 or keep >= 1)):
            raise InvalidRequestError("truncate_prompt_tokens must be None, -1 (the model's context) or an integer "
                                      f">= 1 (the prompt's last tokens to keep), got {keep!r}")
        allowed = self.allowed_token_ids
        if allowed is not None:
            if not 0 < len(allowed) <= MAX_ALLOWED_TOKEN_IDS or not all(
                    isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in allowed):
                raise InvalidRequestError(f"allowed_token_ids must be 1 to {MAX_ALLOWED_TOKEN_IDS} non-negative token "
                                          f"IDs, got {len(allowed)} entries{'' if allowed else ' (none)'}")
            if self.structured_outputs is not None:
                raise InvalidRequestError("allowed_token_ids cannot be combined with an output constraint "
                                          "(structured_outputs, response_format, a tool call constraint): keep the "
                                          "allowed tokens in the constraint itself, or drop one of them")
        if self.min_tokens and self.structured_outputs is not None and self.structured_outputs.trigger is None:
            raise InvalidRequestError(
                f"min_tokens ({self.min_tokens}) cannot be combined with an output constraint (structured_outputs, "
                "response_format, a forced tool call, strict tools under the json tool parser): the constraint ends "
                "the output when it is complete, which may come before min_tokens; drop one of them")
        if not _is_real(self.repetition_penalty) or not (
                MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY):
            raise InvalidRequestError(
                f"repetition_penalty must be a number in [{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}] "
                f"(1 = off), got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not (-2.0 <= value <= 2.0):
                raise InvalidRequestError(f"{name} must be a number in [-2, 2] (0 = off), got {value!r}")
        for pair in self.logit_bias:
            if len(pair) != 2:
                raise InvalidRequestError(f"logit_bias entries are (token id, bias) pairs, got {pair!r}")
            token_id, value = pair
            if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
                raise InvalidRequestError(f"logit_bias keys must be non-negative token ids, got {token_id!r}")
            if not _is_real(value) or not (-100.0 <= value <= 100.0):
                raise InvalidRequestError(f"logit_bias values must be numbers in [-100, 100], got {value!r} for {token_id}")

    def for_sample(self, index: int) -> SamplingParams:
        """The engine request of sample ``index`` in [0, n): ``n`` = 1 and, with a seed, ``seed + index`` (mod
        2**63), so every sample is reproducible on its own and the samples differ."""
        if not 0 <= index < self.n:
            raise ValueError(f"sample index {index} outside [0, n={self.n})")
        seed = None if self.seed is None else (self.seed + index) % SEED_SPACE
        if self.n == 1 and seed == self.seed:
            return self
        sample = copy.copy(self)  # these params were validated, and n = 1 and the seed are valid: no second pass
        object.__setattr__(sample, "n", 1)  # over allowed_token_ids et al. (n copies of 262,144 ids cost seconds)
        object.__setattr__(sample, "seed", seed)
        return sample

    def stop_reason(self, stop_token_id: int | None, eos_token_ids: Collection[int]) -> int | None:
        """vLLM's ``stop_reason`` of an output that ended at ``stop_token_id`` (its EOS or stop token; None when
        none ended it): None for ``eos_token_ids`` (:func:`primary_eos_ids`: vLLM's ``eos_token_id``), unless
        ``ignore_eos`` and the id is listed in ``stop_token_ids``; else the id (a stop token, or one of the model's
        other EOS ids, which vLLM adds to the stop tokens from the generation config)."""
        if stop_token_id is None:
            return None
        if stop_token_id in eos_token_ids and not (self.ignore_eos and stop_token_id in self.stop_token_ids):
            return None
        return stop_token_id

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        """True when a penalty changes the logits (each step then depends on the tokens generated so far)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


def primary_eos_ids(tokenizer: object, model_eos_token_ids: Collection[int]) -> frozenset[int]:
    """The EOS ids whose stop reports ``stop_reason`` None (:meth:`SamplingParams.stop_reason`): vLLM's
    ``eos_token_id``, the tokenizer's own EOS when it names one (``tokenizer.eos_token_ids``), else every one of the
    model's EOS ids."""
    own = getattr(tokenizer, "eos_token_ids", ())
    return frozenset(own) if own else frozenset(model_eos_token_ids)


_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
_INT_FIELDS = ("max_tokens", "top_k", "seed", "min_tokens", "logprobs", "n", "truncate_prompt_tokens")


def _plain_numbers(params: SamplingParams) -> None:
    """numpy (or other ``numbers``) scalars in the numeric fields become Python floats and ints (validation then
    checks their values, not their types); the temperature's default marker is kept."""
    for name in _FLOAT_FIELDS:
        value = getattr(params, name)
        if (type(value) not in (float, _DefaultTemperature) and isinstance(value, numbers.Real)
                and not isinstance(value, bool)):
            object.__setattr__(params, name, float(value))
    for name in _INT_FIELDS:
        value = getattr(params, name)
        if type(value) is not int and isinstance(value, numbers.Integral) and not isinstance(value, bool):
            object.__setattr__(params, name, int(value))


def _refuse_sampling_options_under_default_greedy(params: SamplingParams) -> None:
    """Raise InvalidRequestError naming the sampling-only options given while ``temperature`` was left at its
    greedy default."""
    options = ((f"n={params.n}", params.n != 1), (f"top_p={params.top_p}", params.top_p != 1.0),
               (f"top_k={params.top_k}", params.top_k not in (0, -1)), (f"min_p={params.min_p}", params.min_p != 0.0),
               (f"seed={params.seed}", params.seed is not None))  # seed -1 is None by now
    given = [text for text, present in options if present]
    if given:
        raise InvalidRequestError(
            f"options that only change sampling ({', '.join(given)}) were given, but temperature was left at "
            "SamplingParams' default 0 "
            "(greedy; vLLM's default is 1.0): give temperature=1.0 (or another > 0) to sample, or temperature=0 "
            "to keep greedy decoding")


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


_DECIMAL_ID = re.compile(r"0|[1-9][0-9]{0,9}")
"""A token id written as a string (JSON object keys): ASCII digits, no sign, spaces or leading zeros."""


def _logit_bias_key(key: object) -> int:
    """A ``logit_bias`` key as a token id: an int (not a bool) or a canonical decimal string (``"42"``); anything
    else (``5.7``, ``True``, ``" 5 "``, ``"05"``, ``"٥"``) is an InvalidRequestError naming it."""
    if isinstance(key, int) and not isinstance(key, bool):
        return key
    if isinstance(key, str) and key.isascii() and _DECIMAL_ID.fullmatch(key):
        return int(key)
    raise InvalidRequestError(f"logit_bias key {key!r} is not a token id: keys are non-negative ints or their "
                              "decimal strings without sign, spaces or leading zeros (5 or \"5\")")


def _logit_bias_pairs(bias: object) -> tuple[tuple[Any, ...], ...]:
    """``logit_bias`` (a dict, a list of ``(token id, bias)`` pairs, or None) as sorted pairs; at most
    ``MAX_LOGIT_BIAS`` entries and one per token (a second key naming the same token is refused)."""
    if bias is None:
        return ()
    if isinstance(bias, dict):
        items: list[tuple[Any, ...]] = list(bias.items())
    elif isinstance(bias, (list, tuple)):
        items = [tuple(pair) if isinstance(pair, (list, tuple)) else (pair,) for pair in bias]
    else:
        raise InvalidRequestError(f"logit_bias must map token ids to numbers, got {type(bias).__name__}")
    if len(items) > MAX_LOGIT_BIAS:  # before converting them all
        raise InvalidRequestError(f"logit_bias accepts at most {MAX_LOGIT_BIAS} entries, got {len(items)}")
    pairs: dict[int, tuple[Any, Any]] = {}  # token id -> (key as given, bias)
    for item in items:
        if len(item) != 2:
            raise InvalidRequestError(f"logit_bias entries are (token id, bias) pairs, got {item!r}")
        token_id = _logit_bias_key(item[0])
        if token_id in pairs:
            raise InvalidRequestError(f"logit_bias names token {token_id} twice ({pairs[token_id][0]!r} and "
                                      f"{item[0]!r}); give each token one entry")
        pairs[token_id] = (item[0], item[1])
    return tuple((token_id, pairs[token_id][1]) for token_id in sorted(pairs))



def _as_tuple(value: object, name: str, single: type, accepted: str) -> tuple:
    """A list field as a tuple: None is empty, one ``single`` value (not a bool) is a one-item tuple, a list or
    tuple is kept; anything else is an InvalidRequestError naming ``name`` and what is ``accepted``."""
    if value is None:
        return ()
    if isinstance(value, single) and not isinstance(value, bool):
        return (value,)
    if not isinstance(value, (list, tuple)):
        raise InvalidRequestError(f"{name} must be {accepted}, got {type(value).__name__}")
    return tuple(value)

VLLM_SAMPLING_OPTIONS_NOT_IMPLEMENTED: dict[str, tuple[tuple[Any, ...], str]] = {
    "best_of": ((None,), "every sample is returned; ask for them with n (best_of may equal n)"),
    "spaces_between_special_tokens": ((True,), "special tokens are decoded the tokenizer's way"),
    "detokenize": ((True,), "the text is always decoded, next to token_ids"),
    "prompt_logprobs": ((None,), "the engine computes no prompt logprobs"),
    "output_kind": ((None,), "LLM.generate returns final outputs; LLM.stream yields deltas"),
    "guided_decoding": ((None,), "use structured_outputs=StructuredOutputs(...) or its dict (vLLM's new name)"),
    "logits_processors": ((None, [], ()), "custom logits processors are not supported; use logit_bias, bad_words "
                          "or structured_outputs"),
    "extra_args": ((None, {}), "no plugin reads extra sampling arguments"),
}
"""Options of vLLM's ``SamplingParams(...)`` that gemmaserve does not implement: each accepted only at the value
that means what gemmaserve does anyway (and then dropped: no field holds it), anything else an InvalidRequestError
naming it and why (never silently ignored). ``best_of`` may also equal ``n``; ``output_kind`` may also be vLLM's
``RequestOutputKind.CUMULATIVE`` or ``FINAL_ONLY``."""


def _neutral(name: str, value: Any, options: dict[str, Any]) -> bool:
    """True when vLLM option ``name`` has a value that changes nothing here."""
    accepted = VLLM_SAMPLING_OPTIONS_NOT_IMPLEMENTED[name][0]
    if any(value is ok or (type(value) is type(ok) and value == ok) for ok in accepted):
        return True
    if name == "best_of":
        return isinstance(value, int) and not isinstance(value, bool) and value == options.get("n", 1)
    if name == "output_kind":  # vLLM's RequestOutputKind (an IntEnum): the final output is what generate returns
        return getattr(value, "name", None) in ("CUMULATIVE", "FINAL_ONLY")
    return False


def _keyword_only_init(init: Any) -> Any:
    """Wrap the dataclass ``__init__``: keywords only (vLLM's first positional is ``n``, so ``SamplingParams(2)``
    is refused rather than read as ``max_tokens=2``); vLLM options gemmaserve does not implement are dropped at
    their neutral value and refused by name otherwise; an unknown keyword is a TypeError naming close matches."""

    @functools.wraps(init)
    def __init__(self: SamplingParams, *args: Any, **options: Any) -> None:
        if args:
            raise TypeError(f"SamplingParams takes keyword arguments only, got {len(args)} positional "
                            f"({', '.join(repr(a) for a in args)}); name them, e.g. SamplingParams(max_tokens=16) "
                            "(vLLM's first positional is n)")
        for name in [name for name in options if name in VLLM_SAMPLING_OPTIONS_NOT_IMPLEMENTED]:
            value = options.pop(name)
            if not _neutral(name, value, options):
                accepted, why = VLLM_SAMPLING_OPTIONS_NOT_IMPLEMENTED[name]
                shown = " or ".join(repr(a) for a in accepted if not isinstance(a, tuple))
                raise InvalidRequestError(f"SamplingParams({name}={value!r}) is not implemented by gemmaserve "
                                          f"({why}); leave it unset or {shown}")
        unknown = [name for name in options if name not in SamplingParams.__dataclass_fields__]
        if unknown:
            from difflib import get_close_matches

            close = get_close_matches(unknown[0], [*SamplingParams.__dataclass_fields__,
                                                   *VLLM_SAMPLING_OPTIONS_NOT_IMPLEMENTED], n=3, cutoff=0.6)
            hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else (
                "; see the SamplingParams docstring or docs/api.md for the accepted fields")
            raise TypeError(f"SamplingParams() got an unexpected keyword argument {unknown[0]!r}{hint}")
        init(self, **options)

    return __init__


SamplingParams.__init__ = _keyword_only_init(SamplingParams.__init__)  # type: ignore[method-assign]


@dataclass(slots=True)
class RowSampling:
    """What a backend needs to sample the next token of one row at one step. Read-only by contract: the engine
    builds a new one per row per step and a backend never changes one. (Not ``frozen``, so not hashable: a frozen
    dataclass sets its fields one ``object.__setattr__`` at a time: 2.1 µs per construction against 0.4 µs, on the
    2-core CPU.)

    Randomness must be a pure function of ``(seed, step)`` so a row's tokens never depend on the
    other rows in the batch. ``step`` is the index of the token being sampled (0 = first token).
    """

    temperature: float
    top_p: float
    top_k: int
    seed: int
    step: int
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    banned: tuple[int, ...] = ()
    """Token ids that may not be picked at this step (EOS and stop ids before ``min_tokens``)."""
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    prompt_tokens: frozenset[int] = frozenset()
    """Penalties: the prompt's distinct tokens (only with a ``repetition_penalty``)."""
    output_counts: tuple[tuple[int, int], ...] = ()
    """Penalties: ``(token, count)`` of every token generated so far."""
    allowed: bytes | memoryview | None = None
    """Structured output: the tokens that may be picked at this step as a bitmask (bit ``t % 8`` of byte
    ``t // 8`` set = token ``t`` allowed; tokens past the mask's end are not allowed); None = every token. A
    bytes-like object, read-only by contract: the engine hands slices of one buffer (``memoryview``).
    Applied after ``logit_bias`` and ``banned``, before temperature and the filters (:func:`allowed_tokens`)."""
    top_logprobs: int = 0
    """How many most-likely alternatives (token, logprob) to return with this row's token (logprobs requested)."""

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def adjusts_logits(self) -> bool:
        """True when the logits change before sampling (``logit_bias``, ``banned``, ``allowed``): no raw-argmax
        shortcut."""
        return bool(self.logit_bias or self.banned) or self.allowed is not None or self.has_penalties

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def penalized_tokens(self) -> list[tuple[int, int]]:
        """``(token, count in the output)`` of every token a penalty touches (count 0: seen in the prompt only)."""
        counts = dict(self.output_counts)
        if self.repetition_penalty != 1.0:
            for token in self.prompt_tokens:
                counts.setdefault(token, 0)
        return sorted(counts.items())

    @classmethod
    def for_params(cls, params: SamplingParams, seed: int, step: int, eos_token_ids: Sequence[int] = (),
                   top_k: int | None = None, allowed: bytes | memoryview | None = None, prompt_tokens: frozenset[int] = frozenset(),
                   output_counts: tuple[tuple[int, int], ...] = (), banned: Sequence[int] = ()) -> RowSampling:
        """The row view of ``params`` for token ``step`` (bans EOS and stop ids while ``step < min_tokens``;
        ``allowed``: the structured-output mask of this step; ``prompt_tokens`` / ``output_counts``: what the
        penalties look at; ``banned``: more tokens that cannot be picked, e.g. bad words' last tokens)."""
        if step < params.min_tokens:
            bans = tuple(sorted({*banned, *params.stop_token_ids, *(() if params.ignore_eos else eos_token_ids)}))
        else:
            bans = tuple(sorted(set(banned))) if banned else ()
        return cls(params.temperature, params.top_p, params.top_k if top_k is None else top_k, seed, step,
                   params.min_p, params.logit_bias, bans, params.repetition_penalty,
                   params.presence_penalty, params.frequency_penalty, prompt_tokens, output_counts, allowed,
                   params.logprobs or 0)


def allowed_mask(token_ids: Collection[int], vocab_size: int) -> bytes:
    """The ``RowSampling.allowed`` bitmask (little-endian 32-bit words, as llguidance writes them) that allows
    exactly ``token_ids`` (each in ``[0, vocab_size)``)."""
    mask = bytearray((vocab_size + 31) // 32 * 4)
    for token_id in token_ids:
        mask[token_id >> 3] |= 1 << (token_id & 7)
    return bytes(mask)


@functools.lru_cache(maxsize=4)
def all_tokens_mask(vocab_size: int) -> bytes:
    """:func:`allowed_mask` of every token id in ``[0, vocab_size)`` (built at once, not id by id)."""
    return ((1 << vocab_size) - 1).to_bytes((vocab_size + 31) // 32 * 4, "little")


def mask_allows(mask: bytes | memoryview, token_id: int) -> bool:
    """Whether the ``RowSampling.allowed`` bitmask allows ``token_id`` (tokens past its end are not allowed)."""
    return 0 <= token_id < 8 * len(mask) and bool(mask[token_id >> 3] >> (token_id & 7) & 1)


def allowed_tokens(mask: bytes | memoryview, vocab_size: int) -> list[bool]:
    """The ``RowSampling.allowed`` bitmask as one flag per token id in ``[0, vocab_size)`` (reference unpacking)."""
    return [t < 8 * len(mask) and bool(mask[t >> 3] >> (t & 7) & 1) for t in range(vocab_size)]  # mask_allows, inline

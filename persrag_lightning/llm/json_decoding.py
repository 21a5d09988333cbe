"""Constrained JSON decoding for the transformers backend: a `prefix_allowed_tokens_fn` that lets
through only tokens continuing JSON valid under a schema (lm-format-enforcer, the `constrained`
extra)."""

from __future__ import annotations

from typing import Any

import torch

from persrag_lightning.llm.base import LLMBackendError

__all__ = ["json_prefix_function"]

# lm-format-enforcer's token table per (tokenizer, EOS ids): built once, it decodes the whole vocabulary
_TOKENIZER_DATA: dict[tuple[int, tuple[int, ...]], Any] = {}


def _enforcer_tokenizer_data(tokenizer: Any, eos_ids: list[int]) -> Any:
    """lm-format-enforcer's token table of a tokenizer (what its transformers integration builds;
    that module imports names transformers 5 no longer has, so the table is built here with the
    library's own classes): every non-special token's text, decoded after a digit so a word-initial
    space is kept."""
    from lmformatenforcer.tokenenforcer import TokenEnforcerTokenizerData

    vocab_size = len(tokenizer)
    specials = set(tokenizer.all_special_ids)
    zero = tokenizer.encode("0", add_special_tokens=False)[-1]
    regular = []
    for i in range(vocab_size):
        if i in specials:
            continue
        after_zero = tokenizer.decode([zero, i])[1:]
        regular.append((i, after_zero, len(after_zero) > len(tokenizer.decode([i]))))

    def decode(tokens: list[int]) -> str:
        return tokenizer.decode(tokens).rstrip("\ufffd")

    return TokenEnforcerTokenizerData(regular, decode, list(eos_ids), False, vocab_size)


def json_prefix_function(tokenizer: Any, schema: dict, eos_ids: list[int]) -> Any:
    """transformers' `prefix_allowed_tokens_fn` that lets through only tokens that continue JSON
    valid under `schema` (lm-format-enforcer's JsonSchemaParser and TokenEnforcer); the token table
    is built once per tokenizer.

    Args:
        tokenizer: the backend's tokenizer.
        schema: the JSON schema the answer must match.
        eos_ids: the end-of-turn ids that may end the answer.
    """
    try:
        from lmformatenforcer import JsonSchemaParser, TokenEnforcer
    except ImportError as err:
        raise LLMBackendError("constrained JSON decoding with the hf backend needs lm-format-enforcer: "
                              "`pip install lm-format-enforcer`") from err
    key = (id(tokenizer), tuple(eos_ids))
    if key not in _TOKENIZER_DATA:
        _TOKENIZER_DATA[key] = _enforcer_tokenizer_data(tokenizer, eos_ids)
    enforcer = TokenEnforcer(_TOKENIZER_DATA[key], JsonSchemaParser(schema))

    def allowed(batch_id: int, sent: torch.Tensor) -> list[int]:
        return enforcer.get_allowed_tokens(sent.tolist()).allowed_tokens

    return allowed

"""Prompt tokenization at the gateway with the HF `tokenizers` library (no torch, no vLLM).

The same tokenizer.json vLLM loads, so text prompts become the same ids vLLM would make.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from tokenizers import Tokenizer

from pdmesh.errors import InvalidRequest


class PromptTokenizer:
    def __init__(self, model_dir: str | Path) -> None:
        self._tokenizer = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
        # No token stands for more characters than its vocabulary string has (a byte-level token's string
        # has one character per byte), so a text longer than n × this needs more than n tokens.
        self.longest_token_chars = max(len(token) for token in self._tokenizer.get_vocab(with_added_tokens=True))

    async def encode_async(self, text: str, max_model_len: int, add_special_tokens: bool = True) -> list[int]:
        """encode() off the event loop, after refusing at once a text no prompt of the context can hold
        (a 10 MB prompt would take the tokenizer seconds, and stall every stream meanwhile)."""
        if len(text) > max_model_len * self.longest_token_chars:
            raise InvalidRequest(f"prompt of {len(text)} characters is longer than the model's context of "
                                 f"{max_model_len} tokens can hold")
        return await asyncio.to_thread(self.encode, text, add_special_tokens)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Ids of `text`; chat prompts, whose template writes the special tokens itself, pass False."""
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids)

"""Prompt tokenization at the gateway with the HF `tokenizers` library (no torch, no vLLM).

The same tokenizer.json vLLM loads, so text prompts become the same ids vLLM would make.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer


class PromptTokenizer:
    def __init__(self, model_dir: str | Path) -> None:
        self._tokenizer = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Ids of `text`; chat prompts, whose template writes the special tokens itself, pass False."""
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids)

"""Builds tiny random-weight models and a locally trained tokenizer (no hub access).

The models are real architectures (Llama; DeepSeek-V2-style MoE/MLA where supported)
with random weights drawn from a fixed seed, so every machine builds identical files.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

TOKENIZER_VOCAB_SIZE = 1024
MODEL_VOCAB_SIZE = 1024
CORPUS_SEED = 1234
WEIGHT_SEED = 0

_SYLLABLES = [
    "ka", "lo", "mi", "ne", "ru", "ta", "po", "si", "de", "fa", "gu", "hi", "jo", "be",
    "an", "or", "el", "is", "um", "ex", "qu", "zo", "wy", "vi", "ch", "st", "th", "ng",
]


def _corpus_lines(num_lines: int = 4000) -> list[str]:
    rng = random.Random(CORPUS_SEED)
    words = ["".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4))) for _ in range(600)]
    words += ["the", "a", "of", "and", "to", "in", "is", "that", "it", "for", "hello", "world"]
    lines = []
    for _ in range(num_lines):
        sentence = " ".join(rng.choice(words) for _ in range(rng.randint(4, 20)))
        lines.append(sentence.capitalize() + rng.choice([".", "!", "?", ","]))
    return lines


def build_tokenizer(out_dir: Path) -> None:
    """Trains a byte-level BPE tokenizer with BOS/EOS and writes HF tokenizer files."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        special_tokens=["<s>", "</s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus_lines(), trainer=trainer)
    bos_id = tokenizer.token_to_id("<s>")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos_id)]
    )
    tokenizer.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "add_bos_token": True,
        "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
        "chat_template": (
            "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}"
        ),
    }, indent=2))
    (out_dir / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}, indent=2))


def llama_config() -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "vocab_size": MODEL_VOCAB_SIZE,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        # Wider than the HF default (0.02) so greedy argmax gaps stay far above fp32 noise.
        "initializer_range": 0.1,
    }


def build_llama(out_dir: Path) -> Path:
    """Writes config.json, model.safetensors and tokenizer files; returns out_dir."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(WEIGHT_SEED)
    config = LlamaConfig(**llama_config())
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(out_dir, safe_serialization=True)
    (out_dir / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 0, "eos_token_id": 1, "do_sample": False}, indent=2))
    build_tokenizer(out_dir)
    return out_dir


def ensure_llama(out_dir: Path) -> Path:
    """Builds the tiny Llama once; later calls reuse the folder."""
    if not (out_dir / "model.safetensors").exists() or not (out_dir / "tokenizer.json").exists():
        build_llama(out_dir)
    return out_dir

"""Builds tiny random-weight models and a locally trained tokenizer (no hub access).

The models are real architectures (Llama; DeepSeek-V2-style MoE/MLA where supported)
with random weights drawn from a fixed seed, so every machine builds identical files.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

# Bump when anything below changes what gets written: cached folders are rebuilt.
BUILD_VERSION = 1
BUILD_STAMP = "pdmesh_build.json"
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


# Shared by both tiny architectures.
_COMMON_CONFIG = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "rope_theta": 10000.0,
    "vocab_size": MODEL_VOCAB_SIZE,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    # Wider than the HF default (0.02) so greedy argmax gaps stay far above fp32 noise.
    "initializer_range": 0.1,
}


def llama_config() -> dict:
    return {
        **_COMMON_CONFIG,
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "rms_norm_eps": 1e-5,
    }


def llama_wide_config() -> dict:
    """For benchmarks where each layer's compute should be large next to its KV: twice the layers,
    twice the width and KV heads of the tiny Llama (16 KiB of KV per token instead of 4)."""
    return {**llama_config(), "hidden_size": 512, "intermediate_size": 1024, "num_hidden_layers": 8,
            "num_attention_heads": 8, "num_key_value_heads": 4}


def llama_mid_config() -> dict:
    """A compute-bound Llama (~104 M parameters: 12 layers x 768 hidden) for the serving benchmark:
    on a CPU core its long prefills take seconds, so a prefill's compute (not the engine's per-step
    overhead, as with the tiny models) is what stalls a colocated decode batch, as on an accelerator."""
    return {**llama_config(), "hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
            "num_attention_heads": 12, "num_key_value_heads": 4, "initializer_range": 0.02}


def deepseek_v2_config() -> dict:
    """DeepSeek-V2-Lite-shaped: MLA (kv_lora_rank 512 + rope 64 = 576 cached values per token and
    layer), one dense layer then MoE layers with shared + routed experts."""
    return {
        **_COMMON_CONFIG,
        "architectures": ["DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v2",
        "moe_intermediate_size": 128,
        "num_hidden_layers": 3,
        "first_k_dense_replace": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "moe_layer_freq": 1,
        "routed_scaling_factor": 1.0,
        "topk_method": "greedy",
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": False,
        "scoring_func": "softmax",
        "q_lora_rank": None,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 64,
        "qk_rope_head_dim": 64,
        "v_head_dim": 64,
        "head_dim": 64,
        "rms_norm_eps": 1e-6,
        "rope_scaling": None,
        "attention_bias": False,
    }


def _build(out_dir: Path, kind: str) -> Path:
    """Writes config.json, model.safetensors and tokenizer files; returns out_dir."""
    import torch
    import transformers

    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(WEIGHT_SEED)
    config_cls, model_cls, config = {
        "llama": ("LlamaConfig", "LlamaForCausalLM", llama_config()),
        "llama_wide": ("LlamaConfig", "LlamaForCausalLM", llama_wide_config()),
        "llama_mid": ("LlamaConfig", "LlamaForCausalLM", llama_mid_config()),
        "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", deepseek_v2_config()),
    }[kind]
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**config)).to(torch.float32)
    model.save_pretrained(out_dir, safe_serialization=True)
    (out_dir / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 0, "eos_token_id": 1, "do_sample": False}, indent=2))
    build_tokenizer(out_dir)
    (out_dir / BUILD_STAMP).write_text(json.dumps({"build_version": BUILD_VERSION, "kind": kind}))
    return out_dir


def build_llama(out_dir: Path) -> Path:
    return _build(out_dir, "llama")


def build_mid_llama(out_dir: Path) -> Path:
    return _build(out_dir, "llama_mid")


def build_deepseek_v2(out_dir: Path) -> Path:
    return _build(out_dir, "deepseek_v2")


def _ensure(out_dir: Path, kind: str) -> Path:
    """Builds once; later calls reuse the folder unless the builder changed."""
    stamp = out_dir / BUILD_STAMP
    current = stamp.exists() and json.loads(stamp.read_text()) == {"build_version": BUILD_VERSION, "kind": kind}
    return out_dir if current else _build(out_dir, kind)


def ensure_llama(out_dir: Path) -> Path:
    return _ensure(out_dir, "llama")


def ensure_llama_wide(out_dir: Path) -> Path:
    return _ensure(out_dir, "llama_wide")


def ensure_mid_llama(out_dir: Path) -> Path:
    return _ensure(out_dir, "llama_mid")


def ensure_deepseek_v2(out_dir: Path) -> Path:
    return _ensure(out_dir, "deepseek_v2")

"""The tiny default model: a Llama-architecture causal LM and a byte-level BPE tokenizer, built here.

Nothing is downloaded. The tokenizer is trained with ``tokenizers`` on the built-in synthetic code
corpus; digits are split one per token (merged numbers would make arithmetic patterns much harder for
a model this small). Both are saved with ``save_pretrained``, so transformers and vLLM load the
directory unchanged. The same seed gives byte-identical weights and tokenizer.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from policy.config import TinyModelSettings
from policy.loading import MODEL_BUILD_LOCK

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
SPECIAL_TOKENS = [PAD, BOS, EOS]


def train_tokenizer(texts: Iterable[str], vocab_size: int):
    """Byte-level BPE over the corpus, wrapped as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD,
        clean_up_tokenization_spaces=False, model_max_length=1 << 16,
    )


def build_tiny_model(out_dir: str | Path, cfg: TinyModelSettings | None = None) -> Path:
    """Write a freshly initialised tiny model + tokenizer to ``out_dir`` and return the path."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from offline_rl.tasks import corpus
    from policy.loading import quiet_transformers

    quiet_transformers()
    cfg = cfg or TinyModelSettings()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(corpus(cfg.corpus_examples, seed=cfg.seed), cfg.vocab_size)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )
    torch.manual_seed(cfg.seed)
    with MODEL_BUILD_LOCK:  # a concurrent from_pretrained would have the init functions patched out
        model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    (out / "rtrl_model.json").write_text(json.dumps({"built_by": "rtrl init-model", **cfg.model_dump()}, indent=2))
    return out


def parameter_count(model) -> int:
    return sum(p.numel() for p in model.parameters())

"""The tiny default model: a Llama-architecture causal LM and a byte-level BPE tokenizer, built here.

Nothing is downloaded. The tokenizer is trained with ``tokenizers`` on texts the caller passes (the
offline stage passes its synthetic code corpus: :func:`offline_rl.corpus.build_default_model`);
digits are split one per token (merged numbers would make arithmetic patterns much harder for
a model this small). Both are saved with ``save_pretrained``, so transformers and vLLM load the
directory unchanged. The same seed gives byte-identical weights and tokenizer.

With ``moe=True`` (``rtrl init-model --moe``) the model is a Qwen3-MoE instead: the same width,
depth, attention and tokenizer, every MLP a mixture of ``tiny.moe_experts`` experts of which each
token uses ``tiny.moe_top_k`` (softmax router, top-k weights renormalised), with the
load-balancing loss configured (``router_aux_loss_coef``; mid-training adds it). Heads are 32 wide
or wider (vLLM's CPU attention kernel refuses 16).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast, Qwen3MoeConfig

from policy.config import TinyModelSettings
from policy.loading import MODEL_BUILD_LOCK, quiet_transformers, save_policy

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
SPECIAL_TOKENS = [PAD, BOS, EOS]


def train_tokenizer(texts: Iterable[str], vocab_size: int):
    """Byte-level BPE over the corpus, wrapped as a transformers fast tokenizer."""

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


def _config(cfg: TinyModelSettings, tokenizer, moe: bool):
    common = dict(
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
    if not moe:
        return LlamaConfig(**common)
    if cfg.moe_top_k > cfg.moe_experts:
        raise ValueError(f"tiny.moe_top_k {cfg.moe_top_k} exceeds tiny.moe_experts {cfg.moe_experts}")
    head_dim = cfg.hidden_size // cfg.num_heads
    if head_dim < 32:
        raise ValueError(f"tiny.hidden_size / tiny.num_heads = {head_dim}: an MoE model needs heads of 32 or more "
                         "(vLLM's CPU attention kernel refuses smaller ones)")
    return Qwen3MoeConfig(**common, head_dim=head_dim, num_experts=cfg.moe_experts, num_experts_per_tok=cfg.moe_top_k,
                          moe_intermediate_size=cfg.moe_intermediate_size, norm_topk_prob=True,
                          router_aux_loss_coef=cfg.moe_aux_loss_coef)


def build_tiny_model(out_dir: str | Path, cfg: TinyModelSettings, texts: Iterable[str], *, moe: bool = False) -> Path:
    """Write a freshly initialised tiny model + a tokenizer trained on ``texts`` to ``out_dir``
    (``moe``: the mixture-of-experts variant, see the module docstring)."""

    quiet_transformers()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(texts, cfg.vocab_size)
    config = _config(cfg, tokenizer, moe)
    torch.manual_seed(cfg.seed)
    with MODEL_BUILD_LOCK:  # a concurrent from_pretrained would have the init functions patched out
        model = AutoModelForCausalLM.from_config(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    save_policy(model, tokenizer, out)
    (out / "rtrl_model.json").write_text(json.dumps({"built_by": "rtrl init-model", "moe": moe, **cfg.model_dump()},
                                                    indent=2))
    return out


def parameter_count(model) -> int:
    return sum(p.numel() for p in model.parameters())

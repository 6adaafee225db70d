"""More held-out Hugging Face families, built from configs (random init, no dropout, nothing downloaded).

The benchmarks' three main held-out models (GPT-2 with eager attention, Llama, BERT) are in
``benchmarks.models.hf_model``; these are the families a user is as likely to bring, each a
different take on the decoder block (grouped-query attention, parallel attention and MLP,
QK-norm, learned positions, GeGLU) or the encoder. They are sized by the same four numbers so
``vs_checkpoint`` can run any of them: ``python -m benchmarks.vs_checkpoint --model mistral``.
Dropout is off everywhere so that every strategy's gradients are comparable with eager's.
``MORE_FAMILIES``: fourteen more (mixtures of experts, ALiBi, a shared layer, pooling, ...), each with a
``dropout`` argument, which ``tests/test_more_families.py`` turns on.
"""

from __future__ import annotations

from typing import Any, Callable

from torch import nn


def _decoder(config_name: str, model_name: str, **extra: Any) -> Callable[..., nn.Module]:
    def build(layers: int, hidden: int, seq: int, vocab: int, heads: int) -> nn.Module:
        import transformers

        config = getattr(transformers, config_name)(
            vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
            intermediate_size=4 * hidden, max_position_embeddings=seq, bos_token_id=0, eos_token_id=1,
            pad_token_id=None, **extra)
        return getattr(transformers, model_name)(config)

    return build


def _gqa(heads: int) -> int:
    return max(heads // 2, 1)


def _opt(layers: int, hidden: int, seq: int, vocab: int, heads: int) -> nn.Module:
    import transformers

    config = transformers.OPTConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                                    num_attention_heads=heads, ffn_dim=4 * hidden, max_position_embeddings=seq,
                                    word_embed_proj_dim=hidden, dropout=0.0, attention_dropout=0.0,
                                    activation_dropout=0.0, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    return transformers.OPTForCausalLM(config)


def _falcon(layers: int, hidden: int, seq: int, vocab: int, heads: int) -> nn.Module:
    import transformers

    config = transformers.FalconConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                                       num_attention_heads=heads, hidden_dropout=0.0, attention_dropout=0.0,
                                       bos_token_id=0, eos_token_id=1)
    return transformers.FalconForCausalLM(config)


def _roberta(layers: int, hidden: int, seq: int, vocab: int, heads: int) -> nn.Module:
    import transformers

    config = transformers.RobertaConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                                        num_attention_heads=heads, intermediate_size=4 * hidden,
                                        max_position_embeddings=seq + 2, hidden_dropout_prob=0.0,
                                        attention_probs_dropout_prob=0.0, pad_token_id=1, bos_token_id=0,
                                        eos_token_id=2)
    return transformers.RobertaForMaskedLM(config)


def _gpt_neox(layers: int, hidden: int, seq: int, vocab: int, heads: int) -> nn.Module:
    import transformers

    config = transformers.GPTNeoXConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                                        num_attention_heads=heads, intermediate_size=4 * hidden,
                                        max_position_embeddings=seq, hidden_dropout=0.0, attention_dropout=0.0,
                                        bos_token_id=0, eos_token_id=1)
    return transformers.GPTNeoXForCausalLM(config)


def _with_gqa(config_name: str, model_name: str, **extra: Any) -> Callable[..., nn.Module]:
    def build(layers: int, hidden: int, seq: int, vocab: int, heads: int) -> nn.Module:
        return _decoder(config_name, model_name, num_key_value_heads=_gqa(heads), **extra)(
            layers, hidden, seq, vocab, heads)

    return build


# name -> builder(layers, hidden, seq, vocab, heads)
FAMILIES: dict[str, Callable[..., nn.Module]] = {
    "mistral": _with_gqa("MistralConfig", "MistralForCausalLM", sliding_window=None),
    "qwen2": _with_gqa("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": _with_gqa("Qwen3Config", "Qwen3ForCausalLM"),  # QK-norm
    "phi3": _with_gqa("Phi3Config", "Phi3ForCausalLM", resid_pdrop=0.0, embd_pdrop=0.0),
    "gemma": _with_gqa("GemmaConfig", "GemmaForCausalLM"),  # GeGLU, scaled embeddings
    "gpt_neox": _gpt_neox,  # parallel attention and MLP, partial rotary
    "opt": _opt,  # learned positions, ReLU MLP
    "falcon": _falcon,  # multi-query attention, parallel block
    "roberta": _roberta,  # encoder, masked LM
}


def family_model(name: str, layers: int, hidden: int, seq: int, vocab: int, heads: int = 4) -> nn.Module:
    """A randomly initialised model of family ``name`` (one of ``FAMILIES``), dropout off."""
    if name not in FAMILIES:
        raise ValueError(f"unknown Hugging Face family {name!r}; expected one of {', '.join(FAMILIES)}")
    return FAMILIES[name](layers, hidden, seq, vocab, heads)


# Nine more, probed on 2026-12-07 as a user would bring them (tests/test_more_families.py): mixture of
# experts, ALiBi, a shared layer, disentangled attention, logit softcapping, multi-query attention, a
# factorized embedding. Each takes ``dropout`` (0 by default, as above; the tests turn it on).


def _config(config_name: str, **fields: Any) -> Any:
    import transformers

    return getattr(transformers, config_name)(**fields)


def _mixtral(layers: int, hidden: int, seq: int, vocab: int, heads: int, dropout: float = 0.0) -> nn.Module:
    import transformers

    config = _config("MixtralConfig", vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                     num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=_gqa(heads),
                     max_position_embeddings=seq, num_local_experts=4, num_experts_per_tok=2,
                     attention_dropout=dropout, sliding_window=None, bos_token_id=0, eos_token_id=1, pad_token_id=None)
    return transformers.MixtralForCausalLM(config)


def _bloom(layers: int, hidden: int, seq: int, vocab: int, heads: int, dropout: float = 0.0) -> nn.Module:
    import transformers

    config = _config("BloomConfig", vocab_size=vocab, hidden_size=hidden, n_layer=layers, n_head=heads,
                     hidden_dropout=dropout, attention_dropout=dropout, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    return transformers.BloomForCausalLM(config)


def _gptj(layers: int, hidden: int, seq: int, vocab: int, heads: int, dropout: float = 0.0) -> nn.Module:
    import transformers

    config = _config("GPTJConfig", vocab_size=vocab, n_positions=seq, n_embd=hidden, n_layer=layers, n_head=heads,
                     rotary_dim=hidden // heads // 2, n_inner=2 * hidden, embd_pdrop=dropout, resid_pdrop=dropout,
                     attn_pdrop=dropout, bos_token_id=0, eos_token_id=1)
    return transformers.GPTJForCausalLM(config)


def _gpt_bigcode(layers: int, hidden: int, seq: int, vocab: int, heads: int, dropout: float = 0.0) -> nn.Module:
    import transformers

    config = _config("GPTBigCodeConfig", vocab_size=vocab, n_positions=seq, n_embd=hidden, n_layer=layers,
                     n_head=heads, multi_query=True, n_inner=2 * hidden, embd_pdrop=dropout, resid_pdrop=dropout,
                     attn_pdrop=dropout, bos_token_id=0, eos_token_id=1)
    return transformers.GPTBigCodeForCausalLM(config)


def _encoder(config_name: str, model_name: str, **extra: Any) -> Callable[..., nn.Module]:
    """A BERT-style masked LM whose config spells its sizes as BERT does."""

    def build(layers: int, hidden: int, seq: int, vocab: int, heads: int, dropout: float = 0.0) -> nn.Module:
        import transformers

        config = _config(config_name, vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                         num_attention_heads=heads, intermediate_size=2 * hidden, max_position_embeddings=seq,
                         hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout, pad_token_id=0, **extra)
        return getattr(transformers, model_name)(config)

    return build


def _distilbert(layers: int, hidden: int, seq: int, vocab: int, heads: int, dropout: float = 0.0) -> nn.Module:
    import transformers

    config = _config("DistilBertConfig", vocab_size=vocab, dim=hidden, n_layers=layers, n_heads=heads,
                     hidden_dim=2 * hidden, max_position_embeddings=seq, dropout=dropout, attention_dropout=dropout,
                     pad_token_id=0)
    return transformers.DistilBertForMaskedLM(config)


def _gemma2(layers: int, hidden: int, seq: int, vocab: int, heads: int, dropout: float = 0.0) -> nn.Module:
    import transformers

    config = _config("Gemma2Config", vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                     num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=_gqa(heads),
                     head_dim=hidden // heads, max_position_embeddings=seq, attention_dropout=dropout,
                     final_logit_softcapping=30.0, attn_logit_softcapping=50.0, sliding_window=max(seq // 2, 1),
                     query_pre_attn_scalar=hidden // heads, bos_token_id=0, eos_token_id=1, pad_token_id=None)
    config._attn_implementation = "eager"  # softcapping runs in the eager attention only
    return transformers.Gemma2ForCausalLM(config)


def _qwen2_moe(layers: int, hidden: int, seq: int, vocab: int, heads: int, dropout: float = 0.0) -> nn.Module:
    import transformers

    config = _config("Qwen2MoeConfig", vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                     num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=_gqa(heads),
                     max_position_embeddings=seq, moe_intermediate_size=hidden,
                     shared_expert_intermediate_size=2 * hidden, num_experts=4, num_experts_per_tok=2,
                     decoder_sparse_step=1, attention_dropout=dropout, use_sliding_window=False, bos_token_id=0,
                     eos_token_id=1, pad_token_id=None)
    return transformers.Qwen2MoeForCausalLM(config)


def _gpt_neo(layers: int, hidden: int, seq: int, vocab: int, heads: int, dropout: float = 0.0) -> nn.Module:
    import transformers

    config = _config("GPTNeoConfig", vocab_size=vocab, hidden_size=hidden, num_layers=layers, num_heads=heads,
                     intermediate_size=2 * hidden, attention_types=[[["global", "local"], max(layers // 2, 1)]],
                     window_size=max(seq // 2, 1), max_position_embeddings=seq, embed_dropout=dropout,
                     attention_dropout=dropout, resid_dropout=dropout, bos_token_id=0, eos_token_id=1)
    return transformers.GPTNeoForCausalLM(config)


def _olmo(layers: int, hidden: int, seq: int, vocab: int, heads: int, dropout: float = 0.0) -> nn.Module:
    import transformers

    config = _config("OlmoConfig", vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                     num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=_gqa(heads),
                     max_position_embeddings=seq, attention_dropout=dropout, clip_qkv=0.5, bos_token_id=0,
                     eos_token_id=1, pad_token_id=None)
    return transformers.OlmoForCausalLM(config)


def _olmo2(layers: int, hidden: int, seq: int, vocab: int, heads: int, dropout: float = 0.0) -> nn.Module:
    import transformers

    config = _config("Olmo2Config", vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                     num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=_gqa(heads),
                     max_position_embeddings=seq, attention_dropout=dropout, bos_token_id=0, eos_token_id=1,
                     pad_token_id=None)
    return transformers.Olmo2ForCausalLM(config)


def _funnel(layers: int, hidden: int, seq: int, vocab: int, heads: int, dropout: float = 0.0) -> nn.Module:
    import transformers

    config = _config("FunnelConfig", vocab_size=vocab, block_sizes=[1] * layers, block_repeats=None,
                     num_decoder_layers=1, d_model=hidden, n_head=heads, d_head=hidden // heads, d_inner=2 * hidden,
                     hidden_dropout=dropout, attention_dropout=dropout, activation_dropout=dropout,
                     max_position_embeddings=seq)
    return transformers.FunnelForMaskedLM(config)


# name -> builder(layers, hidden, seq, vocab, heads, dropout=0.0)
MORE_FAMILIES: dict[str, Callable[..., nn.Module]] = {
    "mixtral": _mixtral,  # mixture of experts: top-2 routing among 4
    "bloom": _bloom,  # ALiBi, no position embeddings
    "gptj": _gptj,  # parallel block, partial rotary
    "gpt_bigcode": _gpt_bigcode,  # multi-query attention
    "albert": _encoder("AlbertConfig", "AlbertForMaskedLM", embedding_size=16),  # one layer's weights shared
    "distilbert": _distilbert,
    "deberta_v2": _encoder("DebertaV2Config", "DebertaV2ForMaskedLM", relative_attention=True,
                           pos_att_type=["p2c", "c2p"], position_buckets=8, max_relative_positions=-1),
    "gemma2": _gemma2,  # attention and final logit softcapping, sliding window
    "electra": _encoder("ElectraConfig", "ElectraForMaskedLM", embedding_size=16),  # factorized embedding
    "qwen2_moe": _qwen2_moe,  # experts beside a gated shared expert
    "gpt_neo": _gpt_neo,  # global and local (windowed) attention alternating, head tied to the embedding
    "olmo": _olmo,  # queries, keys and values clipped
    "olmo2": _olmo2,  # norms after attention and MLP, queries and keys normalized whole
    "funnel": _funnel,  # the sequence pooled between blocks, upsampled by a decoder
}

"""More held-out Hugging Face families, built from configs (random init, no dropout, nothing downloaded).

The benchmarks' three main held-out models (GPT-2 with eager attention, Llama, BERT) are in
``benchmarks.models.hf_model``; these are the families a user is as likely to bring, each a
different take on the decoder block (grouped-query attention, parallel attention and MLP,
QK-norm, learned positions, GeGLU) or the encoder. They are sized by the same four numbers so
``vs_checkpoint`` can run any of them: ``python -m benchmarks.vs_checkpoint --model mistral``.
Dropout is off everywhere so that every strategy's gradients are comparable with eager's.
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

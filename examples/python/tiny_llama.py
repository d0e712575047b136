"""A small Llama-architecture model with random weights, and greedy generation with its KV cache.

Every process that calls :func:`build_model` with the same seed, dtype and device type gets the
same weights, so a prefill process and a decode process can share one model without a download.
"""

import inspect

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

LAYERS = 4
ATTENTION_HEADS = 8
KV_HEADS = 8
HEAD_DIM = 128
HIDDEN = ATTENTION_HEADS * HEAD_DIM
INTERMEDIATE = 2048
VOCAB = 4096

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def build_model(seed: int, dtype: torch.dtype, device: torch.device) -> LlamaForCausalLM:
    """A randomly initialised 4-layer Llama in eval mode on `device`, identical for equal seeds.

    The weights are drawn on the CPU in fp32 and then converted, so the seed alone fixes them,
    whatever device the model runs on.
    """
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=ATTENTION_HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    return model.to(dtype=dtype, device=device).eval()


def layer_kv(cache: DynamicCache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values `cache` holds for `layer`, each [1, kv_heads, tokens, head_dim].

    Recent transformers keep them in ``cache.layers``; older releases in
    ``cache.key_cache`` / ``cache.value_cache``.
    """
    if hasattr(cache, "layers"):
        return cache.layers[layer].keys, cache.layers[layer].values
    return cache.key_cache[layer], cache.value_cache[layer]


def cache_from_layers(layers: list[tuple[torch.Tensor, torch.Tensor]]) -> DynamicCache:
    """A cache holding the given (keys, values) per layer, through the public ``update`` call."""
    cache = DynamicCache()
    for layer, (keys, values) in enumerate(layers):
        cache.update(keys, values, layer)
    return cache


def cache_argument(model: LlamaForCausalLM, cache: DynamicCache) -> dict:
    """The keyword argument that hands `cache` to `model`'s forward.

    Recent transformers renamed forward's ``past_key_values`` to ``cache`` (the old name warns and
    is due to go); earlier releases know only ``past_key_values``. The model updates the cache
    in place either way, so callers keep using the object they passed.
    """
    if "cache" in inspect.signature(model.forward).parameters:
        return {"cache": cache}
    return {"past_key_values": cache}


@torch.inference_mode()
def prefill(model: LlamaForCausalLM, prompt: list[int]) -> tuple[DynamicCache, int]:
    """Runs `prompt` through `model`; its KV cache and the first greedily generated token."""
    device = next(model.parameters()).device
    input_ids = torch.tensor([prompt], device=device)
    cache = DynamicCache()
    out = model(input_ids=input_ids, use_cache=True, **cache_argument(model, cache))
    return cache, int(out.logits[0, -1].argmax())


@torch.inference_mode()
def decode(model: LlamaForCausalLM, cache: DynamicCache, first: int, new_tokens: int) -> list[int]:
    """Greedy generation after a prefill: `first` and then the next `new_tokens - 1` tokens.

    Each step feeds the last token alone, so `cache` must hold every earlier position.
    """
    device = next(model.parameters()).device
    tokens = [first]
    while len(tokens) < new_tokens:
        input_ids = torch.tensor([[tokens[-1]]], device=device)
        out = model(input_ids=input_ids, use_cache=True, **cache_argument(model, cache))
        tokens.append(int(out.logits[0, -1].argmax()))
    return tokens

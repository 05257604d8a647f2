"""transformers internals sekv relies on: fails loudly when an upgrade changes them."""

import torch
import transformers
from packaging.version import Version
from transformers import AttentionInterface, DynamicCache

from sekv_core.methods.full import truncate
from sekv_core.rope import Rope


def test_pinned_transformers_range():
    assert Version("5.20") <= Version(transformers.__version__) < Version("5.25")


def test_custom_attention_sees_layer_index_and_our_kwargs(tiny_loaded):
    model, seen = tiny_loaded.model, []

    def spy(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        seen.append((module.layer_idx, kwargs.get("sekv_probe"), query.shape, key.shape))
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout
        )

    AttentionInterface.register("sekv_spy", spy)
    previous = model.config._attn_implementation
    model.set_attn_implementation("sekv_spy")
    try:
        cache = DynamicCache(config=model.config)
        ids = torch.tensor([[5, 6, 7]])
        model(
            input_ids=ids, cache=cache, position_ids=torch.tensor([[40, 41, 42]]), sekv_probe="here"
        )
    finally:
        model.set_attn_implementation(previous)
    spec = tiny_loaded.spec
    assert [s[0] for s in seen] == list(range(spec.num_layers))
    assert all(s[1] == "here" for s in seen)
    _, _, q_shape, k_shape = seen[0]
    assert tuple(q_shape) == (1, spec.num_heads, 3, spec.head_dim)
    assert tuple(k_shape) == (1, spec.num_kv_heads, 3, spec.head_dim)


def test_cache_layout_crop_and_rope(tiny_loaded):
    model = tiny_loaded.model
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(input_ids=torch.arange(3, 13)[None], cache=cache)
    layer = cache.layers[0]
    assert layer.keys.shape[-2] == 10 and layer.values.shape == layer.keys.shape
    truncate(cache, 6)
    assert cache.get_seq_length() == 6 and cache.layers[-1].keys.shape[-2] == 6
    # the cache holds post-RoPE keys; un-rotating and re-rotating is the identity
    rope = Rope(model)
    pos = torch.arange(6)
    keys = cache.layers[0].keys[0]
    assert torch.allclose(rope.rotate(rope.unrotate(keys, pos), pos), keys, atol=1e-5)

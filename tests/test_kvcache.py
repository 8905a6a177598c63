"""Hybrid KV cache arithmetic from first principles (launcher/predict/memory/kvcache.py), each test
stating vLLM 0.32's rule and the numbers it gives. The engine proof is tests/test_hybrid_engine.py.
"""

from __future__ import annotations

import pytest
import tinyhybrid

from launcher.inputs.arch import layer_kinds
from launcher.inputs.hardware import parse_gpus
from launcher.inputs.model import spec_from_config
from launcher.predict.features.capabilities import version_traits
from launcher.predict.memory import budget as B
from launcher.predict.memory import kvcache as K
from launcher.predict.search.planner import Pins, make_plan


def test_uniform_model_is_one_group_and_matches_the_old_count():
    # Llama-3.1-8B: 32 layers x 8 KV heads x 128 x 2 (K,V) x 2 B = 4,096 B per layer and token.
    layers = [K.FullAttention(4096)] * 32
    pool = K.build_pool(layers, 16)
    assert len(pool.groups) == 1 and pool.bytes_per_block() == 32 * 16 * 4096
    d = K.Demand(max_len=8192, in_flight=2 * 8192)
    assert pool.blocks_per_request(d) == 8192 // 16
    cap = K.capacity(pool, 1000, d)
    assert cap.tokens == int(1000 / 512 * 8192) == 16000
    # the start-up check keeps the null block back: 513 blocks hold one 8,192-token request
    assert K.fits(pool, 513 * pool.bytes_per_block(), d)
    assert not K.fits(pool, 513 * pool.bytes_per_block() - 1, d)


def test_sliding_window_holds_the_window_plus_what_is_in_flight():
    # window 4096, 2 x 2048 tokens in flight: min(4095 + 4096, 32768) = 8191 tokens,
    # cdiv(8191, 16) + 1 = 513 blocks, whatever the request length beyond that.
    s = K.SlidingWindow(1024, window=4096)
    assert s.blocks(K.Demand(32768, 4096), 16) == 513
    assert s.blocks(K.Demand(1000, 4096), 16) == 63 + 1  # capped by max_len: cdiv(1000,16)+1


def test_gemma3_27b_groups_and_saves_over_full_attention():
    # 62 layers, one full every 6th: 10 full, 52 sliding (window 1024). Group size 10 (52 is
    # not under 1.5 x 10), the sliding bucket splits into cdiv(52, 10) = 6 groups (9,9,9,9,8,8);
    # a block is the widest group: 10 layers x page.
    per = 2 * 16 * 128 * 2  # 16 KV heads x 128 dim x K,V x bf16 = 8,192 B
    kinds = ["full" if (i + 1) % 6 == 0 else "sliding" for i in range(62)]
    layers = [K.FullAttention(per) if k == "full" else K.SlidingWindow(per, window=1024)
              for k in kinds]
    pool = K.build_pool(layers, 16)
    assert pool.kinds() == {"sliding": 52, "full": 10}
    assert sorted(len(g.members) for g in pool.groups) == [8, 8, 9, 9, 9, 9, 10]
    assert pool.bytes_per_block() == 10 * 16 * per
    # 131,072 tokens, 8,192 batched x 2 in flight: full 8,192 blocks; sliding
    # cdiv(min(1023 + 16384, 131072), 16) + 1 = 1,089 blocks in each of 6 groups.
    d = K.Demand(131072, 16384)
    assert pool.blocks_per_request(d) == 8192 + 6 * 1089
    # memory per request vs every layer full: 14,726 x 10 pages vs 8,192 x 62 pages = 3.45x
    saving = 8192 * 62 / (pool.blocks_per_request(d) * 10)
    assert saving == pytest.approx(3.449, abs=0.001)


def test_gated_deltanet_grows_the_attention_block_to_hold_the_state():
    # Qwen3-Next-80B on one GPU: attention 2 KV heads x 256 x 2 x 2 B = 2,048 B/token; a GDN
    # state is a conv of (2 x 16 x 128 + 32 x 128) = 8,192 channels x 3 taps x 2 B = 49,152 B
    # plus 32 heads x 128 x 128 x 2 B = 1,048,576 B: 1,097,728 B. The block must hold it:
    # 16 x cdiv(1,097,728, 16 x 2,048) = 544 tokens (vLLM logs "Setting attention block size
    # to 544 tokens"); the state page is padded to 544 x 2,048 B.
    state = B.state_bytes((16, 128, 32, 128, 4), 1, 2, 2)
    assert state == 49152 + 1048576
    assert K.align_state_block(16, state, 2048, 16) == 544
    layers = ([K.State(state)] * 3 + [K.FullAttention(2048)]) * 12
    pool = K.build_pool(layers, 16)
    assert pool.block == 544 and pool.page == 544 * 2048
    assert pool.kinds() == {"state": 36, "full": 12}
    assert len(pool.groups) == 4 and pool.bytes_per_block() == 12 * 544 * 2048
    # a 262,144-token request: cdiv(262144, 544) = 482 full blocks + 3 groups x 2 state pages
    assert pool.blocks_per_request(K.Demand(262144, 16384, state_pages=2)) == 482 + 6


def test_the_longest_fitting_length_is_vllms_boundary():
    # tiny-interleaved on 1 MiB: page 128 x 256 B = 32 KiB, one layer per group, 32 blocks.
    # Null block + five windowed layers x cdiv(min(127 + 256, L), 128) + 1 = 4 pages leave
    # 11 pages for the full layer: L = 1,408 fits, 1,409 does not.
    layers = [K.SlidingWindow(256, window=128)] * 5 + [K.FullAttention(256)]
    pool = K.build_pool(layers, 128)
    d = K.Demand(2048, 256)
    assert K.longest_fitting(pool, 1 << 20, d, 2048) == 1408
    assert K.fits(pool, 1 << 20, K.Demand(1408, 256))
    assert not K.fits(pool, 1 << 20, K.Demand(1409, 256))


def test_layer_kinds_read_each_config_style():
    assert layer_kinds({"model_type": "gemma2", "num_hidden_layers": 4}) == (
        "sliding", "full", "sliding", "full")
    assert layer_kinds({"model_type": "mistral", "num_hidden_layers": 2,
                        "sliding_window": 4096}) == ("sliding", "sliding")
    assert layer_kinds({"model_type": "mistral", "num_hidden_layers": 2,
                        "sliding_window": None}) == ("full", "full")
    assert layer_kinds({"model_type": "llama4_text", "num_hidden_layers": 4,
                        "attention_chunk_size": 8192}) == ("chunked",) * 3 + ("full",)
    assert layer_kinds({"model_type": "gpt_oss", "num_hidden_layers": 2,
                        "layer_types": ["sliding_attention", "full_attention"]}) == (
        "sliding", "full")


def _tiny(kind: str):
    return spec_from_config(tinyhybrid.config_dict(kind), f"tiny-{kind}")


def test_old_vllm_caches_windowed_layers_as_full():
    # Before the hybrid manager (0.9.2) a sliding layer next to a full one is cached in full
    # (unify_hybrid_kv_cache_specs); a model with only sliding layers keeps its window.
    spec = _tiny("interleaved")
    old = B.layer_caches(spec, "auto", 1, hybrid=version_traits("0.9.0").has("hybrid_kv_cache"))
    new = B.layer_caches(spec, "auto", 1, hybrid=version_traits("0.32.0").has("hybrid_kv_cache"))
    assert {x.kind for x in old} == {"full"}
    assert {x.kind for x in new} == {"sliding", "full"}
    only = B.layer_caches(_tiny("sliding"), "auto", 1, hybrid=False)
    assert {x.kind for x in only} == {"sliding"}


def test_llama4_chunked_layers_are_full_unless_the_env_allows_hybrid():
    # vLLM 0.32 disables the hybrid manager for chunked local attention by default.
    cfg = {"model_type": "llama", "hidden_size": 256, "num_hidden_layers": 4,
           "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512,
           "intermediate_size": 512, "max_position_embeddings": 4096,
           "layer_types": ["chunked_attention"] * 3 + ["full_attention"],
           "attention_chunk_size": 1024}
    spec = spec_from_config(cfg, "chunky")
    assert {x.kind for x in B.layer_caches(spec, "auto", 1)} == {"full"}
    allowed = B.layer_caches(spec, "auto", 1, chunked_hybrid=True)
    assert [x.kind for x in allowed] == ["chunked"] * 3 + ["full"]


def test_plan_reports_the_pool_of_a_hybrid_model():
    spec = _tiny("gdn")
    plan = make_plan(spec, parse_gpus("1xH100"), Pins(max_model_len=2048, kv_cache_dtype="auto"),
                     suggest=False)
    kv = plan.to_dict()["kv_cache"]
    assert kv["layer_kinds"] == {"state": 3, "full": 1}
    assert kv["groups"] == 4
    # The state, (2x2x32 + 4x32) channels x 3 taps x 2 B + 4 x 32 x 32 x 2 B = 9,728 B, needs
    # a 32-token block of 2 x 64 x 2 x 2 = 512 B tokens (16 x cdiv(9728, 16 x 512)).
    # One request: cdiv(2048, 32) = 64 full blocks + 3 groups x 2 state pages.
    assert kv["block_size"] == 32
    assert kv["blocks_per_request"] == 64 + 6
    assert plan.chosen.concurrency == pytest.approx(plan.chosen.blocks / 70)

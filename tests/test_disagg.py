"""Prefill/decode disaggregation (launcher/predict/speed/disagg.py): rate matching, hand-off, TTFT,
checked from the arithmetic and swept as properties."""

from __future__ import annotations

import dataclasses
import functools
import itertools

import pytest

from launcher.inputs.hardware import parse_gpus
from launcher.inputs.model import load_model
from launcher.inputs.workload import SLO, Workload
from launcher.predict.features.capabilities import version_traits
from launcher.predict.memory import budget as B
from launcher.predict.memory.candidate_memory import Pins, evaluate
from launcher.predict.speed import disagg as D
from launcher.predict.speed import request_model as perf

VERSION = "0.32.0"


@functools.cache
def shape(model: str, gpus: str, tp: int, dp: int = 1, ep: bool = False) -> perf.EngineShape:
    s, hw = load_model(model), parse_gpus(gpus)
    traits = version_traits(VERSION)
    layout = B.Layout(tp=tp, dp=dp, expert_parallel=ep)
    c = evaluate(s, hw, layout, "auto", traits.default_gpu_memory_utilization, traits,
                 Pins(max_model_len=32768, vllm_version=VERSION), chunked=True)
    assert c.fits
    return perf.engine_shape(s, hw, layout, c.kv_bytes_per_token, c.tokens, c.max_num_seqs,
                             c.max_num_batched_tokens, True)


def test_rate_matching_is_the_min_of_the_derated_pools():
    p = D.PrefillPool(requests_per_s=10.0, prompt_s=0.2, gpus=8)
    d = D.DecodePool(requests_per_s=4.0, running=64, tpot_ms=30.0, first_step_s=0.03, gpus=8)
    w = Workload(4000, 1000)
    x = D.Transfer(1e8, "rdma", 0.01, 5.0)
    sp = D.split(p, d, w, x, 1, 3)
    # min(1 x 10 x 0.9, 3 x 4 x 0.92) = min(9.0, 11.04) = 9.0: prefill binds
    assert sp.requests_per_s == pytest.approx(9.0)
    assert sp.bound == "prefill" and sp.gpus == 32
    assert sp.output_tokens_per_s == pytest.approx(9000.0)
    # TTFT: M/D/1 wait at rho = 9/10: 0.9 / (2 x 0.1) x 0.2 s = 0.9 s; + 0.2 + 0.01 + 0.03
    assert sp.ttft_ms == pytest.approx((0.9 + 0.2 + 0.01 + 0.03) * 1e3)
    assert sp.tpot_ms == 30.0  # decode alone sets TPOT


def test_best_split_is_the_most_per_gpu_within_the_slo():
    p = D.PrefillPool(requests_per_s=10.0, prompt_s=0.2, gpus=8)
    d = D.DecodePool(requests_per_s=4.0, running=64, tpot_ms=30.0, first_step_s=0.03, gpus=8)
    w, x = Workload(4000, 1000), D.Transfer(1e8, "rdma", 0.01, 5.0)
    best = D.best_split(p, d, w, SLO(ttft_ms=60_000, tpot_ms=50), x)
    for a, b in itertools.product(range(1, D.MAX_REPLICAS + 1), repeat=2):
        other = D.split(p, d, w, x, a, b)
        assert other.requests_per_s / other.gpus <= best.requests_per_s / best.gpus + 1e-12
    # A perfect match spends 8/9.0 GPU-s per request on prefill and 8/3.68 on decode: at most
    # 1 / (0.889 + 2.174) = 0.3265 rps per GPU. 9.0 : 3.68 = 1 : 2.446, so 5P12D
    # (min(45, 44.16) = 44.16 rps over 136 GPUs: 0.3247) beats 2P5D (18 over 56: 0.3214)
    bound = 1 / (8 / 9.0 + 8 / 3.68)
    assert best.requests_per_s / best.gpus <= bound
    assert (best.prefill_replicas, best.decode_replicas) == (5, 12)
    assert best.requests_per_s == pytest.approx(44.16)
    assert D.best_split(p, d, w, SLO(ttft_ms=100, tpot_ms=50), x) is None  # TTFT unreachable


def test_the_hand_off_moves_the_prompts_kv_over_the_path():
    s = shape("deepseek-r1", "8xH200", 8)
    w = Workload(8192, 512)
    inside, across = D.transfer(s, w, True, "NixlConnector"), D.transfer(s, w, False,
                                                                         "NixlConnector")
    per_gpu = s.kv_bytes_per_token * 8192
    assert inside.bytes_per_gpu == across.bytes_per_gpu == per_gpu
    k = s.constants
    assert inside.seconds == pytest.approx(per_gpu / (s.link_bw * k.link_eff) + k.nccl_us * 1e-6)
    assert across.seconds == pytest.approx(per_gpu / (s.net_bw * k.link_eff)
                                           + k.network_us * 1e-6)
    assert inside.path == "nvlink" and across.path == "rdma"
    assert across.seconds > inside.seconds  # a NIC is slower than NVLink
    assert across.handshake_s == D.NIXL_HANDSHAKE_S
    assert D.transfer(s, w, False, "ExampleConnector").handshake_s == 0.0


CASES = [("llama-3.1-70b", "8xH100", tp) for tp in (4, 8)] + \
        [("deepseek-r1", "8xH200", 8), ("llama-3.1-8b", "8xH100", 1), ("llama-3.1-8b", "8xH100", 2)]


@pytest.mark.parametrize(("model", "gpus", "tp"), CASES)
@pytest.mark.parametrize("prompt", [128, 1024, 8192, 32000])
def test_pools_obey_their_physics(model, gpus, tp, prompt):
    s = shape(model, gpus, tp)
    w = Workload(prompt, 256)
    p = D.prefill_pool(s, w)
    # prefilling alone is never slower than prefilling beside decodes
    assert p.prompt_s <= perf.prompt_s(s, prompt, 32, prompt)[0] + 1e-12
    assert p.requests_per_s > 0
    d = D.decode_pool(s, w, SLO(ttft_ms=10**9, tpot_ms=200))
    assert d is not None and d.tpot_ms <= 200
    assert d.running <= perf.running_limit(s, w)[0]
    longer = D.prefill_pool(s, dataclasses.replace(w, input_len=prompt * 2))
    assert longer.requests_per_s <= p.requests_per_s * 1.0001  # twice the prompt, no faster


@pytest.mark.parametrize(("model", "gpus", "tp"), CASES)
def test_a_tighter_tpot_never_buys_decode_rate(model, gpus, tp):
    s, w = shape(model, gpus, tp), Workload(2048, 512)
    rates = []
    for tpot in (300, 100, 50, 30, 20, 10):
        d = D.decode_pool(s, w, SLO(ttft_ms=10**9, tpot_ms=tpot))
        rates.append(0.0 if d is None else d.requests_per_s)
    assert rates == sorted(rates, reverse=True)

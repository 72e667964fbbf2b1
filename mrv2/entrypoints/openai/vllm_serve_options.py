"""Every option of `vllm serve` in vLLM 0.32.0 (its `--help=all`, by vLLM's option group), so
that `mrv2 serve` answers a vLLM option it does not implement by name ("a vLLM option mrv2 does
not implement") rather than with argparse's bare "unrecognized arguments", and a test can walk
the whole list: each option is either a flag of mrv2's parser (honoured, or refused with a
message naming it) or one of these refusals. Regenerate from a vLLM install when it moves."""

from __future__ import annotations

VLLM_VERSION = "0.32.0"

VLLM_SERVE_OPTIONS: dict[str, tuple[str, ...]] = {
    "options": (
        "--headless", "--api-server-count", "-asc", "--config", "--grpc", "--disable-log-stats",
        "--aggregate-engine-logging", "--fail-on-environ-validation",
        "--no-fail-on-environ-validation", "--shutdown-timeout", "--gdn-prefill-backend",
        "--kda-prefill-backend", "--kda-decode-backend", "--enable-log-requests",
        "--no-enable-log-requests"),
    "Frontend": (
        "--lora-modules", "--chat-template", "--chat-template-content-format",
        "--trust-request-chat-template", "--no-trust-request-chat-template",
        "--trust-request-mm-kwargs", "--no-trust-request-mm-kwargs",
        "--default-chat-template-kwargs", "--response-role", "--return-tokens-as-token-ids",
        "--no-return-tokens-as-token-ids", "--enable-auto-tool-choice",
        "--no-enable-auto-tool-choice", "--exclude-tools-when-tool-choice-none",
        "--no-exclude-tools-when-tool-choice-none", "--tool-call-parser", "--tool-parser-plugin",
        "--tool-strict-level", "--tool-server", "--max-log-len", "--enable-prompt-tokens-details",
        "--no-enable-prompt-tokens-details", "--enable-per-request-metrics",
        "--no-enable-per-request-metrics", "--enable-server-load-tracking",
        "--no-enable-server-load-tracking", "--enable-force-include-usage",
        "--no-enable-force-include-usage", "--sse-keep-alive-interval",
        "--enable-tokenizer-info-endpoint", "--no-enable-tokenizer-info-endpoint",
        "--enable-log-outputs", "--no-enable-log-outputs", "--enable-log-deltas",
        "--no-enable-log-deltas", "--cohere-is-reasoning-model", "--no-cohere-is-reasoning-model",
        "--cohere-format", "--anthropic-disabled-thinking-effort", "--log-error-stack",
        "--no-log-error-stack", "--tokens-only", "--no-tokens-only", "--enable-scale-out",
        "--no-enable-scale-out", "--fingerprint-mode", "--fingerprint-value", "--host", "--port",
        "--grpc-port", "--data-parallel-supervisor-port", "--dp-supervisor-probe-interval-s",
        "--dp-supervisor-probe-timeout-s", "--dp-supervisor-probe-failure-threshold", "--uds",
        "--uvicorn-log-level", "--disable-uvicorn-access-log", "--no-disable-uvicorn-access-log",
        "--disable-access-log-for-endpoints", "--allow-credentials", "--no-allow-credentials",
        "--allowed-origins", "--allowed-methods", "--allowed-headers", "--api-key", "--ssl-keyfile",
        "--ssl-certfile", "--ssl-ca-certs", "--enable-ssl-refresh", "--no-enable-ssl-refresh",
        "--ssl-cert-reqs", "--ssl-ciphers", "--root-path", "--middleware",
        "--enable-request-id-headers", "--no-enable-request-id-headers", "--disable-fastapi-docs",
        "--no-disable-fastapi-docs", "--h11-max-incomplete-event-size", "--h11-max-header-count",
        "--enable-offline-docs", "--no-enable-offline-docs", "--enable-flash-late-interaction",
        "--no-enable-flash-late-interaction"),
    "ModelConfig": (
        "--model", "--runner", "--convert", "--tokenizer", "--tokenizer-mode",
        "--trust-remote-code", "--no-trust-remote-code", "--dtype", "--seed", "--hf-config-path",
        "--allowed-local-media-path", "--allowed-media-domains", "--revision", "--code-revision",
        "--tokenizer-revision", "--max-model-len", "--quantization", "-q", "--quantization-config",
        "--allow-deprecated-quantization", "--no-allow-deprecated-quantization", "--enforce-eager",
        "--no-enforce-eager", "--enable-return-routed-experts", "--no-enable-return-routed-experts",
        "--return-sampling-mask", "--no-return-sampling-mask", "--max-logprobs", "--logprobs-mode",
        "--use-fp64-gumbel", "--no-use-fp64-gumbel", "--enable-trace-replay",
        "--no-enable-trace-replay", "--disable-sliding-window", "--no-disable-sliding-window",
        "--disable-cascade-attn", "--no-disable-cascade-attn", "--skip-tokenizer-init",
        "--no-skip-tokenizer-init", "--enable-prompt-embeds", "--no-enable-prompt-embeds",
        "--served-model-name", "--config-format", "--hf-token", "--hf-overrides",
        "--model-class-overrides", "--pooler-config", "--generation-config",
        "--override-generation-config", "--enable-sleep-mode", "--no-enable-sleep-mode",
        "--sleep-mode-offload-cudagraph", "--no-sleep-mode-offload-cudagraph",
        "--sleep-preserve-parameter-names", "--enable-cumem-allocator",
        "--no-enable-cumem-allocator", "--enable-nccl-comm-suspend",
        "--no-enable-nccl-comm-suspend", "--model-impl", "--logits-processors",
        "--io-processor-plugin", "--renderer-num-workers"),
    "LoadConfig": (
        "--load-format", "--download-dir", "--safetensors-load-strategy",
        "--safetensors-prefetch-num-threads", "--safetensors-prefetch-block-size",
        "--model-loader-extra-config", "--ignore-patterns", "--use-tqdm-on-load",
        "--no-use-tqdm-on-load", "--pt-load-map-location"),
    "AttentionConfig": (
        "--attention-backend",),
    "MambaConfig": (
        "--mamba-backend", "--mamba-ssu-algorithm", "--enable-mamba-cache-stochastic-rounding",
        "--no-enable-mamba-cache-stochastic-rounding", "--mamba-cache-philox-rounds"),
    "StructuredOutputsConfig": (
        "--reasoning-parser", "--reasoning-parser-plugin"),
    "ParallelConfig": (
        "--distributed-executor-backend", "--pipeline-parallel-size", "-pp", "--master-addr",
        "--master-port", "--nnodes", "-n", "--node-rank", "-r", "--distributed-timeout-seconds",
        "--cpu-distributed-timeout-seconds", "--numa-bind", "--no-numa-bind", "--numa-bind-nodes",
        "--numa-bind-cpus", "--device-ids", "--tensor-parallel-size", "-tp",
        "--decode-context-parallel-size", "-dcp", "--dcp-comm-backend", "--dcp-q-replicate",
        "--no-dcp-q-replicate", "--dcp-kv-cache-interleave-size", "--cp-kv-cache-interleave-size",
        "--prefill-context-parallel-size", "-pcp", "--data-parallel-size", "-dp",
        "--data-parallel-rank", "-dpn", "--data-parallel-start-rank", "-dpr",
        "--data-parallel-size-local", "-dpl", "--data-parallel-address", "-dpa",
        "--data-parallel-rpc-port", "-dpp", "--data-parallel-backend", "-dpb",
        "--data-parallel-hybrid-lb", "--no-data-parallel-hybrid-lb", "-dph",
        "--data-parallel-external-lb", "--no-data-parallel-external-lb", "-dpe",
        "--data-parallel-multi-port-external-lb", "-dpm", "--enable-hc-sp", "--no-enable-hc-sp",
        "--enable-expert-parallel", "--no-enable-expert-parallel", "-ep",
        "--enable-batch-sharded-sampling", "--no-enable-batch-sharded-sampling",
        "--enable-ep-weight-filter", "--no-enable-ep-weight-filter", "--all2all-backend",
        "--enable-dbo", "--no-enable-dbo", "--enable-shm-tensor-arena",
        "--no-enable-shm-tensor-arena", "--ubatch-size", "--enable-elastic-ep",
        "--no-enable-elastic-ep", "--elastic-ep-max-dp-size", "--dbo-decode-token-threshold",
        "--dp-sync-interval", "--dbo-prefill-token-threshold",
        "--disable-nccl-for-dp-synchronization", "--no-disable-nccl-for-dp-synchronization",
        "--enable-eplb", "--no-enable-eplb", "--eplb-config", "--expert-placement-strategy",
        "--max-parallel-loading-workers", "--ray-workers-use-nsight", "--no-ray-workers-use-nsight",
        "--disable-custom-all-reduce", "--no-disable-custom-all-reduce", "--worker-cls",
        "--worker-extension-cls", "--enable-fault-tolerance", "--no-enable-fault-tolerance",
        "--fault-tolerance-config"),
    "CacheConfig": (
        "--block-size", "--gpu-memory-utilization", "--device-memory-utilization",
        "--kv-cache-memory-bytes", "--kv-cache-dtype", "--num-gpu-blocks-override",
        "--enable-prefix-caching", "--no-enable-prefix-caching", "--prefix-caching-hash-algo",
        "--prefix-cache-retention-interval", "--kv-cache-dtype-skip-layers",
        "--kv-sharing-fast-prefill", "--no-kv-sharing-fast-prefill", "--swa-bounded-replay",
        "--no-swa-bounded-replay", "--mamba-cache-dtype", "--mamba-ssm-cache-dtype",
        "--mamba-block-size", "--prefix-match-unit", "--mamba-cache-mode",
        "--enable-mamba-shared-prefix-checkpoint", "--no-enable-mamba-shared-prefix-checkpoint",
        "--replayssm-buffer-len", "--use-replayssm", "--no-use-replayssm", "--kv-offloading-size",
        "--kv-offloading-backend"),
    "OffloadConfig": (
        "--offload-backend", "--cpu-offload-gb", "--cpu-offload-params", "--offload-group-size",
        "--offload-num-in-group", "--offload-prefetch-step", "--offload-params"),
    "MultiModalConfig": (
        "--language-model-only", "--no-language-model-only", "--limit-mm-per-prompt",
        "--enable-mm-embeds", "--no-enable-mm-embeds", "--media-io-kwargs", "--mm-processor-kwargs",
        "--mm-processor-cache-gb", "--mm-processor-cache-type", "--mm-hasher-algorithm",
        "--mm-shm-cache-max-object-size-mb", "--mm-encoder-only", "--no-mm-encoder-only",
        "--mm-encoder-tp-mode", "--mm-encoder-attn-backend", "--mm-encoder-attn-dtype",
        "--mm-encoder-fp8-scale-path", "--mm-encoder-fp8-scale-save-path",
        "--mm-encoder-fp8-scale-save-margin", "--interleave-mm-strings",
        "--no-interleave-mm-strings", "--skip-mm-profiling", "--no-skip-mm-profiling",
        "--video-pruning-rate", "--video-pruning-method", "--mm-tensor-ipc",
        "--mm-processor-device", "--mm-ipc-gpu-memory-gb", "--mm-device-do-normalize",
        "--no-mm-device-do-normalize"),
    "LoRAConfig": (
        "--enable-lora", "--no-enable-lora", "--max-loras", "--max-lora-rank", "--lora-dtype",
        "--enable-tower-connector-lora", "--no-enable-tower-connector-lora", "--max-cpu-loras",
        "--fully-sharded-loras", "--no-fully-sharded-loras", "--lora-target-modules",
        "--default-mm-loras", "--specialize-active-lora", "--no-specialize-active-lora",
        "--enable-mixed-moe-lora-format", "--no-enable-mixed-moe-lora-format",
        "--enable-moe-shared-loras", "--no-enable-moe-shared-loras", "--max-lora-cls-labels"),
    "LoggingConfig": (
        "--logging-config", "--log-level", "--log-config-file"),
    "ObservabilityConfig": (
        "--show-hidden-metrics-for-version", "--otlp-traces-endpoint", "--collect-detailed-traces",
        "--per-request-spec-decode-metrics", "--kv-cache-metrics", "--no-kv-cache-metrics",
        "--kv-cache-metrics-sample", "--custom-histogram-buckets", "--cudagraph-metrics",
        "--no-cudagraph-metrics", "--enable-layerwise-nvtx-tracing",
        "--no-enable-layerwise-nvtx-tracing", "--enable-mfu-metrics", "--no-enable-mfu-metrics",
        "--enable-logging-iteration-details", "--no-enable-logging-iteration-details",
        "--jit-monitor-mode", "--jit-monitor-verbose", "--no-jit-monitor-verbose"),
    "SchedulerConfig": (
        "--max-num-batched-tokens", "--max-num-scheduled-tokens", "--max-num-seqs",
        "--max-num-active-seqs", "--max-num-queued-reqs", "--max-num-queued-tokens",
        "--long-prefill-token-threshold", "--long-prefill-token-threshold-adaptive",
        "--no-long-prefill-token-threshold-adaptive", "--scheduling-policy",
        "--enable-chunked-prefill", "--no-enable-chunked-prefill", "--disable-chunked-mm-input",
        "--no-disable-chunked-mm-input", "--scheduler-cls", "--scheduler-reserve-full-isl",
        "--no-scheduler-reserve-full-isl", "--watermark", "--prefill-schedule-interval",
        "--disable-hybrid-kv-cache-manager", "--no-disable-hybrid-kv-cache-manager",
        "--async-scheduling", "--no-async-scheduling", "--stream-interval"),
    "CompilationConfig": (
        "--cudagraph-capture-sizes", "--max-cudagraph-capture-size"),
    "KernelConfig": (
        "--ir-op-priority", "--enable-flashinfer-autotune", "--no-enable-flashinfer-autotune",
        "--moe-backend", "--linear-backend", "--sparse-indexer-topk-backend"),
    "VllmConfig": (
        "--speculative-config", "-sc", "--spec-method", "--spec-model", "--spec-tokens",
        "--watermark-config", "--diffusion-config", "-dc", "--kv-transfer-config",
        "--kv-events-config", "--ec-transfer-config", "--ec-manager-config", "--compilation-config",
        "-cc", "--attention-config", "-ac", "--engram-config", "--reasoning-config",
        "--kernel-config", "--additional-config", "--structured-outputs-config",
        "--aux-output-config", "--profiler-config", "--optimization-level", "--performance-mode",
        "--weight-transfer-config"),
}

_GROUP_OF = {option: group for group, options in VLLM_SERVE_OPTIONS.items()
             for option in options}


def vllm_option_group(option: str) -> str | None:
    """The vLLM option group of `option` (`--name` or `--name=value`), or None when
    `vllm serve` has no such option."""
    return _GROUP_OF.get(option.split("=", 1)[0])


def refuse_unknown_arguments(extras: list[str]) -> str:
    """The parser's error for arguments it did not take: the `vllm serve` options among them
    named as not implemented by mrv2 (with their vLLM group), the rest as unrecognized. A
    value following a refused option is not reported on its own."""
    refused, unknown = [], []
    after_option = False
    for arg in extras:
        group = vllm_option_group(arg) if arg.startswith("-") else None
        if group is not None:
            refused.append(f"{arg.split('=', 1)[0]} ({group})")
        elif not (after_option and not arg.startswith("-")):
            unknown.append(arg)
        after_option = group is not None and "=" not in arg
    parts = []
    if refused:
        parts.append(f"vLLM {VLLM_VERSION} `vllm serve` options that mrv2 does not implement: "
                     f"{', '.join(refused)}; `mrv2 serve --help` lists the ones it does")
    if unknown:
        parts.append(f"unrecognized arguments: {' '.join(unknown)}")
    return "; ".join(parts)

"""The engine core: what runs in the engine-core process (or in the caller's, for the
in-process client). `EngineCore` (engine_core.py) steps the scheduler and the executor;
scheduler.py, kv_cache_manager.py, block_hash.py and request.py are its state; core_proc.py is
the process around it. Text (tokenizing, detokenizing, stop strings, logprob dicts) stays in
the front end, mrv2/engine/."""

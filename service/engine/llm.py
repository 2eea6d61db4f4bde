"""Offline, synchronous generation on the engine's core (no asyncio, no server).

    llm = LLM()              # the default model, as `conveyor serve` serves it (quantization auto)
    llm.generate_greedy([[1, 2, 3]], max_tokens=8)

The same EngineCore (scheduler, block pool, model runner) as the server, stepped
in a plain loop, as nano-vllm's `LLM` does. Used by scripts/device_check, the
benchmarks and tests that need no event loop. Token ids in, token ids out: stop
strings are the streaming front's (detokenizer); EOS, stop_token_ids and
max_tokens end a completion here too, and a stop token is not part of it.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from protocol import InvalidRequest, SamplingParams
from service.core.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from service.core.engine_core import EngineCore
from service.core.request import Request
from service.engine.admission import Admission
from service.worker.grammar_state import GrammarState
from service.engine.client import EngineRequest
from service.engine.sampling_defaults import load_sampling_defaults, log_sampling_defaults


class LLM:
    """Batch generation with continuous batching, synchronously.

    Args:
        model: model path (None: the embedded default); device, attention_backend, dtype,
            cpu_decode_kernel, quantization, batch_invariant as for `conveyor serve`;
            num_kv_blocks, max_num_seqs, max_num_batched_tokens, enable_prefix_caching: engine limits;
            kv_disk_path, kv_disk_size: the disk KV tier, as `--kv-disk-path` /
            `--kv-disk-size` (bytes): prefix blocks kept in files across runs;
            loaded: a checkpoint already in memory; config: a whole EngineConfig instead
            of the keyword settings; runner: a ready runner (tests: fakes).
    Raises OSError when the disk tier's directory cannot be used (the server logs that
    and serves without the tier; here nothing would say the tier is missing).
    Use `with LLM(...) as llm:` or call `close()` with a disk tier: it finishes the
    queued block writes.
    """

    def __init__(self, model: str | None = None, *, device: str = "cpu",
                 attention_backend: str = "auto", dtype: str = "float32",
                 cpu_decode_kernel: str = "auto", quantization: str | None = "auto",
                 batch_invariant: bool = False, num_kv_blocks: int | None = 1024,
                 max_num_seqs: int = 32,
                 max_num_batched_tokens: int = 512, enable_prefix_caching: bool = True,
                 kv_disk_path: str | None = None, kv_disk_size: int | None = None,
                 loaded: Any = None, config: EngineConfig | None = None,
                 runner: Any = None) -> None:
        self.config = config or EngineConfig(
            model=ModelConfig(model=model, device=device, attention_backend=attention_backend,
                              dtype=dtype, cpu_decode_kernel=cpu_decode_kernel,
                              quantization=quantization, batch_invariant=batch_invariant),
            cache=CacheConfig(num_kv_blocks=num_kv_blocks,
                              enable_prefix_caching=enable_prefix_caching,
                              kv_disk_path=kv_disk_path,
                              **({} if kv_disk_size is None else {"kv_disk_size": kv_disk_size})),
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs,
                                      max_num_batched_tokens=max_num_batched_tokens),
        )
        if runner is None:
            from service.worker.model_runner import ModelRunner

            runner = ModelRunner(self.config, loaded)
        self.runner = runner
        self.disk_tier: Any = None  # service.worker.kv_disk_tier.DiskTier
        if self.config.cache.kv_disk_path is not None:
            from service.worker.kv_disk_tier import open_disk_tier

            self.disk_tier = open_disk_tier(self.config, runner)
        self.core = EngineCore(self.config, runner, disk=self.disk_tier)
        self.sampling_defaults = load_sampling_defaults(
            self.config.model.generation_config, self.config.model.model,
            getattr(runner, "model_name", ""))
        log_sampling_defaults(self.sampling_defaults)
        # The Engine's own admission checks, the whole-KV-pool fit check included: a
        # request that could never fit the pool alone would wait forever in the scheduler.
        self._admission = Admission(
            runner.tokenizer, runner.vocab_size, runner.max_model_len,
            self.core.scheduler.pool.num_blocks, self.config.cache.block_size,
            self.sampling_defaults, eos_token_ids=runner.eos_token_ids, max_pending=1)
        self._next_id = 0

    @property
    def scheduler(self):
        return self.core.scheduler

    @property
    def tokenizer(self):
        """The model's transformers tokenizer (vLLM: `llm.get_tokenizer()`)."""
        return self.runner.tokenizer

    def generate(self, prompt_token_ids: Sequence[Sequence[int]],
                 params: SamplingParams | Mapping[str, Any]
                 | Sequence[SamplingParams | Mapping[str, Any]]) -> list[list[int]]:
        """Completion token ids of each prompt, in order (a stop token is not included).

        params: one SamplingParams (or mapping of its fields) for all, or one per prompt;
        checked as the wire checks them; unset sampling values take the model's generation
        config (`self.sampling_defaults`), as in the Engine.
        Admission is the Engine's (`service.engine.admission.Admission`): raises InvalidRequest
        (bad params or ids, an empty prompt) or ContextLengthExceeded (prompt + max_tokens
        over the context, or over the whole KV cache; logprobs asked for, which this
        method cannot return) before anything runs;
        RuntimeError if a request fails in a step (its reason).
        """
        if isinstance(params, (SamplingParams, Mapping)):
            plist = [params] * len(prompt_token_ids)
        else:
            plist = list(params)
            if len(plist) != len(prompt_token_ids):
                raise InvalidRequest(f"{len(plist)} params for {len(prompt_token_ids)} prompts",
                                     param="$.params")
        eos = self.runner.eos_token_ids
        reqs = []
        for i, (ids, p) in enumerate(zip(prompt_token_ids, plist)):
            ids, p, matcher, _ = self._admission.prepare_sync(EngineRequest(
                prompt_token_ids=ids, params=p, client_id=f"prompt {i}"))
            for name in ("logprobs", "prompt_logprobs"):
                if getattr(p, name) is not None:  # never asked for and silently dropped
                    raise InvalidRequest(f"LLM.generate returns token ids only; {name} are "
                                         f"served by Engine.generate", param=f"$.params.{name}")
            req = Request(f"llm-{self._next_id}", ids, p, eos)
            if matcher is not None:  # response_format / structured: masked sampling
                req.constraint = GrammarState(matcher, req.output_token_ids)
            reqs.append(req)
            self._next_id += 1
        for req in reqs:
            self.core.add_request(req)
        errors: dict[str, str] = {}
        core = self.core
        while core.has_unfinished():
            steps = core.num_steps
            for out in core.step():
                if out.finish_reason == "error":
                    errors[out.request_id] = out.error or "failed"
            if core.num_steps == steps:  # nothing could run: a disk load is in flight
                due = core.idle_until()
                if due is not None:
                    time.sleep(min(0.01, max(0.0, due - time.monotonic())))
        self.core.check_integrity()
        if errors:
            raise RuntimeError(f"{len(errors)} request(s) failed: {errors}")
        return [r.output_token_ids for r in reqs]

    def close(self) -> None:
        """Stop the tokenizing pool; finish the disk tier's queued writes and stop its
        threads (idempotent)."""
        self._admission.close()
        if self.disk_tier is not None:
            self.core.flush_disk_saves()
            self.disk_tier.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def generate_greedy(self, prompt_token_ids: Sequence[Sequence[int]],
                        max_tokens: int) -> list[list[int]]:
        """Greedy completions of exactly-given lengths or until EOS."""
        return self.generate(prompt_token_ids, SamplingParams(temperature=0.0,
                                                              max_tokens=max_tokens))

"""Offline, synchronous generation on the engine's core (no asyncio, no server).

    llm = LLM()                                   # the default model, fp32 on CPU
    llm.generate_greedy([[1, 2, 3]], max_tokens=8)

The same scheduler, block pool and model runner as the server, stepped in a plain
loop (schedule -> execute -> update), as nano-vllm's `LLMEngine.step` does. Used by
scripts/device_check and by tests that need no event loop. Stop strings are not
handled here (token ids only); EOS, stop_token_ids and max_tokens are.
"""

from __future__ import annotations

from collections.abc import Sequence

from protocol import SamplingParams
from service.block_pool import KVBlockPool
from service.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from service.loader import LoadedModel
from service.model_runner import ModelRunner
from service.request import Request
from service.scheduler import Scheduler


class LLM:
    """Batch generation with continuous batching, synchronously.

    Args:
        model: model path (None: the embedded default); device, attention_backend, dtype,
        cpu_decode_kernel, quantization (None, "int8", "int4"), batch_invariant as for
        `conveyor serve`; num_kv_blocks, max_num_seqs, max_num_batched_tokens: engine limits;
        loaded: a checkpoint already in memory.
    """

    def __init__(self, model: str | None = None, *, device: str = "cpu",
                 attention_backend: str = "auto", dtype: str = "float32",
                 cpu_decode_kernel: str = "auto", quantization: str | None = None,
                 batch_invariant: bool = False,
                 num_kv_blocks: int | None = 1024, max_num_seqs: int = 32,
                 max_num_batched_tokens: int = 512, loaded: LoadedModel | None = None) -> None:
        self.config = EngineConfig(
            model=ModelConfig(model=model, device=device, attention_backend=attention_backend,
                              dtype=dtype, cpu_decode_kernel=cpu_decode_kernel,
                              quantization=quantization, batch_invariant=batch_invariant),
            cache=CacheConfig(num_kv_blocks=num_kv_blocks),
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs,
                                      max_num_batched_tokens=max_num_batched_tokens),
        )
        self.runner = ModelRunner(self.config, loaded)
        pool = KVBlockPool(self.runner.num_blocks, self.config.cache.block_size,
                           self.config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(self.config.scheduler, pool, self.runner.max_model_len)
        self._next_id = 0

    def generate(self, prompt_token_ids: Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams]) -> list[list[int]]:
        """Completion token ids of each prompt, in order. Raises ValueError for an empty
        prompt or one that does not fit the context with its max_tokens."""
        plist = [params] * len(prompt_token_ids) if isinstance(params, SamplingParams) else params
        eos = self.runner.loaded.eos_token_ids
        reqs = []
        for ids, p in zip(prompt_token_ids, plist):
            if not ids or len(ids) + p.max_tokens > self.runner.max_model_len:
                raise ValueError(f"prompt of {len(ids)} tokens + max_tokens {p.max_tokens} "
                                 f"does not fit (max_model_len {self.runner.max_model_len})")
            req = Request(f"llm-{self._next_id}", list(ids), p, eos)
            self._next_id += 1
            self.scheduler.add_request(req)
            reqs.append(req)
        while self.scheduler.has_unfinished():
            self.step()
        self.scheduler.check_integrity()
        return [r.output_token_ids for r in reqs]

    def step(self) -> None:
        """One iteration: schedule, execute, append tokens, retire finished requests."""
        out = self.scheduler.schedule()
        sampled = self.runner.execute(out)
        for req in self.scheduler.update_from_output(out, sampled):
            reason = req.check_stop(self.runner.max_model_len)
            if reason is not None:
                self.scheduler.finish_request(req.request_id, reason)

    def generate_greedy(self, prompt_token_ids: Sequence[Sequence[int]],
                        max_tokens: int) -> list[list[int]]:
        """Greedy completions of exactly-given lengths or until EOS."""
        return self.generate(prompt_token_ids, SamplingParams(temperature=0.0,
                                                              max_tokens=max_tokens))

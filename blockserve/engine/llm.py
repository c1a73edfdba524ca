"""The offline API, with vLLM's names so users can switch with little change.

    llm = LLM(max_model_len=2048)
    outputs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))
    print(outputs[0].outputs[0].text)
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from tqdm import tqdm

from blockserve.engine.config import EngineConfig
from blockserve.engine.core import EngineCore
from blockserve.engine.llm_engine import LLMEngine
from blockserve.engine.outputs import RequestOutput
from blockserve.engine.template_kwargs import template_kwargs
from blockserve.models.loader import LoadedModel
from blockserve.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    def __init__(self, model: str | LoadedModel | None = None, **engine_args):
        """`model`: a Hugging Face directory, a .gguf file, None for the bundled SmolLM2, or an
        already loaded model (to build several engines on one set of weights). `engine_args` are
        EngineConfig fields: max_model_len, block_size, enable_prefix_caching, max_num_seqs,
        max_num_batched_tokens, kv_cache_memory, attention_backend, ..."""
        loaded = model if isinstance(model, LoadedModel) else None
        try:
            config = EngineConfig(model=loaded.source if loaded else model, **engine_args)
        except TypeError as e:
            raise TypeError(f"{e}; valid engine arguments are {sorted(EngineConfig.__dataclass_fields__)}") from None
        self.engine = LLMEngine(config, EngineCore(config, loaded))
        self._ids = itertools.count()

    def close(self) -> None:
        """Stop the engine's tensor-parallel ranks, if any, and its second prefix-cache tier's writer once
        the saves queued are written (idempotent); also on `with LLM(...)` exit."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order. Prompts are strings or token-id lists.

        If an engine step fails, raises StepFailed (the model's exception as its cause) with
        nothing of this call left queued; the next call is served if the engine is intact
        (`engine_intact`), else refused with EngineDead."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts; give one or one each")
        return self._run(prompts, params, use_tqdm)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate;
        `chat_template_kwargs` are the template's variables (e.g. {"enable_thinking": False})."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.apply_chat_template(c, add_generation_prompt, chat_template_kwargs) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            chat_template_kwargs: dict | None = None) -> list[int]:
        variables = template_kwargs(chat_template_kwargs)
        tokenizer = self.engine.tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template; use generate() with plain prompts")
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True,
                                            **variables)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def _run(self, prompts: list[Prompt], params: list[SamplingParams], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.engine
        ids = [f"offline-{next(self._ids)}" for _ in prompts]
        results: dict[str, RequestOutput] = {}
        try:
            for request_id, prompt, p in zip(ids, prompts, params):
                engine.add_request(request_id, prompt, p)
            with tqdm(total=len(ids), desc="generating", unit="req", disable=not use_tqdm or len(ids) < 2) as bar:
                while len(results) < len(ids):
                    for output in engine.step():
                        if output.finished:
                            results[output.request_id] = output
                            bar.update(1)
        except BaseException:  # a bad prompt, an interrupt: nothing of this call stays queued
            engine.abort_request(ids)
            raise
        while engine.has_unfinished_requests():  # hand the last finished ids to the worker
            engine.step()
        return [results[i] for i in ids]

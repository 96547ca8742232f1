"""The `static` rollout engine: a static KV cache and a compiled one-token step with the sampler inside it.

`model.generate` spends most of a decode step in Python: a growing cache, logits processors, and a device
sync per token to ask whether every row is done. This engine sets up one `StaticCache` per shape bucket
(rows and cache length rounded up, so steps of similar shape share it and its compiled graphs; every
bucket's keys and values are views of one arena, the size of the largest), runs the
prompt through it once (prefill, eager), then repeats one compiled function that feeds the last token,
samples the next (temperature, top-p, greedy at temperature 0) and writes token, log-prob and the
finished flags into buffers that live in the bucket. On CUDA it is compiled with mode "reduce-overhead", so a
step is one CUDA-graph replay and the host only asks whether all rows are done every few steps.

It samples with the policy's own parameters: nothing is copied, and an optimizer step that updates them in
place is seen by the next call (a CUDA graph reads the parameters where they live). The buckets, their
caches on the shared arena and their buffers are in `exgrpo_pl.engines.static_cache`.
"""

from __future__ import annotations

import inspect
from collections import OrderedDict
from collections.abc import Sequence

import torch
import transformers
from torch import Tensor

from exgrpo_pl.engines.base import Completions, SamplingConfig, generation_mode
from exgrpo_pl.engines.generation import position_ids_from_mask
from exgrpo_pl.engines.static_cache import Bucket, bucket_size, check_buckets, kv_numel, meta_cache, place

ATTENTION_BACKENDS = ("sdpa", "eager")
"""Attention implementations the engine accepts: those its tests compare token for token with `hf`."""

ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512)
"""Default row counts a batch is padded up to (steps of 1.5x keep the padding under a third)."""

LENGTH_BUCKETS = (32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192)
"""Default KV-cache lengths (prompt + budget rounded up, at most 1.5x): every decode step attends over the
whole cache, so its padding costs reads as well as memory."""


def _nucleus(logprobs: Tensor, top_p: Tensor) -> Tensor:
    """`[R, V]` log-probs with the tokens outside the top-p nucleus set to -inf (transformers' rule).

    Tokens are dropped, smallest first, while the mass of what is dropped stays <= 1 - top_p; the most
    likely token is always kept.
    """
    ascending, order = logprobs.sort(dim=-1)  # [R, V]
    dropped = ascending.exp().cumsum(-1) <= 1 - top_p  # [R, V]
    dropped[:, -1] = False
    return logprobs.masked_fill(dropped.scatter(-1, order, dropped), float("-inf"))


def _pick(logits: Tensor, state: Bucket, greedy: bool, nucleus: bool) -> None:
    """Choose each row's next token from `[R, V]` float32 logits and write it into the bucket's buffers.

    A row that already wrote an EOS gets the pad token and log-prob 0. The log-prob is that of the token
    under softmax(logits / temperature), before any top-p cut: the quantity the training forward
    (`completion_logps`) recomputes. Greedy decoding draws from a point mass: log-prob 0.
    """
    if greedy:
        token = logits.argmax(-1)  # [R]
        logp = torch.zeros_like(logits[:, 0])  # [R]
    else:
        scaled = logits / state.temperature  # [R, V]
        log_norm = scaled.logsumexp(-1, keepdim=True)  # [R, 1]
        candidates = _nucleus(scaled - log_norm, state.top_p) if nucleus else scaled
        # Gumbel-max: argmax(log p - log E) with E ~ Exp(1) is a draw from p, without a host sync (multinomial
        # is not capturable in a CUDA graph). E = -log U > 0 for U in [0, 1), so no NaN whatever is -inf.
        # Compiled, this is one pass over the logits (the noise is drawn in registers) plus the logsumexp.
        exponential = -torch.rand_like(scaled).log()  # [R, V]
        token = (candidates - exponential.log()).argmax(-1)  # [R]
        logp = (scaled.gather(-1, token[:, None]) - log_norm).squeeze(-1)  # [R]
    token = torch.where(state.finished, state.pad, token)
    logp = logp.masked_fill(state.finished, 0.0)
    state.tokens.index_copy_(1, state.step.view(1), token[:, None])
    state.logps.index_copy_(1, state.step.view(1), logp[:, None])
    state.finished.copy_(state.finished | (token[:, None] == state.eos).any(-1))
    state.last.copy_(token[:, None])
    state.step.add_(1)


def _decode_step(model, state: Bucket, greedy: bool, nucleus: bool) -> None:
    """Feed each row's last token through the static cache and pick the next one (what gets compiled)."""
    state.attention_mask.index_fill_(1, state.slot.view(1), True)  # the slot this step writes
    state.slot.add_(1)
    logits = model(
        input_ids=state.last,
        attention_mask=state.attention_mask,
        position_ids=state.position,
        cache=state.cache,
        use_cache=True,
    ).logits[:, -1]  # [R, V]
    state.position.add_(1)
    _pick(logits.float(), state, greedy, nucleus)


class StaticCacheEngine:
    """Rollouts from a static KV cache and a compiled decode step (see the module docstring).

    Memory: every bucket's KV cache is a view of one arena, the size of the largest bucket used so far; it
    stays allocated between calls (a CUDA graph records its address), and grows, freeing the old one, only
    when a larger shape comes. `warm_up` with the run's largest call sizes it once, before training.

    Args:
        model: the policy: a transformers causal LM whose cache can be a `StaticCache` (Llama, Qwen2, Mistral,
            ...), or a peft model around one; its attention is "sdpa" or "eager" (`ATTENTION_BACKENDS`).
        sharded: the parameters are sharded across ranks (ZeRO-3, FSDP); refused, use the `hf` engine.
        compile: compile the decode step with `torch.compile`. None: on CUDA only (on a CPU, compiling the
            step does not pay for itself: see benchmarks/generation.py).
        compile_mode: the `torch.compile` mode. None: "reduce-overhead" (CUDA graphs) on CUDA, the default
            mode elsewhere.
        row_buckets: batch sizes rows are padded up to (with copies of real prompts, whose completions are
            dropped); past the largest, a multiple of it.
        length_buckets: KV-cache lengths (prompt width + budget) rounded up the same way. Every decode step
            attends over the whole cache, so coarser buckets cost attention reads as well as memory; finer
            ones cost a compilation each.
        max_buckets: shapes whose buffers and compiled graphs are kept at once; the least recently used is
            dropped past this (its KV cache is a view of the shared arena and frees nothing).
        stop_check_interval: decode steps between two checks that every row has written an EOS. A check
            waits for the device (the host stops queueing steps), so it is not done every step; at most this
            many - 1 steps run after the last row finished, and are discarded.
    """

    def __init__(
        self,
        model,
        sharded: bool = False,
        *,
        compile: bool | None = None,
        compile_mode: str | None = None,
        row_buckets: tuple[int, ...] = ROW_BUCKETS,
        length_buckets: tuple[int, ...] = LENGTH_BUCKETS,
        max_buckets: int = 4,
        stop_check_interval: int = 16,
    ) -> None:
        if sharded:
            raise ValueError(
                "rollout_engine='static' runs on the policy's own unsharded parameters; under ZeRO-3/FSDP "
                "they are sharded, so use rollout_engine='hf' (it gathers them at every forward)"
            )
        if max_buckets < 1 or stop_check_interval < 1:
            raise ValueError(
                f"max_buckets={max_buckets}, stop_check_interval={stop_check_interval}: want >= 1"
            )
        self.row_buckets = check_buckets("row_buckets", row_buckets)
        self.length_buckets = check_buckets("length_buckets", length_buckets)
        self.model = model
        _check_policy(self._base_model())
        self.compile = compile
        self.compile_mode = compile_mode
        self.max_buckets = max_buckets
        self.stop_check_interval = stop_check_interval
        self.allocations = 0
        """Buckets set up so far (a repeat shape reuses its bucket and sets up nothing)."""
        self._buckets: OrderedDict[tuple, Bucket] = OrderedDict()
        self._arena: Tensor | None = None  # [K] flat: every bucket's keys and values are views of it
        self._compiled = {}

    def _base_model(self):
        return self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model

    @property
    def cache_bytes(self) -> int:
        """Bytes of KV cache held now: the arena, whatever the number of buckets."""
        return 0 if self._arena is None else self._arena.numel() * self._arena.element_size()

    def _step_function(self, device: torch.device):
        """The decode step for `device`: compiled (once per engine and mode) or eager."""
        compile = self.compile if self.compile is not None else device.type == "cuda"
        if not compile:
            return _decode_step
        base = self._base_model()
        if not getattr(base, "_can_compile_fullgraph", False):
            raise ValueError(
                f"rollout_engine='static' with compile: {type(base).__name__} does not declare full-graph "
                "compilation with a static cache; pass compile=False or use rollout_engine='hf'"
            )
        mode = self.compile_mode or ("reduce-overhead" if device.type == "cuda" else None)
        if mode not in self._compiled:
            self._compiled[mode] = torch.compile(_decode_step, mode=mode, fullgraph=True, dynamic=False)
        return self._compiled[mode]

    def _bucket(self, rows: int, length: int, device: torch.device, dtype: torch.dtype) -> Bucket:
        key = (rows, length, device, dtype)
        if key in self._buckets:
            self._buckets.move_to_end(key)
            return self._buckets[key]
        cache = meta_cache(self.model.config, rows, length, dtype)
        needed = kv_numel(cache)
        arena = self._arena
        if arena is None or arena.numel() < needed or arena.device != device or arena.dtype != dtype:
            self._buckets.clear()  # views of the arena being replaced
            self._arena = None  # freed before its successor is allocated
            self._arena = torch.zeros(needed, dtype=dtype, device=device)
        while len(self._buckets) >= self.max_buckets:
            self._buckets.popitem(last=False)
        place(cache, self._arena)
        self._buckets[key] = Bucket(cache, rows, length, device)
        self.allocations += 1
        return self._buckets[key]

    def generate(self, prompt_ids: Tensor, prompt_mask: Tensor, sampling: SamplingConfig) -> Completions:
        """Completions of `[N, P]` left-padded `prompt_ids` (`prompt_mask` bool), one per row."""
        with generation_mode(self.model):
            state = self._run(prompt_ids, prompt_mask, sampling, sampling.max_new_tokens)
            return self._completions(state, prompt_ids.shape[0])

    def warm_up(self, calls: Sequence[tuple[int, int, SamplingConfig]]) -> None:
        """Set up the bucket of each `(rows, prompt width, sampling)` call and compile its step variant.

        Each runs a prefill and three decode steps on dummy prompts (a CUDA graph is recorded on the second
        call of a compiled step and replayed from the third), largest KV cache first, so the arena is
        allocated once, at its final size.
        """
        parameter = next(self.model.parameters())

        def kv_size(call):
            rows, width, sampling = call
            return bucket_size(rows, self.row_buckets) * bucket_size(
                width + sampling.max_new_tokens, self.length_buckets
            )

        with generation_mode(self.model):
            for rows, width, sampling in sorted(calls, key=kv_size, reverse=True):
                ids = torch.full((rows, width), sampling.pad_token_id, device=parameter.device)
                mask = torch.ones_like(ids, dtype=torch.bool)
                self._run(ids, mask, sampling, steps=min(4, sampling.max_new_tokens))

    def _run(self, prompt_ids: Tensor, prompt_mask: Tensor, sampling: SamplingConfig, steps: int) -> Bucket:
        """Prefill and `steps` - 1 decode steps (fewer once every row is done) in the call's bucket."""
        parameter = next(self.model.parameters())
        device = parameter.device
        rows, width = prompt_ids.shape
        padded_rows = bucket_size(rows, self.row_buckets)
        state = self._bucket(
            padded_rows,
            bucket_size(width + sampling.max_new_tokens, self.length_buckets),
            device,
            parameter.dtype,
        )
        source = torch.arange(padded_rows, device=device) % rows  # padding rows copy real prompts
        prompt_ids = prompt_ids.to(device)[source]  # [R, P]
        prompt_mask = prompt_mask.to(device=device, dtype=torch.bool)[source]  # [R, P]
        state.load(prompt_mask, sampling)
        greedy, nucleus = sampling.temperature <= 0, sampling.top_p < 1
        step = self._step_function(device)
        cuda_graphs = step is not _decode_step and device.type == "cuda"

        logits = self.model(
            input_ids=prompt_ids,
            attention_mask=state.attention_mask,
            position_ids=position_ids_from_mask(prompt_mask),
            cache=state.cache,
            use_cache=True,
            logits_to_keep=1,
        ).logits[:, -1]  # [R, V]
        _pick(logits.float(), state, greedy, nucleus)
        # One graph per bucket and variant (greedy / sampled / nucleus): more than dynamo's default of 8 per
        # function before it gives up and runs the step eagerly.
        limit = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
        graphs_allowed = max(getattr(torch._dynamo.config, limit), 8 * self.max_buckets)
        with torch._dynamo.config.patch(**{limit: graphs_allowed}):
            for done in range(1, steps):
                if done % self.stop_check_interval == 0 and bool(state.finished.all()):
                    break
                if cuda_graphs:
                    torch.compiler.cudagraph_mark_step_begin()
                step(self.model, state, greedy, nucleus)
        return state

    @staticmethod
    def _completions(state: Bucket, rows: int) -> Completions:
        """The first `rows` rows, cut to the longest completion (as `generate` stops when all are done)."""
        tokens = state.tokens[:rows, : int(state.step)]  # [N, S]
        is_eos = (tokens[..., None] == state.eos).any(-1)  # [N, S]
        truncated = ~is_eos.any(1)  # [N]
        lengths = torch.where(truncated, tokens.shape[1], is_eos.int().argmax(1) + 1)  # [N]
        width = int(lengths.max())
        mask = torch.arange(width, device=tokens.device) < lengths[:, None]  # [N, C]
        return Completions(
            ids=tokens[:, :width].clone(),
            mask=mask,
            truncated=truncated,
            logps=state.logps[:rows, :width].clone(),
        )

    def weights_changed(self) -> None:
        """Nothing to do: every step reads the policy's parameters where the optimizer updates them."""


def _check_policy(base) -> None:
    """ValueError unless the engine can run `base`: a forward taking `cache=`, a tested attention backend."""
    if "cache" not in inspect.signature(base.forward).parameters:
        raise ValueError(
            f"rollout_engine='static' needs a forward that takes `cache=` (transformers 5); "
            f"{type(base).__name__}.forward under transformers {transformers.__version__} does not: "
            "use rollout_engine='hf'"
        )
    attention = getattr(base.config, "_attn_implementation", None)
    if attention not in ATTENTION_BACKENDS:
        raise ValueError(
            f"rollout_engine='static' runs with attn_implementation {' or '.join(ATTENTION_BACKENDS)} (the "
            f"backends its tests check token for token against 'hf'); the policy uses {attention!r}: set "
            "model.attn_implementation: sdpa, or use rollout_engine='hf'"
        )

"""The decode loop that owns the whole step, as gpt-fast, vLLM and SGLang do.

Prefill (``DecodeModel.prefill``: HF's forward, or the lab's compiled training decoder); the
first token sampled from its logits; then each step — the lab's forward, sampling, the EOS /
finished bookkeeping, the token written into the output — runs from device state alone
(tokens, positions, finished, the step counter), so on CUDA it is captured once as one CUDA
graph and replayed per token. The host looks at "all finished" only every ``check_every``
steps (one sync there, none inside a step).

``forced`` (B, max_new) replaces every sampled token (teacher forcing: two loops fed the same
tokens can be compared logit for logit); ``keep_logits`` returns each step's logits.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ws_lab import registry
from ws_lab.rollout.model import DecodeModel
from ws_lab.rollout.sampling import Sampling, sample


DECODE_RANGE = "ws_lab.rollout.decode"  # torch.profiler range around the timed steps


@dataclass
class Rollout:
    tokens: torch.Tensor  # (B, max_new) int64, EOS after a sequence finished
    steps: int  # decode steps timed (with a graph, the eager first step is not)
    prefill_s: float
    decode_s: float  # wall time of the timed steps (device-synchronized)
    logits: torch.Tensor | None = None  # (B, max_new, V) fp32 with keep_logits

    @property
    def ms_per_step(self) -> float:
        return 1e3 * self.decode_s / max(self.steps, 1)


class _State:
    """The step's device state; every tensor keeps its address, as graph replays need, and is
    refilled in place by ``reset`` for the next request of the same shape."""

    def __init__(self, prompts, max_new, eos_id, keep_logits, vocab, forced):
        batch, dev = prompts.shape[0], prompts.device
        self.eos_id = eos_id
        self.tokens = torch.zeros(batch, dtype=torch.long, device=dev)
        self.positions = torch.zeros(batch, dtype=torch.int32, device=dev)
        self.finished = torch.zeros(batch, dtype=torch.bool, device=dev)
        self.step = torch.zeros(1, dtype=torch.long, device=dev)  # column of the next token
        self.out = torch.empty(batch, max_new, dtype=torch.long, device=dev)
        self.logits = (torch.empty(batch, max_new, vocab, device=dev) if keep_logits else None)
        self.forced = (torch.empty(batch, max_new, dtype=torch.long, device=dev)
                       if forced is not None else None)
        # the top-k kernel's seed is this base plus the step counter: no seed launch in a step
        self.seed = torch.zeros(1, dtype=torch.long, device=dev)

    def reset(self, prompts, forced):
        """A fresh request: positions at the prompt's length, nothing finished, the output all
        EOS, ``forced``'s first max_new columns, a new seed base."""
        self.tokens.zero_()
        self.positions.fill_(prompts.shape[1])
        self.finished.zero_()
        self.step.zero_()
        self.out.fill_(self.eos_id)
        if self.logits is not None:
            self.logits.zero_()
        if forced is not None:
            self.forced.copy_(forced[:, :self.out.shape[1]])
        self.seed.copy_(torch.randint(0, 2**31 - 1, (1,), device=self.seed.device))


class _Run:
    """What ``generate`` keeps on the model per request shape: the state and, on CUDA, the
    captured step (None until the first call has run a step eagerly)."""

    def __init__(self, state):
        self.state, self.replay = state, None


def _record(state, logits, next_tokens, forced, eos_id, move):
    """Writes the step's token (forced, or sampled; EOS once finished) and advances the state
    (the positions too with ``move``): kernels/step/rollout_step.py's one launch where Triton runs,
    the same update in torch ops elsewhere."""
    if state.logits is not None:
        state.logits.index_copy_(1, state.step, logits[:, None].float())
    kernel = registry.decode("rollout_step")
    if kernel.supports(state.tokens):
        kernel.advance(next_tokens, forced, state.finished, state.tokens, state.positions,
                       state.out, state.step, eos_id, move)
        return
    if forced is not None:
        next_tokens = forced.index_select(1, state.step).squeeze(1)
    next_tokens = torch.where(state.finished, torch.full_like(next_tokens, eos_id), next_tokens)
    state.out.index_copy_(1, state.step, next_tokens[:, None])
    state.finished |= next_tokens == eos_id
    state.tokens.copy_(next_tokens)
    state.step += 1
    if move:
        state.positions += 1


@torch.no_grad()
def generate(model: DecodeModel, prompts: torch.Tensor, max_new: int, sampling: Sampling,
             eos_id: int, *, check_every: int = 16, graph: bool | None = None,
             forced: torch.Tensor | None = None, keep_logits: bool = False,
             progress=None) -> Rollout:
    """Generates up to ``max_new`` tokens after equal-length ``prompts`` (B, P). ``graph``:
    capture the step as a CUDA graph (default: on CUDA). The state and the captured step are
    kept on the model per request shape (max_new, sampling, EOS, keep_logits, forced or not):
    the first call captures, every later one replays, with prompts of any length up to the
    capacity. ``progress(n)`` is told of each step."""
    import time

    _check_request(model, prompts, max_new, forced)
    cuda = prompts.is_cuda
    graph = cuda if graph is None else graph
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    key = (max_new, sampling, eos_id, keep_logits, forced is not None, graph)
    if key not in model.decode_runs:
        model.decode_runs[key] = _Run(_State(prompts, max_new, eos_id, keep_logits,
                                             model.lm_head.shape[0], forced))
    run = model.decode_runs[key]
    state = run.state
    start = time.perf_counter()
    state.reset(prompts, forced)
    logits = model.prefill(prompts)
    _record(state, logits, sample(logits, sampling), state.forced, eos_id, move=False)
    sync()
    prefill_s = time.perf_counter() - start
    seed = (state.seed, state.step)

    def step():
        step_logits = model.step(state.tokens, state.positions)
        _record(state, step_logits, sample(step_logits, sampling, model.logit_chunk_max, seed),
                state.forced, eos_id, move=True)

    execute, done = run.replay or step, 0
    if max_new > 1 and graph and run.replay is None:
        step()  # the first call's first step runs eagerly (compiles, allocates), then capture
        done = 1
        run.replay = execute = _capture(step)
    sync()
    start, timed_from = time.perf_counter(), done
    with torch.profiler.record_function(DECODE_RANGE):  # the replays, for a profiler's window
        while done < max_new - 1:
            execute()
            done += 1
            if progress:
                progress(1)
            if done % check_every == 0 and bool(state.finished.all()):
                break
        sync()
    decode_s = time.perf_counter() - start
    # copies: the next request of this shape refills the state's buffers
    return Rollout(state.out.clone(), done - timed_from, prefill_s, decode_s,
                   None if state.logits is None else state.logits.clone())


def _check_request(model, prompts, max_new, forced):
    """``generate``'s boundary, before any launch: the prompt batch the model's caches were
    built for, token ids in the vocabulary, a positive ``max_new`` within the capacity, and a
    ``forced`` of (B, ≥ max_new) tokens."""
    if not isinstance(prompts, torch.Tensor) or prompts.dim() != 2 or prompts.dtype not in (
            torch.int32, torch.int64):
        raise ValueError(f"prompts must be a (B, P) int64 / int32 tensor, got "
                         f"{getattr(prompts, 'dtype', type(prompts).__name__)} "
                         f"{tuple(getattr(prompts, 'shape', ()))}")
    if prompts.shape[0] != model.batch or prompts.shape[1] == 0:
        raise ValueError(f"prompts must be (B={model.batch}, P ≥ 1) as the model's caches were "
                         f"built, got {tuple(prompts.shape)}")
    if prompts.device != model.device:
        raise ValueError(f"prompts are on {prompts.device}, the model on {model.device}")
    if isinstance(max_new, bool) or not isinstance(max_new, int) or max_new < 1:
        raise ValueError(f"max_new must be a positive int, got {max_new!r}")
    if prompts.shape[1] + max_new > model.capacity:
        raise ValueError(f"{prompts.shape[1]} prompt + {max_new} new tokens exceed the cache's "
                         f"{model.capacity} positions")
    vocab = model.lm_head.shape[0]
    if int(prompts.min()) < 0 or int(prompts.max()) >= vocab:
        raise ValueError(f"prompt token ids must lie in [0, {vocab}), got "
                         f"[{int(prompts.min())}, {int(prompts.max())}]")
    if forced is not None and (forced.dim() != 2 or forced.shape[0] != model.batch
                               or forced.shape[1] < max_new):
        raise ValueError(f"forced must be (B={model.batch}, ≥ max_new={max_new}) tokens, got "
                         f"{tuple(forced.shape)}")


def _capture(step):
    """The step as one CUDA graph; returns its replay."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay

"""The lab's decode forward for a Hugging Face ``Qwen2ForCausalLM``, over the model's own weights.

One step takes each sequence's last token and position (device tensors) and returns the next
logits: embedding, per layer (residual add + RMSNorm, one q|k|v GEMM, attention, o GEMM,
residual add + RMSNorm, one gate|up GEMM, SwiGLU, down GEMM), final norm, lm_head. Nothing in it
reads a value on the host, so the whole step captures as one CUDA graph.

GEMMs are ``"lab"`` (kernels/step/decode_layer.py's ``linear``: weight-streaming Triton GEMMs with
the bias and SwiGLU in their epilogues, the o and down projections split over K with the sum
taken by the next RMSNorm; five launches a layer where cuBLAS takes seven; the lm_head too)
or ``"torch"`` (cuBLAS through torch, the ablation).

Attention is ``"fused"`` (kernels/decode/fused_decode.py: RoPE, the cache write and attention over
[0, position] in one launch) or ``"sdpa"`` (HF's path: RoPE in torch, a scatter into the static
cache, SDPA over the whole cache under a mask). Both keep HF StaticCache's layout, per layer
(B, Hkv, Lmax, D), filled from the prefill that runs through the model's own forward.

On CUDA two side streams, forked and joined inside the step, ask the L2 ahead of time for what
HBM would otherwise serve on the critical path: the next GEMMs' weights (``PREFETCH``) and the
next layer's cached context. Both are hints: the logits are bitwise the same without them.
"""
from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F

from ws_lab import registry
from ws_lab.check import triton_supports
from ws_lab.rope import apply_rope
from ws_lab.rollout.weights import GEMM_WEIGHTS, gemm_params, qkv_biases, shared_weights

ATTENTION = ("fused", "sdpa")
GEMMS = ("lab", "torch")
PREFILLS = ("hf", "lab")
# After layer i's q|k|v GEMM, a side stream asks the L2 for the weights from (i, first) to
# (i + 1, last), so that the GEMMs that follow find them there (o, which gains least, left out).
PREFETCH = ("gate_up_w", "qkv_w")


class DecodeModel:
    def __init__(self, hf_model, batch: int, capacity: int, attention: str = "fused",
                 gemms: str = "lab", prefill: str = "hf"):
        for name, value, allowed in (("attention", attention, ATTENTION),
                                     ("gemms", gemms, GEMMS), ("prefill", prefill, PREFILLS)):
            if value not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
        for name, value in (("batch", batch), ("capacity", capacity)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        cfg = hf_model.config
        if capacity > cfg.max_position_embeddings:
            raise ValueError(f"capacity {capacity} exceeds the model's "
                             f"{cfg.max_position_embeddings} positions")
        self.batch = batch
        self.hf, self.attention, self.capacity = hf_model, attention, capacity
        self.prefill_with = prefill
        self.prefill_stack = None  # prefill="lab": the compiled training decoder, made once
        self.lab_gemms = gemms == "lab"
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.eps = cfg.rms_norm_eps
        self.ops = registry.decode("layer_ops")
        self.fused = registry.decode("fused") if attention == "fused" else None
        weight = next(hf_model.parameters())
        self.dtype, self.device = weight.dtype, weight.device
        inner = hf_model.model
        self.embed = inner.embed_tokens.weight
        self.norm = inner.norm.weight
        self.lm_head = hf_model.lm_head.weight
        self._pack()
        cuda = self.device.type == "cuda"
        self.side = torch.cuda.Stream(self.device) if cuda else None
        self.context_side = torch.cuda.Stream(self.device) if cuda else None
        self.prefetch_context = True  # the context hint above; False for its ablation
        shape = (len(self.layers), batch, self.kv_heads, capacity, self.head_dim)
        self.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.v_cache = torch.zeros_like(self.k_cache)
        positions = torch.arange(capacity, device=self.device)[None]
        cos, sin = inner.rotary_emb(self.k_cache[0, :1, 0], positions)  # HF's own tables
        self.cos, self.sin = cos[0].contiguous(), sin[0].contiguous()  # (Lmax, D)
        # generate()'s state and captured step per request shape (ws_lab/rollout/loop.py):
        # captured once, replayed by every later call
        self.decode_runs = {}

    def _pack(self):
        """One q|k|v and one gate|up weight per layer (two GEMMs where HF runs five), every
        layer's GEMM weights back to back in one buffer in the order they run, so that what a
        GEMM prefetches (``PREFETCH``) is one range, across a layer boundary too. The buffer
        holds the HF model's own weights (``shared_weights``): an optimizer step on the HF
        model is this model's too, with no copy and no re-capture."""
        flat, biases = shared_weights(self.hf)
        at, bias_at, self.layers, self.spans = 0, 0, [], []
        for layer in self.hf.model.layers:
            params = gemm_params(layer)
            w = dict(norm_in=layer.input_layernorm.weight,
                     norm_post=layer.post_attention_layernorm.weight)
            spans = {}
            for name in GEMM_WEIGHTS:
                rows = sum(p.shape[0] for p in params[name])
                size = rows * params[name][0].shape[1]
                spans[name] = (at, at + size)
                w[name] = flat[at:at + size].view(rows, -1)
                at += size
            size = sum(b.numel() for b in qkv_biases(layer))
            w["qkv_b"] = biases[bias_at:bias_at + size]
            bias_at += size
            self.layers.append(w)
            self.spans.append(spans)
        self.flat = flat
        self.set_prefetch(PREFETCH)

    def set_prefetch(self, span):
        """``span`` (first, last) or None: layer i prefetches ``flat`` from its ``first`` weight
        through layer i + 1's ``last`` (the last layer: through its own down projection)."""
        for i, w in enumerate(self.layers):
            if span is None:
                w["prefetch"] = None
                continue
            last = self.spans[i + 1][span[1]] if i + 1 < len(self.layers) else self.spans[i]["down_w"]
            w["prefetch"] = self.flat[self.spans[i][span[0]][0]:last[1]]

    @torch.no_grad()
    def prefill(self, prompts: torch.Tensor) -> torch.Tensor:
        """Runs the prompts (B, P) through the HF model (``prefill="hf"``) or the lab's training
        decoder under ``torch.compile`` (``"lab"``: one graph per prompt length, Inductor's
        fused norms, RoPE and SwiGLU; HF's eager prefill took 35–40 ms of the Dr. GRPO
        rollout's 0.227 s, notes/rollout.md "Session 44"), copies its K/V (already rotated)
        into the static caches, returns the last position's logits (B, V)."""
        if self.prefill_with == "lab":
            return self._lab_prefill(prompts)
        from transformers import DynamicCache

        cache = DynamicCache()
        # transformers renames past_key_values to cache (5.2x deprecates the old name)
        name = "cache" if "cache" in inspect.signature(self.hf.forward).parameters else "past_key_values"
        out = self.hf(prompts, use_cache=True, logits_to_keep=1, **{name: cache})
        length = prompts.shape[1]
        for i, layer in enumerate(cache.layers):
            self.k_cache[i, :, :, :length] = layer.keys
            self.v_cache[i, :, :, :length] = layer.values
        return out.logits[:, -1].float()

    def _lab_prefill(self, prompts: torch.Tensor) -> torch.Tensor:
        if self.prefill_stack is None:
            from ws_lab.rollout.train_stack import TrainingDecoder

            self.prefill_stack = torch.compile(TrainingDecoder(self.hf), dynamic=False)
        hidden, kv = self.prefill_stack(prompts, keep_kv=True)
        length = prompts.shape[1]
        for i, (k, v) in enumerate(kv):
            self.k_cache[i, :, :, :length] = k
            self.v_cache[i, :, :, :length] = v
        return F.linear(hidden[:, -1], self.lm_head).float()

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """tokens (B,) int64 at positions (B,) int32 -> logits (B, V) in the model's dtype (a
        float32 copy of B × 151936 logits is a 39 MB pass of its own); writes each layer's cache
        at the positions. Sets ``logit_chunk_max``: the top-k sampler's first pass over these
        logits when the lab's lm_head wrote it, else None."""
        batch = tokens.shape[0]
        q_size, kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        hidden = F.embedding(tokens, self.embed)
        residual = None
        rope = None if self.fused else self._sdpa_rope(positions)
        for i, w in enumerate(self.layers):
            if residual is None:
                residual = hidden
                normed = self.ops.add_rmsnorm(hidden, w["norm_in"], self.eps)
            else:
                normed = self.ops.add_rmsnorm(hidden, w["norm_in"], self.eps, residual)
            qkv = self._linear(normed, w["qkv_w"], w["qkv_b"])
            self._prefetch(w["prefetch"])
            q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
            q = q.reshape(batch, self.heads, self.head_dim)
            k = k.reshape(batch, self.kv_heads, self.head_dim)
            v = v.reshape(batch, self.kv_heads, self.head_dim)
            attn = self._attend(i, q, k, v, positions, rope)
            hidden = self._linear(attn.reshape(batch, q_size), w["o_w"], into_norm=True)
            normed = self.ops.add_rmsnorm(hidden, w["norm_post"], self.eps, residual)
            gate_up = self._linear(normed, w["gate_up_w"], glu=True)
            if i + 1 < len(self.layers):
                self._prefetch_context(i + 1, positions)
            hidden = self._linear(gate_up, w["down_w"], into_norm=True)
        normed = self.ops.add_rmsnorm(hidden, self.norm, self.eps, residual)
        self.logit_chunk_max = self._chunk_max_buffer(batch)
        if self.logit_chunk_max is not None:
            logits = self.ops.linear(normed, self.lm_head, chunk_max=self.logit_chunk_max)
        else:
            logits = self._linear(normed, self.lm_head)
        if self.side is not None and self.layers[0]["prefetch"] is not None:
            torch.cuda.current_stream().wait_stream(self.side)  # a captured fork must join
        if self.context_side is not None and self.prefetch_context and len(self.layers) > 1:
            torch.cuda.current_stream().wait_stream(self.context_side)
        return logits

    def _chunk_max_buffer(self, batch):
        """Where the lab's lm_head leaves the top-k sampler's first pass (the maximum of every
        CHUNK logits, kernels/step/sampling.py), or None: cuBLAS GEMMs, no Triton here, or a
        vocabulary that is not whole chunks of the lm_head's column slices."""
        sampler = registry.decode("sampling")
        vocab, hidden = self.lm_head.shape
        if not (self.lab_gemms and triton_supports(self.device)) or vocab % sampler.CHUNK:
            return None
        if self.ops.config_for(self.device, vocab, hidden).block_n % sampler.CHUNK:
            return None
        return torch.empty(batch, vocab // sampler.CHUNK, dtype=torch.float32, device=self.device)

    def _prefetch(self, weights):
        """Launches ``prefetch_l2(weights)`` on the side stream after what the current stream
        has queued, so it overlaps the step's latency-bound kernels instead of delaying them."""
        if weights is None or self.side is None:
            return
        self.side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.side):
            self.ops.prefetch_l2(weights)

    def _prefetch_context(self, layer, positions):
        """Launches ``prefetch_context_l2`` of ``layer``'s caches on the second side stream,
        once what the current stream has queued is done. Called after layer - 1's gate|up, it
        puts the context that ``layer``'s attention reads into L2 over down and q|k|v, when HBM
        carries only the weight prefetch; during the attention itself HBM is saturated
        (−29 to −33 µs a Qwen2.5-0.5B step at B 64, notes/rollout.md, Session 29)."""
        if self.context_side is None or not self.prefetch_context:
            return
        self.context_side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.context_side):
            self.ops.prefetch_context_l2(self.k_cache[layer], self.v_cache[layer], positions)

    def _linear(self, x, weight, bias=None, glu=False, into_norm=False):
        """x @ weight.T (+ bias; SwiGLU over [gate | up] with ``glu``). ``into_norm``: the
        result only feeds ``add_rmsnorm``, so the lab's GEMM may hand over split-K partials."""
        if self.lab_gemms:
            return self.ops.linear(x, weight, bias, glu=glu, split_ok=into_norm)
        y = x @ weight.t() if bias is None else torch.addmm(bias, x, weight.t())
        return self.ops.silu_mul(y) if glu else y

    def _attend(self, i, q, k, v, positions, rope):
        if self.fused:
            return self.fused.fused_decode_attention(q, k, v, self.k_cache[i], self.v_cache[i],
                                                     self.cos, self.sin, positions)
        cos, sin, rows, mask = rope
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        self.k_cache[i][rows, :, positions.long()] = k
        self.v_cache[i][rows, :, positions.long()] = v
        out = F.scaled_dot_product_attention(q[:, :, None], self.k_cache[i], self.v_cache[i],
                                             attn_mask=mask, enable_gqa=self.heads != self.kv_heads)
        return out[:, :, 0]

    def _sdpa_rope(self, positions):
        """What HF builds once per step and every layer shares: cos / sin at the positions, the
        batch rows, and the mask over the static cache (token t visible iff t ≤ position)."""
        pos = positions.long()
        mask = torch.arange(self.capacity, device=pos.device)[None, :] <= pos[:, None]
        rows = torch.arange(pos.shape[0], device=pos.device)
        return self.cos[pos][:, None], self.sin[pos][:, None], rows, mask[:, None, None]


"""What the Qwen3.5 dense, Qwen3-Next, Qwen3.5 MoE and Kimi Linear models share: the forward,
the cache, prefill, decoding and greedy generation, on their decoder layers."""

import os
from typing import Any, Generic, overload, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from .._custom_types import CuSeqlens
from .._options import engine_options, EngineOptions
from .._parallel import axis_size, ContextParallel
from .._precision import PrecisionName
from .._run import Memory
from .._shift import next_tokens
from .._validate import as_index, as_positive_index
from ..nn import FSDP
from ..nn._context import documents, layer_cp, local_positions
from ..nn._layer_stack import call_layer, check_fsdp_layers, check_remat, Remat, stack_layers
from ..nn._moe import check_token_mask, ExpertAxis, RouterStats
from ..nn._norm import RMSNorm, ZeroCenteredRMSNorm
from ..nn._schedule import KVSchedule
from ..nn._tokens import check_tokens
from ._cache import check_cache, concrete, Qwen3_5Cache, Qwen3_5Checkpoints, restore
from ._config import AbstractQwenTextConfig, KimiLinearConfig
from ._decoder_layer import KimiLinearDecoderLayer, Qwen3_5DecoderLayer
from ._layer_stack import run_layers
from ._mtp import Qwen3_5MTP
from ._weights import ExpertLayout, save


# The PRNG stream (`jax.random.fold_in` of the model's key) of the MTP head's parameters.
_MTP_STREAM = 0x4D5450

# The default room `prefill` leaves after the prompt for the tokens to decode.
DECODE_ROOM = 256


def init_model(
    model: "AbstractCausalLM[Any]",
    config: AbstractQwenTextConfig | KimiLinearConfig,
    *,
    chunk_size: int | None,
    block_size: int | None,
    memory: Memory | None = None,
    tile_size: int,
    precision: PrecisionName | None,
    options: EngineOptions | None = None,
    scan_layers: bool = False,
    key: PRNGKeyArray,
    dtype,
) -> None:
    """Set the fields of `model` (inside its `__init__`): random parameters for `config`
    (the same with and without `scan_layers`, which stacks them). The decoder layers and
    norms are the config's model's: Kimi Linear's for a `KimiLinearConfig`, else Qwen's."""
    options = engine_options(options, chunk_size, block_size, memory, precision)
    precision = options.precision
    kemb, khead, *keys = jr.split(key, config.num_hidden_layers + 2)
    model.embed = eqx.nn.Embedding(config.vocab_size, config.hidden_size, key=kemb, dtype=dtype)
    kimi = isinstance(config, KimiLinearConfig)
    layer_cls = KimiLinearDecoderLayer if kimi else Qwen3_5DecoderLayer
    norm_cls = RMSNorm if kimi else ZeroCenteredRMSNorm
    layers = tuple(
        layer_cls(
            config,  # pyright: ignore[reportArgumentType]
            kind,
            sparse=config.is_sparse(i),
            tile_size=tile_size,
            options=options,
            key=k,
            dtype=dtype,
        )
        for i, (kind, k) in enumerate(zip(config.layer_types, keys))
    )
    model.layers = stack_layers(layers, scan_layers)
    model.norm = norm_cls(config.hidden_size, eps=config.rms_norm_eps, dtype=dtype)
    model.lm_head = (
        None
        if config.tie_word_embeddings
        else eqx.nn.Linear(
            config.hidden_size, config.vocab_size, use_bias=False, key=khead, dtype=dtype
        )
    )
    model.mtp = (
        Qwen3_5MTP(
            config,  # pyright: ignore[reportArgumentType]
            tile_size=tile_size,
            options=options,
            # Its own stream, so the main parameters are those of a model without a head.
            key=jr.fold_in(key, _MTP_STREAM),
            dtype=dtype,
        )
        if config.mtp_num_hidden_layers
        else None
    )
    model.config = config
    model.precision = precision


_Config = TypeVar("_Config", bound=AbstractQwenTextConfig | KimiLinearConfig)


class AbstractCausalLM(eqx.Module, Generic[_Config]):
    """The causal language models (the Qwen3.5 family, Kimi Linear): an embedding, decoder
    layers (e.g. [`deltanet_cp.models.Qwen3_5DecoderLayer`][]), a final RMSNorm and the LM
    head. Each concrete model holds these fields and its `__init__` / `from_pretrained`."""

    embed: eqx.AbstractVar[eqx.nn.Embedding]
    # Each model's own layers and norm (`Any`: a field's type is invariant).
    layers: eqx.AbstractVar[Any]
    norm: eqx.AbstractVar[Any]
    lm_head: eqx.AbstractVar[eqx.nn.Linear | None]
    mtp: eqx.AbstractVar[Qwen3_5MTP | None]
    config: eqx.AbstractVar[_Config]
    precision: eqx.AbstractVar[PrecisionName | None]

    def save_pretrained(
        self,
        path: str | os.PathLike,
        *,
        dtype=None,
        experts: ExpertLayout | None = None,
        max_shard_size: int | str = "5GB",
    ) -> None:
        """Save the model as a Hugging Face checkpoint, which `from_pretrained` and
        transformers read: `config.json` and the weights in safetensors files.

        The tensors are named and shaped as transformers' own `save_pretrained` writes the
        text model (`model.layers.N...`, `lm_head.weight` unless the embedding is tied):
        the depthwise convolution as `(channels, 1, kernel)`, Qwen3-Next's Gated DeltaNet
        projections fused and grouped per key head (`in_proj_qkvz`, `in_proj_ba`), the
        stacked experts as the checkpoint stores them. Every conversion is a reshape,
        slice or concatenation: `from_pretrained` reads back bit-identical parameters.
        The files are as transformers splits them: one `model.safetensors`, or
        `model-0000i-of-0000n.safetensors` of at most `max_shard_size` each and
        `model.safetensors.index.json`.

        **Atomic.** Everything is written into a new folder beside `path`, each file
        flushed to disk, then renamed into place: a crash while writing leaves the old
        checkpoint at `path` as it was. Other files in an existing `path` (a tokenizer, a
        README) are kept.

        **Sharded parameters.** Parameters sharded over a mesh are gathered one tensor at
        a time (one tensor on the host at a time, written as it comes). With several
        processes, every process must call `save_pretrained` with the same arguments
        (the gathers are collectives: `jax.experimental.multihost_utils.process_allgather`
        of each parameter a process does not hold whole); process 0 writes the files and
        every process returns once they are in place. `path` must then be on a file
        system process 0 writes and the others read, if they are to load it.

        **Arguments:**

        - `path`: the checkpoint folder (created with its parents if absent).
        - `dtype`: the dtype to write every tensor in (e.g. `jnp.bfloat16`; the cast
            rounds to nearest even, as `astype` does); each parameter's own if `None`.
            `config.json`'s `dtype` says it (the embedding's dtype if `None`).
        - `experts`: a mixture-of-experts model's expert layout: `"fused"`
            (`mlp.experts.gate_up_proj` `(E, 2I, H)`, gate rows first, and
            `mlp.experts.down_proj` `(E, H, I)`: the parameters of transformers'
            Qwen3.5-MoE experts module, the released Qwen3.5-MoE checkpoints' layout, what
            transformers' `save_pretrained(..., save_original_format=False)` writes) or
            `"per_expert"` (`mlp.experts.{j}.gate_proj.weight`, `up_proj`, `down_proj`:
            the released Qwen3-Next checkpoints' layout, what transformers 5's default
            `save_pretrained` writes for both models). `None`: the released checkpoints'
            layout of the model, `"fused"` for
            [`deltanet_cp.models.Qwen3_5MoeForCausalLM`][] and `"per_expert"` for
            [`deltanet_cp.models.Qwen3NextForCausalLM`][]. `from_pretrained` and
            transformers read both. (The names are the text model's, `model.layers.N...`,
            with its `config.json`, in either layout; the released Qwen3.5 checkpoints
            nest them under the multimodal model's `model.language_model.`.)
        - `max_shard_size`: the most bytes in one file: an int, or a string as
            transformers takes it (`"5GB"` is 5 * 10^9 bytes, `"5GiB"` 5 * 2^30; `MB`,
            `MiB`, `KB`, `KiB` too). A tensor larger than that gets a file of its own.

        **Raises:**

        `ValueError` naming the argument: a `dtype` that is not floating-point, an
        `experts` layout that is not one of the two (or any on a dense model), a
        `max_shard_size` that is not a positive size, a `path` that is a file.
        """
        save(self, path, dtype=dtype, experts=experts, max_shard_size=max_shard_size)

    def _logits(self, x, fsdp: FSDP | None = None):
        # The final norm and the head (the embedding if tied): gathered where used.
        tied = self.lm_head is None
        parts = (self.norm, self.lm_head, self.embed if tied else None)
        if fsdp is None:
            return _head(parts, x)
        where = lambda s: (s.norm, s.lm_head, s.embed if tied else None)  # noqa: E731
        return fsdp.apply(parts, where, x, fn=_head)

    def __call__(
        self,
        tokens: Int[Array, " seq"],
        *,
        cp: ContextParallel | None = None,
        kv_schedule: KVSchedule = "allgather",
        expert_axis: ExpertAxis = None,
        cu_seqlens: CuSeqlens | None = None,
        fsdp: FSDP | None = None,
        remat: Remat = "none",
    ) -> Float[Array, "seq vocab"]:
        """**Arguments:**

        - `tokens`: one sequence of token ids; with `cp`, this rank's shard of it under
            `cp.layout`.
        - `cp`: how the call is sharded, as in [`deltanet_cp.ContextParallel`][] (without
            `mesh`; the logits come out in `cp.layout`'s order); `None` on one device.
        - `kv_schedule`: how the attention layers get the other ranks' keys and values,
            `"allgather"` or `"ring"` (see [`deltanet_cp.nn.CausalSelfAttention`][]).
        - `expert_axis`: for a mixture-of-experts model inside `jax.shard_map`, the mesh
            axis (or tuple of axes) its routed experts are split over, `None` for every
            expert on every rank (see [`deltanet_cp.nn.SparseMoE`][]; the parameters'
            `in_specs` from [`deltanet_cp.nn.expert_partition_specs`][]). The tokens must
            be split over the same axes: the context axis, a data axis or both.
        - `cu_seqlens`: packed documents in `tokens`: the offsets `[0, ..., S]` of the
            documents of the whole sequence (global, also under `cp`), a list or an integer
            array, as [`deltanet_cp.data.pack_documents`][] makes them. Every layer then
            treats each document as a sequence of its own: the recurrent layers and
            convolutions restart from zeros, attention is causal within each document and
            its rotary positions restart at 0, so the logits equal each document's run
            alone. A repeated offset is an empty document: a batch of rows is a `jax.vmap`
            over the rows and their `cu_seqlens`, padded to one width by repeating `S`.
            `None`: one document. Decoding (`prefill`, `decode_step`) takes no documents.
        - `fsdp`: inside `jax.shard_map`, for parameters split over a data axis (fully
            sharded data parallelism): a [`deltanet_cp.nn.FSDP`][] naming the axis and the
            parameters' specs (from [`deltanet_cp.nn.partition_specs`][] of this model's
            parameters, the `shard_map`'s `in_specs` of them). Each layer's parameters are
            gathered over the axis just before it runs and again in its backward
            (`FSDP.apply`), the embedding and the LM head where they are used; with
            `scan_layers=True`, in the scan's body from the group's slices. The
            gradients come out split as the parameters. `None`: the parameters are whole
            on every rank (but the experts split over `expert_axis`).
        - `remat`: what each layer keeps for the backward pass (rematerialisation):
            `"none"` (everything its backward needs), `"layer"` (only the layer's input:
            the whole layer is recomputed in the backward, `jax.checkpoint`) or
            `"feed_forward"` (the token mixer's intermediates and output: the MLP or
            mixture-of-experts block is recomputed). The values and gradients are the same
            under every policy; memory and time are not (`benchmarks/model_scan.py`
            measures them).

        **Returns:**

        The next-token logits, `(seq, vocab)`, in the parameters' dtype; `(0, vocab)` for
        an empty `tokens`.

        **Raises:**

        `ValueError` if `tokens` is not a 1-D integer array, or holds an id outside
        `[0, vocab_size)` (an embedding lookup would silently clamp it). Traced ids (under
        `jax.jit`) are checked through `equinox.error_if`: the computation fails when it
        runs. `ValueError` for an `expert_axis` on a model without experts, or one that
        does not split them evenly (naming the axis), and for `cu_seqlens` that do not
        start at 0, end at the sequence length (`S`, over all ranks) or increase; for a
        `remat` that is not one of the policies; for `fsdp` specs whose layers are not
        stacked as this model's are.
        """
        return self._forward(
            tokens, cp, kv_schedule, expert_axis, cu_seqlens, remat=remat, fsdp=fsdp
        )[0]

    def logits_and_router_stats(
        self,
        tokens: Int[Array, " seq"],
        *,
        cp: ContextParallel | None = None,
        kv_schedule: KVSchedule = "allgather",
        expert_axis: ExpertAxis = None,
        cu_seqlens: CuSeqlens | None = None,
        token_mask: Bool[Array, " seq"] | None = None,
        fsdp: FSDP | None = None,
        remat: Remat = "none",
    ) -> tuple[Float[Array, "seq vocab"], RouterStats]:
        """The forward of a mixture-of-experts model, with what its load-balancing loss
        needs.

        **Arguments:** as for `__call__`, and

        - `token_mask`: `None` (every token counts), or a boolean array of `tokens`' shape
            (this rank's, in `cp.layout`'s order like `tokens`), `True` on the tokens the
            routing statistics count: the real tokens of a packed row, its padding
            excluded ([`deltanet_cp.data.real_tokens`][]), as transformers'
            `load_balancing_loss_func` takes the `attention_mask`. It changes the
            statistics only, not the logits.

        **Returns:**

        `(logits, stats)`: the logits, as `__call__`'s, and the
        [`deltanet_cp.nn.RouterStats`][] of this sequence summed over the sparse layers
        (over this rank's tokens with `cp`: `jax.lax.psum` them; over the masked ones with
        `token_mask`). The training loss adds
        `config.router_aux_loss_coef * deltanet_cp.nn.load_balancing_loss(stats)` (the
        stats summed over the batch first), as transformers' `output_router_logits=True`
        does ([`deltanet_cp.data.add_router_loss`][]).

        **Raises:**

        As `__call__`; and `ValueError` for a model without sparse layers, or a
        `token_mask` that is not a boolean array of `tokens`' shape.
        """
        if not any(self.config.is_sparse(i) for i in range(len(self.layers))):
            raise ValueError(
                f"This {type(self).__name__} has no mixture-of-experts layers: there is no "
                "routing to report. Call the model itself for the logits."
            )
        logits, stats, _ = self._forward(
            tokens,
            cp,
            kv_schedule,
            expert_axis,
            cu_seqlens,
            token_mask=token_mask,
            remat=remat,
            fsdp=fsdp,
        )
        assert stats is not None
        return logits, stats

    def hidden_states(
        self,
        tokens: Int[Array, " seq"],
        *,
        cp: ContextParallel | None = None,
        kv_schedule: KVSchedule = "allgather",
        expert_axis: ExpertAxis = None,
        cu_seqlens: CuSeqlens | None = None,
        token_mask: Bool[Array, " seq"] | None = None,
        fsdp: FSDP | None = None,
        remat: Remat = "none",
    ) -> tuple[Float[Array, "seq hidden"], RouterStats | None]:
        """The forward up to the LM head: the last hidden states after the final norm,
        what the head reads, for a loss that computes the logits itself
        ([`deltanet_cp.data.chunked_causal_lm_loss`][] with `head_weight`, which never
        holds the `(seq, vocab)` logits: the way to train long sequences).

        ```python
        hidden, stats = model.hidden_states(tokens, cp=cp, remat="layer")
        loss, count = chunked_causal_lm_loss(
            hidden, model.head_weight(), labels, chunk_size=1024, axis_name=("dp", "cp")
        )
        ```

        `hidden @ model.head_weight().T` are `__call__`'s logits.

        **Arguments:** as for `logits_and_router_stats` (`token_mask` only for a model with
        experts).

        **Returns:**

        `(hidden, stats)`: `(seq, hidden_size)` in the parameters' dtype, and the
        [`deltanet_cp.nn.RouterStats`][] as `logits_and_router_stats` gives them (`None`
        for a model without experts).

        **Raises:**

        As `__call__`; and `ValueError` for a `token_mask` on a model without experts.
        """
        if token_mask is not None and getattr(self.config, "num_experts", None) is None:
            raise ValueError(
                "`token_mask` marks the tokens a mixture-of-experts router counts; this "
                f"{type(self).__name__} has no experts. Pass `token_mask=None`."
            )
        hidden, stats, _ = self._forward(
            tokens,
            cp,
            kv_schedule,
            expert_axis,
            cu_seqlens,
            token_mask=token_mask,
            remat=remat,
            fsdp=fsdp,
            head=False,
        )
        return hidden, stats

    def head_weight(self, fsdp: FSDP | None = None) -> Float[Array, "vocab hidden"]:
        """The LM head's weight, `(vocab_size, hidden_size)`: the embedding's if the
        embeddings are tied. The logits are `hidden_states(...)[0] @ head_weight().T`.

        **Arguments:**

        - `fsdp`: inside `jax.shard_map`, with the parameters split over a data axis (as
            for `__call__`): the weight is gathered whole (its gradient comes back split).
        """
        if self.lm_head is None:
            embed = self.embed if fsdp is None else fsdp.gather(self.embed, lambda s: s.embed)
            return embed.weight
        head = self.lm_head if fsdp is None else fsdp.gather(self.lm_head, lambda s: s.lm_head)
        return head.weight

    def logits_and_mtp(
        self,
        tokens: Int[Array, " seq"],
        *,
        cp: ContextParallel | None = None,
        kv_schedule: KVSchedule = "allgather",
        expert_axis: ExpertAxis = None,
        cu_seqlens: CuSeqlens | None = None,
        token_mask: Bool[Array, " seq"] | None = None,
        fsdp: FSDP | None = None,
        remat: Remat = "none",
    ) -> tuple[Float[Array, "seq vocab"], Float[Array, "depth seq vocab"], RouterStats | None]:
        """The forward with the multi-token-prediction head (`mtp`, see
        [`deltanet_cp.models.Qwen3_5MTP`][]), for training it: the next-token logits and,
        per depth `k` (`0 .. mtp_num_hidden_layers - 1`), the logits of token `t + 2 + k`
        at every position `t`.

        Depth `k` at position `t` reads the previous depth's hidden state at `t` (the main
        model's last hidden state after its final norm, for depth 0) and the embedding of
        token `t + 1 + k`, the tokens shifted by `k + 1` (`next_tokens`): under `cp` the
        first token of the next piece crosses from the rank that holds it (one token per
        piece, either layout); with `cu_seqlens` no token crosses a document's end: the
        last `k + 1` tokens of a document read token 0 and have no target
        ([`deltanet_cp.data.mtp_labels`][] gives them none). The head's logits are the
        main model's LM head on its output. Train with
        [`deltanet_cp.data.add_mtp_loss`][].

        **Arguments:** as for `logits_and_router_stats` (the `token_mask` only for a
        model with experts). With `fsdp`, the head's parameters (split by
        [`deltanet_cp.nn.partition_specs`][] as any other's: `specs.mtp`) are gathered for
        each depth where it runs, with that depth's layer only, and again in its backward;
        the embedding and the LM head as for the main model.

        **Returns:**

        `(logits, mtp_logits, router_stats)`: `(seq, vocab)`, `(depth, seq, vocab)` and,
        for a model with experts, the routing statistics summed over the decoder layers
        and the head's layers (`None` without experts).

        **Raises:**

        As `__call__`; and `ValueError` for a model without a head (`mtp` is `None`: build
        it from a config with `mtp_num_hidden_layers > 0`, or load a checkpoint with `mtp.*`
        tensors).
        """
        if self.mtp is None:
            raise ValueError(
                f"This {type(self).__name__} has no multi-token-prediction head (`mtp` is None). "
                "Build it from a config with `mtp_num_hidden_layers >= 1`, or load a checkpoint "
                "that holds `mtp.*` tensors with a config that says so."
            )
        sparse = any(self.config.is_sparse(i) for i in range(len(self.layers)))
        if token_mask is not None and not sparse:
            raise ValueError(
                "`token_mask` marks the tokens a mixture-of-experts router counts; this "
                f"{type(self).__name__} has no experts. Pass `token_mask=None`."
            )
        logits, stats, mtp_logits = self._forward(
            tokens,
            cp,
            kv_schedule,
            expert_axis,
            cu_seqlens,
            token_mask=token_mask,
            fsdp=fsdp,
            remat=remat,
            mtp=True,
        )
        assert mtp_logits is not None
        return logits, mtp_logits, stats

    def _check_expert_axis(self, expert_axis: ExpertAxis) -> None:
        if expert_axis is not None and getattr(self.config, "num_experts", None) is None:
            raise ValueError(
                f"`expert_axis={expert_axis!r}` is for a mixture-of-experts model; this "
                f"{type(self).__name__} has no experts to split. Pass `expert_axis=None`."
            )

    def _forward(
        self,
        tokens,
        cp,
        kv_schedule,
        expert_axis: ExpertAxis = None,
        cu_seqlens=None,
        token_mask=None,
        fsdp: FSDP | None = None,
        remat: Remat = "none",
        mtp: bool = False,
        head: bool = True,
    ) -> tuple[Array, RouterStats | None, Array | None]:
        """`(logits, router stats, MTP logits)`: the stats `None` without experts, the MTP
        logits `None` unless `mtp`; the normed last hidden states for the logits if not
        `head`."""
        cp = layer_cp(cp, type(self).__name__)
        self._check_expert_axis(expert_axis)
        check_remat(remat)
        tokens = check_tokens(tokens, self.config.vocab_size)
        if token_mask is not None:
            check_token_mask(token_mask, tokens.shape[0])
        experts = getattr(self.config, "num_experts", None)
        if tokens.shape[0] == 0:
            width = self.config.vocab_size if head else self.config.hidden_size
            logits = jnp.zeros((0, width), self.embed.weight.dtype)
            depth = len(self.mtp.layers) if mtp and self.mtp is not None else 0
            heads = jnp.zeros((depth, 0, self.config.vocab_size), logits.dtype) if mtp else None
            if experts is None:
                return logits, None, heads
            zero = jnp.zeros((experts,), jnp.float32)
            return logits, RouterStats(zero, zero, jnp.zeros((), jnp.float32)), heads
        if cu_seqlens is not None:
            # Checked once, here, for every layer.
            cu_seqlens = documents(cp, tokens.shape[0], cu_seqlens).cu_seqlens
        if fsdp is not None:
            check_fsdp_layers(self.layers, getattr(fsdp.specs, "layers", None))
        embed = self.embed if fsdp is None else fsdp.gather(self.embed, lambda s: s.embed)
        x = jax.vmap(embed)(tokens)
        x, stats = run_layers(
            self.layers,
            x,
            cp,
            kv_schedule,
            expert_axis,
            cu_seqlens,
            token_mask,
            remat,
            experts,
            fsdp=fsdp,
        )
        if not head:
            norm = self.norm if fsdp is None else fsdp.gather(self.norm, lambda s: s.norm)
            return norm(x), stats, None
        if not mtp:
            return self._logits(x, fsdp), stats, None
        assert self.mtp is not None
        if fsdp is None:
            hidden = self.norm(x)
        else:
            hidden = fsdp.apply(self.norm, lambda s: s.norm, x)
        logits = self._project(hidden, fsdp)
        heads, shifted = [], tokens
        kw: dict[str, Any] = dict(
            cp=cp,
            kv_schedule=kv_schedule,
            expert_axis=expert_axis,
            cu_seqlens=cu_seqlens,
            token_mask=token_mask,
        )
        for k in range(len(self.mtp.layers)):
            shifted = next_tokens(shifted[None], cp=cp, cu_seqlens=cu_seqlens)[0]
            embedded = jax.vmap(embed)(shifted)
            if fsdp is None:
                hidden, s = self.mtp(hidden, embedded, k, remat=remat, **kw)
            else:
                # The head with depth `k`'s layer only, gathered where it runs.
                def depth_k(mtp: Qwen3_5MTP) -> Qwen3_5MTP:
                    return eqx.tree_at(lambda m: m.layers, mtp, (mtp.layers[k],))

                def call(mtp, hidden, embedded, *, remat):
                    return mtp(hidden, embedded, 0, remat=remat, **kw)

                one = FSDP(fsdp.axis, depth_k(fsdp.specs.mtp))
                hidden, s = call_layer(
                    call, depth_k(self.mtp), hidden, embedded, remat=remat, fsdp=one
                )
            if s is not None:
                stats = s if stats is None else jax.tree.map(jnp.add, stats, s)
            heads.append(self._project(hidden, fsdp))
        return logits, stats, jnp.stack(heads)

    def _project(self, hidden, fsdp: FSDP | None = None):
        """The LM head (the embedding's transpose if tied) on normed hidden states; with
        `fsdp`, gathered where used."""
        tied = self.lm_head is None
        parts = (self.lm_head, self.embed if tied else None)
        if fsdp is None:
            return _project(parts, hidden)
        where = lambda s: (s.lm_head, s.embed if tied else None)  # noqa: E731
        return fsdp.apply(parts, where, hidden, fn=_project)

    def init_cache(self, capacity: int, dtype=None) -> Qwen3_5Cache:
        """The cache before the first token, with room for `capacity` tokens.

        **Arguments:**

        - `capacity`: the most tokens (prompt and generated) the attention layers' caches
            hold.
        - `dtype`: the dtype of the conv states and keys/values; the parameters' if `None`
            (the recurrent states are float32).
        """
        capacity = as_positive_index(capacity, "capacity")
        layers = tuple(layer.mixer.init_state(dtype, capacity=capacity) for layer in self.layers)
        return Qwen3_5Cache(layers, jnp.zeros((), jnp.int32))

    def _check_cache(self, cache: Any, name: str = "cache") -> None:
        """A `ValueError` naming `name` and what differs if `cache` is not a cache of this
        model (its layers, their kinds, shapes and dtypes)."""
        check_cache(self, cache, name)

    @overload
    def prefill(
        self,
        tokens: Int[Array, " seq"],
        cache: Qwen3_5Cache | None = None,
        *,
        checkpoint_every: None = None,
        capacity: int | None = None,
        cp: ContextParallel | None = None,
        kv_schedule: KVSchedule = "allgather",
        expert_axis: ExpertAxis = None,
    ) -> tuple[Float[Array, "seq vocab"], Qwen3_5Cache]: ...

    @overload
    def prefill(
        self,
        tokens: Int[Array, " seq"],
        cache: Qwen3_5Cache | None = None,
        *,
        checkpoint_every: int,
        capacity: int | None = None,
        cp: ContextParallel | None = None,
        kv_schedule: KVSchedule = "allgather",
        expert_axis: ExpertAxis = None,
    ) -> tuple[Float[Array, "seq vocab"], Qwen3_5Cache, Qwen3_5Checkpoints]: ...

    def prefill(
        self,
        tokens: Int[Array, " seq"],
        cache: Qwen3_5Cache | None = None,
        *,
        checkpoint_every: int | None = None,
        capacity: int | None = None,
        cp: ContextParallel | None = None,
        kv_schedule: KVSchedule = "allgather",
        expert_axis: ExpertAxis = None,
    ) -> (
        tuple[Float[Array, "seq vocab"], Qwen3_5Cache]
        | tuple[Float[Array, "seq vocab"], Qwen3_5Cache, Qwen3_5Checkpoints]
    ):
        """Run a prompt (or the next part of one) and return the cache to continue from.

        **Arguments:**

        - `tokens`: the prompt's token ids; with `cp`, this rank's shard of them.
        - `cache`: the cache after the tokens before these (replicated on every rank with
            `cp`), or `None` to start a new sequence.
        - `checkpoint_every`: `L`, to also return the Gated DeltaNet layers' states after
            every `L` tokens of `tokens` (for prefix caching), computed in the same pass
            (see [`deltanet_cp.nn.GatedDeltaNet.prefill`][] for what `L` must divide).
        - `capacity`: with `cache=None`, the most tokens the new cache holds (prompt and
            generated); if `None`, the whole prompt's length plus 256, room for 256 tokens
            of `decode_step` (pass `capacity` for longer generations). Only without a
            `cache` (whose own capacity holds).
        - `cp`, `kv_schedule`, `expert_axis`: as for `__call__`.

        **Returns:**

        `(logits, cache)`, the logits `(seq, vocab)` of `tokens` (in the layout's order)
        and the cache after them, the same on every rank; with `checkpoint_every`,
        `(logits, cache, checkpoints)`, a [`deltanet_cp.models.Qwen3_5Checkpoints`][]
        (under context parallelism each rank's own, in the layout's order).

        **Raises:**

        `ValueError` naming the argument: `tokens` empty, not a 1-D integer array or with
        an id outside `[0, vocab_size)` (traced ids fail the computation through
        `equinox.error_if`); a `cache` of another model or config, or without room for
        `tokens`; `capacity` with a `cache`, or too small for the prompt;
        `checkpoint_every` more than the tokens (no checkpoint would fall in them).
        """
        cp = layer_cp(cp, type(self).__name__)
        self._check_expert_axis(expert_axis)
        tokens = check_tokens(tokens, self.config.vocab_size)
        t = tokens.shape[0]
        if t == 0:
            raise ValueError(
                "`tokens` is empty: `prefill` needs at least one token (the cache before the "
                "first token is `init_cache(capacity)`)."
            )
        if checkpoint_every is not None:
            checkpoint_every = as_positive_index(checkpoint_every, "checkpoint_every")
            if checkpoint_every > t:
                where = "" if cp is None else " on this rank"
                raise ValueError(
                    f"`checkpoint_every` ({checkpoint_every}) is more than the {t} tokens of "
                    f"`tokens`{where}: no checkpoint would fall in them. Pass at most {t}, or "
                    "`checkpoint_every=None` for no checkpoints."
                )
        total = t * axis_size(cp)
        if cache is None:
            capacity = (
                total + DECODE_ROOM if capacity is None else as_positive_index(capacity, "capacity")
            )
            if capacity < total:
                raise ValueError(
                    f"`capacity` ({capacity}) is less than the prompt's {total} tokens; pass at "
                    "least the prompt's length plus the tokens to generate."
                )
            cache = self.init_cache(capacity)
        else:
            if capacity is not None:
                raise ValueError(
                    "`capacity` is for a new cache (`cache=None`); this `cache` holds "
                    f"{cache.capacity} tokens. Pass one or the other."
                )
            self._check_cache(cache)
        length = cache.length
        room = f"the cache holds {cache.capacity} tokens"
        seen = concrete(length)
        if seen is not None and int(seen) + total > cache.capacity:
            raise ValueError(
                f"`cache` has no room for `tokens`: {room}, {int(seen)} seen and {total} "
                "more. Make a larger cache (`init_cache(capacity)` or `prefill(..., "
                "capacity=...)`)."
            )
        if seen is None:
            length = eqx.error_if(
                length,
                length + total > cache.capacity,
                f"`cache` has no room for `tokens` ({total} tokens): {room}. Make a larger "
                "cache (`init_cache(capacity)` or `prefill(..., capacity=...)`).",
            )
        x, new_cache, saved = self._run_prefill(
            tokens, cache, length, checkpoint_every, cp, kv_schedule, expert_axis
        )
        if saved is None:
            return self._logits(x), new_cache
        return self._logits(x), new_cache, saved

    def _run_prefill(
        self,
        tokens,
        cache,
        length,
        checkpoint_every,
        cp: ContextParallel | None = None,
        kv_schedule: KVSchedule = "allgather",
        expert_axis: ExpertAxis = None,
    ) -> tuple[Array, Qwen3_5Cache, Qwen3_5Checkpoints | None]:
        """`prefill` past its checks: the last hidden states (before the final norm), the
        cache after `tokens` and, with `checkpoint_every`, the checkpoints."""
        t = tokens.shape[0]
        x = jax.vmap(self.embed)(tokens)
        states, saved = [], []
        for layer, state in zip(self.layers, cache.layers):
            x, state, ckpt = layer.prefill(
                x, state, length, checkpoint_every, cp, kv_schedule, expert_axis
            )
            states.append(state)
            saved.append(ckpt)
        new_cache = Qwen3_5Cache(tuple(states), length + t * axis_size(cp))
        if checkpoint_every is None:
            return x, new_cache, None
        n = t // checkpoint_every
        ends = local_positions(cp, t)[checkpoint_every - 1 :: checkpoint_every][:n]
        return x, new_cache, Qwen3_5Checkpoints(tuple(saved), length + ends + 1)

    def restore(
        self, cache: Qwen3_5Cache, checkpoints: Qwen3_5Checkpoints, index: Int[Array, ""] | int
    ) -> Qwen3_5Cache:
        """The cache after the prefix that checkpoint `index` ends, from a later cache of
        the same sequence (its keys and values hold the prefix's) and the checkpoints.

        **Arguments:**

        - `cache`: a cache of the same sequence, at or past the checkpoint.
        - `checkpoints`: from `prefill(..., checkpoint_every=L)` (gathered, in sequence
            order, under context parallelism).
        - `index`: which checkpoint, `0` to `n - 1` (the `n` of `checkpoints.lengths`;
            negative indices are refused).

        **Raises:**

        `ValueError` if `index` is not one of the checkpoints (naming those there are), if
        `cache` is before the checkpoint, or if `cache` or `checkpoints` is not of this
        model; for a traced `index` or cache length, the computation fails through
        `equinox.error_if`.
        """
        return restore(self, cache, checkpoints, index)

    @eqx.filter_jit
    def decode_step(
        self, token: Int[Array, ""], cache: Qwen3_5Cache
    ) -> tuple[Float[Array, " vocab"], Qwen3_5Cache]:
        """One token of generation, compiled once per model and cache shape.

        **Arguments:**

        - `token`: the next token id (a scalar).
        - `cache`: the cache after the tokens before it (from `prefill` or the last
            `decode_step`), with room for one more.

        **Returns:**

        `(logits, cache)`: the next-token logits `(vocab,)` and the cache after `token`.

        **Raises:**

        `ValueError` if `cache` is not a cache of this model (naming what differs) or
        `token` is not one integer id; an id outside `[0, vocab_size)` or a full cache fail
        the computation through `equinox.error_if`.
        """
        self._check_cache(cache)
        token = check_tokens(token, self.config.vocab_size, "token", ndim=0)
        cache = eqx.error_if(
            cache,
            cache.length >= cache.capacity,
            f"The cache is full: it holds {cache.capacity} tokens. Make room for the tokens "
            "to generate: `prefill(tokens, capacity=len(tokens) + max_new_tokens)` or "
            "`init_cache(capacity)`.",
        )
        x = self.embed(token)
        states = []
        for layer, state in zip(self.layers, cache.layers):
            x, state = layer.step(x, state, cache.length)
            states.append(state)
        return self._logits(x[None])[0], Qwen3_5Cache(tuple(states), cache.length + 1)

    def generate(
        self, tokens: Int[Array, " seq"], max_new_tokens: int
    ) -> Int[Array, " max_new_tokens"]:
        """Greedy decoding: a prefill of `tokens`, then `max_new_tokens` tokens, each the
        most likely after the ones before (one compiled loop).

        **Arguments:**

        - `tokens`: the prompt's token ids, `(seq,)`.
        - `max_new_tokens`: how many tokens to generate.

        **Returns:**

        The generated token ids, `(max_new_tokens,)`.

        **Raises:**

        `ValueError` as for `prefill` (an empty prompt, bad ids); `TypeError` /
        `ValueError` naming `max_new_tokens` unless it is an int at least 0.
        """
        max_new_tokens = as_index(max_new_tokens, "max_new_tokens")
        if max_new_tokens < 0:
            raise ValueError(f"`max_new_tokens` must be at least 0; got {max_new_tokens}.")
        tokens = check_tokens(tokens, self.config.vocab_size)
        if tokens.shape[0] == 0:
            raise ValueError("`tokens` is empty: `generate` needs a prompt of at least one token.")
        return _generate(self, tokens, max_new_tokens)

    def speculative_generate(
        self, tokens: Int[Array, " seq"], max_new_tokens: int
    ) -> tuple[Int[Array, " max_new_tokens"], Int[Array, ""], Int[Array, ""]]:
        """Greedy decoding with the multi-token-prediction head as the draft model
        (self-speculative decoding): the tokens `generate` gives, in fewer passes of the
        model when the head guesses well.

        Each step runs the model on two tokens from its cache (a prefill of two): the next
        token and the head's guess of the one after it. If the model's own choice after
        the next token is the guess, both are kept (and the model's choice after the guess
        comes free); else the guess is dropped and the cache after the next token alone is
        made from the cache before the step (one more pass of one token: the Gated
        DeltaNet states cannot be taken back a token). The head (depth 0,
        with its own key/value cache) then reads the model's new hidden states and guesses
        again. Every kept token is the model's greedy choice, so the output is `generate`'s
        (up to ties of the argmax under rounding: the model's logits of two tokens in one
        pass and of one at a time agree to rounding, not bit for bit).

        **Arguments:**

        - `tokens`: the prompt's token ids, `(seq,)`.
        - `max_new_tokens`: how many tokens to generate.

        **Returns:**

        `(generated, accepted, steps)`: the token ids `(max_new_tokens,)`, how many of the
        head's guesses were kept and how many two-token steps ran (the acceptance rate is
        `accepted / steps`; `generate` takes `max_new_tokens` one-token steps).

        **Raises:**

        As `generate`; and `ValueError` for a model without a head (`mtp` is `None`).
        """
        if self.mtp is None:
            raise ValueError(
                f"This {type(self).__name__} has no multi-token-prediction head (`mtp` is None) "
                "to draft with. Use `generate`, or build or load the model with its head."
            )
        max_new_tokens = as_index(max_new_tokens, "max_new_tokens")
        if max_new_tokens < 0:
            raise ValueError(f"`max_new_tokens` must be at least 0; got {max_new_tokens}.")
        tokens = check_tokens(tokens, self.config.vocab_size)
        if tokens.shape[0] == 0:
            raise ValueError(
                "`tokens` is empty: `speculative_generate` needs a prompt of at least one token."
            )
        return _speculative(self, tokens, max_new_tokens)


def _project(parts, hidden):
    """The LM head (the embedding's transpose if the head is tied) on normed hidden states."""
    head, embed = parts
    if head is None:
        return hidden @ embed.weight.T
    return jax.vmap(head)(hidden)


def _head(parts, x):
    """The logits of the last hidden states `x`: the final norm, then the LM head (the
    embedding's transpose if the head is tied)."""
    norm, head, embed = parts
    return _project((head, embed), norm(x))


@eqx.filter_jit
def _generate(model: AbstractCausalLM[Any], tokens, max_new_tokens: int):
    logits, cache = model.prefill(tokens, capacity=tokens.shape[0] + max_new_tokens)
    first = jnp.argmax(logits[-1]).astype(tokens.dtype)

    def body(carry, _):
        token, cache = carry
        logits, cache = model.decode_step(token, cache)
        return (jnp.argmax(logits).astype(token.dtype), cache), token

    _, out = jax.lax.scan(body, (first, cache), length=max_new_tokens)
    return out


@eqx.filter_jit
def _speculative(model: AbstractCausalLM[Any], tokens, max_new_tokens: int):
    mtp = model.mtp
    assert mtp is not None
    head, argmax = mtp.layers[0], lambda x: jnp.argmax(x, axis=-1).astype(tokens.dtype)
    n = tokens.shape[0]
    capacity = n + max_new_tokens + 2  # a step may look one token past the end
    start = jnp.zeros((), jnp.int32)
    x, cache, _ = model._run_prefill(tokens, model.init_cache(capacity), start, None)
    hidden = model.norm(x)
    first = argmax(model._project(hidden[-1:]))[0]
    # The head over the prompt: position t reads the hidden state at t and token t + 1.
    u = mtp.fuse(hidden, jax.vmap(model.embed)(jnp.concatenate([tokens[1:], first[None]])))
    out, head_cache, _ = head.prefill(
        u, head.mixer.init_state(capacity=capacity), start, None, None, "allgather"
    )
    draft = argmax(model._project(mtp.norm(out[-1:])))[0]
    generated = jnp.zeros((max_new_tokens + 1,), tokens.dtype)
    zero = jnp.zeros((), jnp.int32)

    def body(carry):
        cache, head_cache, head_length, token, draft, generated, count, accepted, steps = carry
        pair = jnp.stack([token, draft])
        x, longer, _ = model._run_prefill(pair, cache, cache.length, None)
        hidden = model.norm(x)
        choice = argmax(model._project(hidden))  # after `token`, after `draft`
        ok = choice[0] == draft

        # A wrong guess: the cache after `token` alone, from the cache before the step.
        def alone(before):
            return model._run_prefill(token[None], before, before.length, None)[1]

        cache = jax.lax.cond(ok, lambda before: longer, alone, cache)
        generated = jax.lax.dynamic_update_slice(generated, pair, (count,))
        step = 1 + ok.astype(jnp.int32)
        # The head at the two new positions (the second is overwritten if `draft` failed).
        u = mtp.fuse(hidden, jax.vmap(model.embed)(choice))
        out, head_cache, _ = head.prefill(u, head_cache, head_length, None, None, "allgather")
        draft = argmax(model._project(mtp.norm(out[step - 1][None])))[0]
        token = jnp.where(ok, choice[1], choice[0])
        return (
            cache,
            head_cache,
            head_length + step,
            token,
            draft,
            generated,
            count + step,
            accepted + ok.astype(jnp.int32),
            steps + 1,
        )

    carry = (cache, head_cache, start + n, first, draft, generated, zero, zero, zero)
    carry = jax.lax.while_loop(lambda c: c[6] < max_new_tokens, body, carry)
    return carry[5][:max_new_tokens], carry[7], carry[8]

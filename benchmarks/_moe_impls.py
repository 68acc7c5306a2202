"""The mixture-of-experts layers `moe.py` compares, as `_harness` factories.

Every one computes the sparse MoE block of Qwen3-Next on one sequence `x (T, H)` with the
same float32 weights (`problem`, numpy, seed 0): a softmax router over `E` experts, the
`top_k` probabilities renormalised, SwiGLU experts, and a shared SwiGLU expert scaled by
`sigmoid(shared_expert_gate(x))`.

- `ours`: `deltanet_cp.nn.SparseMoE`, through its public constructor and `__call__` only
  (whatever its experts do inside);
- `ragged_dot`: the design `SparseMoE` shipped with first, copied here so that it can be
  measured after ours changes: the `(token, expert)` pairs sorted by expert, each
  projection one `jax.lax.ragged_dot_general` over the sorted rows, scattered back;
- `dense`: every expert on every token, the routing weights zero off the top-k (`E / top_k`
  times the routed FLOPs, by construction);
- `transformers`: transformers' `Qwen3NextSparseMoeBlock`, eager PyTorch (a loop over the
  experts hit, each on its tokens), in a worker whose interpreter has torch.

The router and shared expert of `ragged_dot` and `dense` are the same functions (`_route`,
`_shared`, what `SparseMoE` computes). The forward+backward pass ("fwd+bwd") is the
pullback of a fixed random cotangent of `y` to every weight and to `x` (`jax.vjp`,
`torch.autograd.backward`): the gradients of `sum(y * dy)`.

Nothing here imports jax or torch at module level: the transformers worker has no jax.
"""

import os
import time

import numpy as np
from _harness import Prepared


PASSES = ("fwd", "fwd+bwd")


def problem(*, t: int, h: int, e: int, i: int, s: int) -> tuple[np.ndarray, dict, np.ndarray]:
    """float32 `x (t, h)`, the weights (torch's `(out, in)` layout) and the cotangent `dy`.

    The router's weights are scaled so that the logits have a standard deviation of about
    2: the gaps between the k-th and (k+1)-th probabilities are then far above float32
    rounding, and every implementation picks the same experts.
    """
    rng = np.random.default_rng(0)

    def uniform(*shape):
        lim = 1 / np.sqrt(shape[-1])
        return rng.uniform(-lim, lim, shape).astype(np.float32)

    x = rng.standard_normal((t, h), dtype=np.float32)
    weights = {
        "router": (2 / np.sqrt(h) * rng.standard_normal((e, h))).astype(np.float32),
        "gate_proj": uniform(e, i, h),
        "up_proj": uniform(e, i, h),
        "down_proj": uniform(e, h, i),
        "shared_gate_proj": uniform(s, h),
        "shared_up_proj": uniform(s, h),
        "shared_down_proj": uniform(h, s),
        "shared_expert_gate": uniform(1, h),
    }
    dy = np.random.default_rng(1).standard_normal((t, h), dtype=np.float32)
    return x, weights, dy


def dense_part_flops(*, t: int, h: int, e: int, s: int) -> float:
    """Forward matmul FLOPs of what is not a routed expert: the router `2 T H E`, the shared
    expert `2 * 3 T H S` and its gate `2 T H`."""
    return 2.0 * t * h * (e + 3 * s + 1)


def routed_active_flops(*, t: int, h: int, i: int, k: int) -> float:
    """Forward matmul FLOPs of the routed experts at the routed (active) count: each token
    through `k` experts, three `H x I` products each, `2 * 3 T k H I`."""
    return 6.0 * t * k * h * i


# ------------------------------------------------------------------ the JAX designs


def _route(w, x, k):
    """`SparseMoE.route`: softmax in float32, the top-k renormalised."""
    import jax
    import jax.numpy as jnp

    probs = jax.nn.softmax((x @ w["router"].T).astype(jnp.float32), axis=-1)
    top, experts = jax.lax.top_k(probs, k)
    return experts, (top / jnp.sum(top, axis=-1, keepdims=True)).astype(x.dtype)


def _shared(w, x):
    import jax

    h = jax.nn.silu(x @ w["shared_gate_proj"].T) * (x @ w["shared_up_proj"].T)
    return jax.nn.sigmoid(x @ w["shared_expert_gate"].T) * (h @ w["shared_down_proj"].T)


def _grouped(x, w, group_sizes):
    """`x[rows of group e] @ w[e].T` for every group `e`: `x` `(m, in)` sorted by group, `w`
    `(groups, out, in)`; `(m, out)`."""
    import jax

    dims = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([1], [2]), ([], [])),
        lhs_ragged_dimensions=[0],
        rhs_group_dimensions=[0],
    )
    return jax.lax.ragged_dot_general(x, w, group_sizes, dims)


def _ragged_experts(w, x, experts, weights):
    """The routed experts as `SparseMoE` first computed them (sort, grouped matmuls, scatter)."""
    import jax
    import jax.numpy as jnp

    t, k = experts.shape
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    group_sizes = jnp.bincount(flat, length=w["gate_proj"].shape[0]).astype(jnp.int32)
    rows = x[order // k]
    h = jax.nn.silu(_grouped(rows, w["gate_proj"], group_sizes)) * _grouped(
        rows, w["up_proj"], group_sizes
    )
    out = _grouped(h.astype(x.dtype), w["down_proj"], group_sizes).astype(x.dtype)
    out = jnp.zeros_like(out).at[order].set(out, unique_indices=True)
    out = out.reshape(t, k, -1) * weights.astype(x.dtype)[..., None]
    return jnp.sum(out, axis=1)


def _dense_experts(w, x, experts, weights):
    """Every expert on every token; the weights `(T, E)` are zero off each token's top-k."""
    import jax
    import jax.numpy as jnp

    t = x.shape[0]
    mix = jnp.zeros((t, w["gate_proj"].shape[0]), x.dtype)
    mix = mix.at[jnp.arange(t)[:, None], experts].set(weights)
    g = jnp.einsum("th,eih->tei", x, w["gate_proj"])
    u = jnp.einsum("th,eih->tei", x, w["up_proj"])
    return jnp.einsum("tei,ehi->th", jax.nn.silu(g) * u * mix[..., None], w["down_proj"])


def _design(experts_fn, k):
    def forward(w, x):
        experts, weights = _route(w, x, k)
        return experts_fn(w, x, experts, weights) + _shared(w, x)

    return forward


def _compile_info(info: dict, name: str, compiled, seconds: float) -> None:
    from _seqdepth import matmul_flops

    info[f"compile_s {name}"] = seconds
    memory = compiled.memory_analysis()
    if memory is not None:
        info[f"temp_bytes {name}"] = memory.temp_size_in_bytes
    info[f"matmul_flops {name}"] = matmul_flops(compiled)


def _jax_prepared(forward, params, x, dy, version: str) -> Prepared:
    """A `Prepared` of a JAX `forward(params, x) -> y`: each pass compiled, with its
    temporaries and matmul FLOPs."""
    import jax

    info = {"version": version, "jax": jax.__version__}

    def fwd_bwd(params, x, dy):
        return jax.vjp(forward, params, x)[1](dy)

    programs = {"fwd": (forward, (params, x)), "fwd+bwd": (fwd_bwd, (params, x, dy))}
    calls = {}
    for name, (fn, args) in programs.items():
        start = time.perf_counter()
        compiled = jax.jit(fn).lower(*args).compile()
        _compile_info(info, name, compiled, time.perf_counter() - start)
        calls[name] = lambda c=compiled, a=args: jax.block_until_ready(c(*a))

    def outputs():
        return {"y": np.asarray(jax.jit(forward)(params, x), np.float32)}

    return Prepared(calls, outputs, info)


def _ours_module(w: dict, *, h, e, k, i, s):
    """A `SparseMoE` built by its public constructor, holding the weights `w`."""
    import equinox as eqx
    import jax.numpy as jnp
    import jax.random as jr
    from _impls import import_ours

    import_ours()
    from deltanet_cp.nn import SparseMoE

    moe = SparseMoE(h, e, k, i, s, key=jr.key(0), dtype=jnp.float32)
    leaves = {
        "router": lambda m: m.gate.weight,
        "gate_proj": lambda m: m.experts.gate_proj,
        "up_proj": lambda m: m.experts.up_proj,
        "down_proj": lambda m: m.experts.down_proj,
        "shared_gate_proj": lambda m: m.shared_expert.gate_proj.weight,
        "shared_up_proj": lambda m: m.shared_expert.up_proj.weight,
        "shared_down_proj": lambda m: m.shared_expert.down_proj.weight,
        "shared_expert_gate": lambda m: m.shared_expert_gate.weight,
    }
    for name, where in leaves.items():
        moe = eqx.tree_at(where, moe, jnp.asarray(w[name]))
    return moe


def ours(*, t, h, e, k, i, s) -> Prepared:
    """`deltanet_cp.nn.SparseMoE`, its output `y` (the router statistics dropped)."""
    import equinox as eqx
    import jax.numpy as jnp
    from _impls import import_ours

    dcp = import_ours()
    x, w, dy = problem(t=t, h=h, e=e, i=i, s=s)
    moe = _ours_module(w, h=h, e=e, k=k, i=i, s=s)
    params, static = eqx.partition(moe, eqx.is_array)

    def forward(params, x):
        return eqx.combine(params, static)(x)[0]

    prepared = _jax_prepared(forward, params, jnp.asarray(x), jnp.asarray(dy), dcp.__version__)
    _executed_routed_flops(prepared.info, moe, jnp.asarray(x), t=t, h=h, e=e, k=k, i=i)
    return prepared


def _executed_routed_flops(info: dict, moe, x, *, t, h, e, k, i, split: int = 1) -> None:
    """Our routed experts run a loop over tiles whose trip count depends on the routing, so
    the compiled program holds its body once and no trip count: count the tiles each rank
    runs from the routing of `x`, times a tile's products (three forward; six more backward,
    the forward's two projections kept). Per device: the busiest rank's."""
    from deltanet_cp.nn._moe import _tile_rows

    held = e // split
    tile = _tile_rows(t // split * k, held)
    experts = np.asarray(moe.route(x)[1]).ravel()
    counts = np.bincount(experts, minlength=e).reshape(split, held)
    tiles = int(np.max(np.sum(-(-counts // tile), axis=1)))
    per_product = tiles * tile * 2 * h * i
    info["routed_flops fwd"] = 3 * per_product
    info["routed_flops fwd+bwd"] = 9 * per_product
    info["tiles"] = f"{tiles} tiles of {tile} rows"


def ragged_dot(*, t, h, e, k, i, s) -> Prepared:
    """The sort + `ragged_dot_general` design, on a dict of the weights."""
    import jax
    import jax.numpy as jnp

    x, w, dy = problem(t=t, h=h, e=e, i=i, s=s)
    params = {n: jnp.asarray(a) for n, a in w.items()}
    forward = _design(_ragged_experts, k)
    return _jax_prepared(forward, params, jnp.asarray(x), jnp.asarray(dy), f"jax {jax.__version__}")


def dense(*, t, h, e, k, i, s) -> Prepared:
    """Every expert on every token, masked."""
    import jax
    import jax.numpy as jnp

    x, w, dy = problem(t=t, h=h, e=e, i=i, s=s)
    params = {n: jnp.asarray(a) for n, a in w.items()}
    forward = _design(_dense_experts, k)
    return _jax_prepared(forward, params, jnp.asarray(x), jnp.asarray(dy), f"jax {jax.__version__}")


def transformers(*, t, h, e, k, i, s) -> Prepared:
    """transformers' `Qwen3NextSparseMoeBlock`, eager, on the CPU, holding the same weights."""
    import torch
    import transformers as hf
    from transformers.models.qwen3_next import modeling_qwen3_next

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    config = hf.Qwen3NextConfig(
        hidden_size=h,
        num_experts=e,
        num_experts_per_tok=k,
        moe_intermediate_size=i,
        shared_expert_intermediate_size=s,
        norm_topk_prob=True,
        hidden_act="silu",
    )
    config._experts_implementation = "eager"  # the loop over experts, not a hub kernel
    block = modeling_qwen3_next.Qwen3NextSparseMoeBlock(config).float()
    x_np, w, dy_np = problem(t=t, h=h, e=e, i=i, s=s)
    fused = np.concatenate([w["gate_proj"], w["up_proj"]], axis=1)  # (E, 2I, H), gate first
    tensors = {
        "gate.weight": w["router"],
        "experts.gate_up_proj": fused,
        "experts.down_proj": w["down_proj"],
        "shared_expert.gate_proj.weight": w["shared_gate_proj"],
        "shared_expert.up_proj.weight": w["shared_up_proj"],
        "shared_expert.down_proj.weight": w["shared_down_proj"],
        "shared_expert_gate.weight": w["shared_expert_gate"],
    }
    state = {n: torch.from_numpy(np.ascontiguousarray(a)) for n, a in tensors.items()}
    block.load_state_dict(state, strict=True)
    x, dy = torch.from_numpy(x_np)[None], torch.from_numpy(dy_np)[None]
    info = {
        "version": hf.__version__,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }

    def fwd():
        with torch.no_grad():
            return block(x)

    def fwd_bwd():
        block.zero_grad(set_to_none=True)
        leaf = x.detach().requires_grad_(True)
        torch.autograd.backward(block(leaf), dy)
        return leaf.grad

    def outputs():
        return {"y": fwd()[0].numpy().astype(np.float32)}

    return Prepared({"fwd": fwd, "fwd+bwd": fwd_bwd}, outputs, info)


# ------------------------------------------------------------------ expert parallelism


def ours_ep(*, t, h, e, k, i, s, split: int) -> Prepared:
    """`SparseMoE` with its experts over `split` simulated devices (`expert_axis=`), inside
    `jax.shard_map`: each rank holds `E / split` experts' weights (sharded on their first
    axis) and `T / split` of the tokens; the router and shared expert are replicated.

    Its info adds what the busiest rank receives, read from the compiled HLO's collectives
    (`deltanet_cp.internal.received_bytes_per_rank`), and the number of collectives, per pass.
    """
    import inspect

    import equinox as eqx
    import jax
    import jax.numpy as jnp
    from _impls import import_ours
    from jax.sharding import NamedSharding, PartitionSpec as P

    dcp = import_ours()
    from deltanet_cp.nn import SparseMoE

    if "expert_axis" not in inspect.signature(SparseMoE.__call__).parameters:
        raise RuntimeError("SparseMoE.__call__ takes no `expert_axis` in this checkout")
    if len(jax.devices()) < split:
        raise RuntimeError(f"{len(jax.devices())} devices, fewer than the split {split}")
    x, w, dy = problem(t=t, h=h, e=e, i=i, s=s)
    moe = _ours_module(w, h=h, e=e, k=k, i=i, s=s)
    params, static = eqx.partition(moe, eqx.is_array)
    mesh = jax.make_mesh((split,), ("ep",), devices=jax.devices()[:split])
    experts_spec = {id(a) for a in jax.tree.leaves(params.experts)}
    specs = jax.tree.map(lambda a: P("ep") if id(a) in experts_spec else P(), params)

    def per_rank(params, x):
        return eqx.combine(params, static)(x, expert_axis="ep")[0]

    forward = jax.shard_map(per_rank, mesh=mesh, in_specs=(specs, P("ep")), out_specs=P("ep"))

    def fwd_bwd(params, x, dy):
        return jax.vjp(forward, params, x)[1](dy)

    place = jax.tree.map(lambda a, p: jax.device_put(a, NamedSharding(mesh, p)), params, specs)
    xs, dys = (jax.device_put(jnp.asarray(a), NamedSharding(mesh, P("ep"))) for a in (x, dy))
    info = {"version": dcp.__version__, "jax": jax.__version__, "split": split}
    programs = {"fwd": (forward, (place, xs)), "fwd+bwd": (fwd_bwd, (place, xs, dys))}
    calls = {}
    for name, (fn, args) in programs.items():
        start = time.perf_counter()
        compiled = jax.jit(fn).lower(*args).compile()
        _compile_info(info, name, compiled, time.perf_counter() - start)
        text = compiled.as_text() or ""
        info[f"received {name}"] = max(
            dcp.internal.received_bytes_per_rank(text).values(), default=0
        )
        info[f"collectives {name}"] = len(dcp.internal.collectives(text))
        calls[name] = lambda c=compiled, a=args: jax.block_until_ready(c(*a))

    def outputs():
        return {"y": np.asarray(jax.jit(forward)(place, xs), np.float32)}

    _executed_routed_flops(info, moe, jnp.asarray(x), t=t, h=h, e=e, k=k, i=i, split=split)
    return Prepared(calls, outputs, info)

"""`save_pretrained` of the Qwen3.5 dense, Qwen3-Next and Qwen3.5 MoE models: every tensor it
writes equals, bit for bit, the tensor of the same name that transformers wrote in the
fixture (same names, shapes and dtypes: the proof transformers reads it), `config.json`
says what the fixture's says, and `from_pretrained` reads back bit-identical parameters; both
expert layouts, bfloat16, sharded files, atomic writes, parameters sharded over a mesh.

The fixtures are the tiny transformers models of tests/test_qwen3_5.py and
tests/test_qwen3_moe.py. Our files are read with the `safetensors` package (its numpy reader,
its flax one for bfloat16) as a check on our writer, not with our own reader.

Cost: no model is run; the loads and conversions are small eager programs (about 170, from
the persistent cache in well under a second each), about 1 s a test; the two-process test
starts two interpreters (about 18 s on 2 cores).
"""

import functools as ft
import json
import pathlib

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import safetensors.flax
from jax.sharding import NamedSharding, PartitionSpec as P
from safetensors.numpy import load_file

import deltanet_cp.interop._checkpoint as checkpoint_io
from deltanet_cp.models import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3NextForCausalLM

from . import _processes


DATA = pathlib.Path(__file__).parent / "data"
FIXTURES = {
    "qwen3_5_lm": Qwen3_5ForCausalLM,
    "qwen3_5_lm_tied": Qwen3_5ForCausalLM,
    "qwen3_next_moe": Qwen3NextForCausalLM,
    "qwen3_5_moe": Qwen3_5MoeForCausalLM,
}
MOE = ["qwen3_next_moe", "qwen3_5_moe"]
INDEX = "model.safetensors.index.json"


@ft.cache
def _model(name: str, dtype=None):
    return FIXTURES[name].from_pretrained(DATA / name, dtype=dtype)


def _tensors(folder: pathlib.Path, load=load_file) -> dict[str, np.ndarray]:
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update({n: np.asarray(x) for n, x in load(str(file)).items()})
    return out


def _assert_same_tensors(ours: dict[str, np.ndarray], theirs: dict[str, np.ndarray]) -> None:
    assert sorted(ours) == sorted(theirs)
    for name, x in theirs.items():
        y = ours[name]
        assert (y.dtype, y.shape) == (x.dtype, x.shape), name
        assert y.tobytes() == x.tobytes(), name


def _check_index(folder: pathlib.Path, max_bytes: int) -> None:
    """The index names every tensor's file, the files hold just those, each within
    `max_bytes` unless it holds one tensor."""
    index = json.loads((folder / INDEX).read_text())
    files = sorted(p.name for p in folder.glob("*.safetensors"))
    assert sorted(set(index["weight_map"].values())) == files
    total = 0
    for file in files:
        tensors = load_file(str(folder / file))
        assert sorted(tensors) == sorted(n for n, f in index["weight_map"].items() if f == file)
        size = sum(x.nbytes for x in tensors.values())
        assert size <= max_bytes or len(tensors) == 1
        total += size
    assert index["metadata"]["total_size"] == total


@pytest.mark.parametrize("name", list(FIXTURES))
@pytest.mark.parametrize("max_shard_size", ["5GB", 20_000])
def test_save_pretrained_writes_what_transformers_wrote(name, max_shard_size, tmp_path):
    model = _model(name)
    model.save_pretrained(tmp_path / "ckpt", max_shard_size=max_shard_size)
    folder = tmp_path / "ckpt"
    # (a) Every tensor of transformers' checkpoint, bit for bit, and nothing else.
    _assert_same_tensors(_tensors(folder), _tensors(DATA / name))
    if max_shard_size == "5GB":
        # One file as transformers writes a small model: no index.
        assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors"]
    else:
        assert len(list(folder.glob("*.safetensors"))) > 1
        _check_index(folder, max_shard_size)
    # config.json: every key we write says what transformers wrote.
    ours = json.loads((folder / "config.json").read_text())
    theirs = json.loads((DATA / name / "config.json").read_text())
    assert {k: theirs.get(k) for k in ours} == ours
    # (b) Read back bit-identically.
    again = FIXTURES[name].from_pretrained(folder)
    assert eqx.tree_equal(again, model)
    assert again.config == model.config


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, marks=() if n in ("qwen3_5_lm_tied", MOE[0]) else pytest.mark.slow)
        for n in FIXTURES
    ],
)
def test_save_pretrained_from_scanned_layers(name, tmp_path):
    # A model loaded into stacked layers (`scan_layers=True`) writes transformers' tensors
    # bit for bit, and reads back into the same stack.
    model = FIXTURES[name].from_pretrained(DATA / name, scan_layers=True)
    model.save_pretrained(tmp_path / "ckpt")
    _assert_same_tensors(_tensors(tmp_path / "ckpt"), _tensors(DATA / name))
    again = FIXTURES[name].from_pretrained(tmp_path / "ckpt", scan_layers=True)
    assert eqx.tree_equal(again, model)


def _other_layout(tensors: dict[str, np.ndarray], config: dict) -> dict[str, np.ndarray]:
    """The fixture's experts in the other layout: per-expert tensors fused (gate rows
    first), fused ones split per expert."""
    out = dict(tensors)
    inter = config["moe_intermediate_size"]
    for name in [n for n in tensors if n.endswith("mlp.experts.gate_up_proj")]:
        p = name[: -len("gate_up_proj")]
        gate_up, down = out.pop(name), out.pop(p + "down_proj")
        for j in range(gate_up.shape[0]):
            out[f"{p}{j}.gate_proj.weight"] = gate_up[j, :inter]
            out[f"{p}{j}.up_proj.weight"] = gate_up[j, inter:]
            out[f"{p}{j}.down_proj.weight"] = down[j]
    for name in [n for n in tensors if n.endswith("mlp.experts.0.gate_proj.weight")]:
        p = name[: -len("0.gate_proj.weight")]
        stack = {
            f: np.stack([out.pop(f"{p}{j}.{f}.weight") for j in range(config["num_experts"])])
            for f in ("gate_proj", "up_proj", "down_proj")
        }
        out[p + "gate_up_proj"] = np.concatenate([stack["gate_proj"], stack["up_proj"]], 1)
        out[p + "down_proj"] = stack["down_proj"]
    return out


@pytest.mark.parametrize("name", MOE)
def test_save_pretrained_expert_layouts(name, tmp_path):
    # (c) Qwen3-Next's fixture is per-expert, Qwen3.5 MoE's fused (each as transformers
    # wrote it); both models write both layouts, and read each back bit-identically.
    model = _model(name)
    fixture = _tensors(DATA / name)
    config = json.loads((DATA / name / "config.json").read_text())
    own = "per_expert" if name == "qwen3_next_moe" else "fused"
    other = "fused" if own == "per_expert" else "per_expert"
    for layout, expected in ((own, fixture), (other, _other_layout(fixture, config))):
        model.save_pretrained(tmp_path / layout, experts=layout)
        _assert_same_tensors(_tensors(tmp_path / layout), expected)
        assert eqx.tree_equal(FIXTURES[name].from_pretrained(tmp_path / layout), model)


@pytest.mark.parametrize("name", ["qwen3_5_lm", "qwen3_5_moe"])
def test_save_pretrained_bfloat16(name, tmp_path):
    # (d) `dtype=` casts each tensor (round to nearest even, as jnp's astype); a bfloat16
    # model writes bfloat16 as it is, and float32 of it exactly.
    model = _model(name)
    model.save_pretrained(tmp_path / "bf16", dtype=jnp.bfloat16)
    ours = _tensors(tmp_path / "bf16", safetensors.flax.load_file)
    fixture = _tensors(DATA / name)
    cast = {n: np.asarray(jnp.asarray(x).astype(jnp.bfloat16)) for n, x in fixture.items()}
    _assert_same_tensors(ours, cast)
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    half = _model(name, jnp.bfloat16)
    assert eqx.tree_equal(FIXTURES[name].from_pretrained(tmp_path / "bf16"), half)
    half.save_pretrained(tmp_path / "as_is")
    _assert_same_tensors(_tensors(tmp_path / "as_is", safetensors.flax.load_file), cast)
    half.save_pretrained(tmp_path / "f32", dtype=jnp.float32)
    widened = {n: x.astype(np.float32) for n, x in cast.items()}
    _assert_same_tensors(_tensors(tmp_path / "f32"), widened)
    assert ours[next(iter(ours))].dtype == ml_dtypes.bfloat16


def test_save_pretrained_is_atomic(tmp_path, monkeypatch):
    # (e) A writer failing after its first file leaves the old checkpoint as it was, and no
    # temporary folder; a later save replaces it, keeping the folder's other files.
    path = tmp_path / "ckpt"
    old = _model("qwen3_5_lm")
    old.save_pretrained(path, max_shard_size=20_000)
    (path / "tokenizer.json").write_text("{}")
    before = {p.name: p.read_bytes() for p in path.iterdir()}
    new = jax.tree.map(lambda x: x + 1 if eqx.is_inexact_array(x) else x, old)

    write = checkpoint_io.write_safetensors
    calls = []

    def failing(file, *args):
        calls.append(file)
        if len(calls) > 1:
            raise OSError("disk full (simulated)")
        write(file, *args)

    monkeypatch.setattr(checkpoint_io, "write_safetensors", failing)
    with pytest.raises(OSError, match="simulated"):
        new.save_pretrained(path, max_shard_size=20_000)
    assert len(calls) == 2
    assert {p.name: p.read_bytes() for p in path.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    assert eqx.tree_equal(Qwen3_5ForCausalLM.from_pretrained(path), old)

    monkeypatch.setattr(checkpoint_io, "write_safetensors", write)
    new.save_pretrained(path)
    assert sorted(p.name for p in path.iterdir()) == [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
    ]
    assert (path / "tokenizer.json").read_text() == "{}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    assert eqx.tree_equal(Qwen3_5ForCausalLM.from_pretrained(path), new)


@pytest.mark.parametrize("name", ["qwen3_5_lm", "qwen3_5_moe"])
def test_save_pretrained_from_sharded_parameters(name, tmp_path):
    # (f) Parameters sharded over 4 devices save the same bytes as on one device.
    model = _model(name)
    mesh = jax.make_mesh((4,), ("x",), devices=jax.devices()[:4])

    def put(x):
        if not eqx.is_array(x):
            return x
        axis = next((i for i, n in enumerate(x.shape) if n % 4 == 0), None)
        spec = [None] * x.ndim
        if axis is not None:
            spec[axis] = "x"
        return jax.device_put(x, NamedSharding(mesh, P(*spec)))

    sharded = jax.tree.map(put, model)
    leaves = [x for x in jax.tree.leaves(sharded) if eqx.is_array(x)]
    assert all(len(x.sharding.device_set) == 4 for x in leaves)
    assert any(not x.sharding.is_fully_replicated for x in leaves)
    model.save_pretrained(tmp_path / "one", max_shard_size=20_000)
    sharded.save_pretrained(tmp_path / "four", max_shard_size=20_000)
    files = sorted(p.name for p in (tmp_path / "one").iterdir())
    assert sorted(p.name for p in (tmp_path / "four").iterdir()) == files
    for file in files:
        assert (tmp_path / "one" / file).read_bytes() == (tmp_path / "four" / file).read_bytes()


def test_save_pretrained_errors_name_the_argument(tmp_path, without_runtime_typecheck):
    dense, moe = _model("qwen3_5_lm"), _model("qwen3_5_moe")
    with pytest.raises(ValueError, match="experts"):
        dense.save_pretrained(tmp_path / "a", experts="fused")
    with pytest.raises(ValueError, match="experts"):
        moe.save_pretrained(tmp_path / "a", experts="stacked")  # pyright: ignore[reportArgumentType]
    for bad in (0, -1, "5XB", "", True, 1.5):
        with pytest.raises(ValueError, match="max_shard_size"):
            moe.save_pretrained(tmp_path / "a", max_shard_size=bad)  # pyright: ignore[reportArgumentType]
    with pytest.raises(ValueError, match="dtype"):
        dense.save_pretrained(tmp_path / "a", dtype=jnp.int32)
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="is a file"):
        dense.save_pretrained(tmp_path / "file")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_safetensors_writer_header(tmp_path):
    # The format: an 8-byte little-endian header length (a multiple of 8), a JSON header
    # with `__metadata__` {"format": "pt"}, then the bytes; read by the safetensors package.
    tensors = {
        "b": np.arange(6, dtype=np.float32).reshape(2, 3),
        "a": np.array([1, 2, 3], np.int64),
        "empty": np.zeros((0, 4), np.float16),
        "h": np.array([1.5, -2.0], ml_dtypes.bfloat16),
    }
    file = tmp_path / "t.safetensors"
    checkpoint_io.write_safetensors(file, tensors)
    raw = file.read_bytes()
    size = int.from_bytes(raw[:8], "little")
    assert size % 8 == 0
    header = json.loads(raw[8 : 8 + size])
    assert header["__metadata__"] == {"format": "pt"}
    assert header["b"] == {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}
    assert header["h"]["dtype"] == "BF16"
    # The numpy reader refuses bfloat16, the flax one narrows int64 (no jax_enable_x64).
    back = load_file(str(file)) | {"h": safetensors.flax.load_file(str(file))["h"]}
    for name, x in tensors.items():
        y = np.asarray(back[name])
        assert (y.dtype, y.shape, y.tobytes()) == (x.dtype, x.shape, x.tobytes())
    with pytest.raises(ValueError, match="no dtype"):
        checkpoint_io.write_safetensors(file, {"c": np.zeros(2, np.complex64)})


def test_save_pretrained_from_two_processes(tmp_path):
    # Two processes (gloo on loopback, 2 CPU devices each) holding the parameters split over
    # all 4 devices: process 0 writes, after gathers, the same bytes as one device.
    fixture, out = DATA / "qwen3_5_moe", tmp_path / "two"
    _processes.run_workers("_save_worker", 2, str(fixture), str(out), devices=2)
    _model("qwen3_5_moe").save_pretrained(tmp_path / "one", max_shard_size=20_000)
    files = sorted(p.name for p in (tmp_path / "one").iterdir())
    assert sorted(p.name for p in out.iterdir()) == files
    for file in files:
        assert (tmp_path / "one" / file).read_bytes() == (out / file).read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one", "two"]


def test_save_pretrained_through_a_link(tmp_path):
    # A `path` that is a link to a folder: the checkpoint goes where it points, the link stays.
    model = _model("qwen3_5_lm")
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    model.save_pretrained(tmp_path / "link")
    model.save_pretrained(tmp_path / "link")
    assert (tmp_path / "link").is_symlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "real"]
    assert eqx.tree_equal(Qwen3_5ForCausalLM.from_pretrained(tmp_path / "link"), model)

"""m3jax.hf.shapes: a checkpoint's shapes alone (config.json and a tensor table), what a random model's vLLM engines
start from (dummy weights) instead of an export of the model. The table must list exactly what the export would
hold, in its order and dtypes: the engines check every push against it and the transfer buffers are sized from it."""

import json
import os

import jax.numpy as jnp
import pytest
from flax import nnx

import m3jax
from m3jax import tiny
from m3jax.config import M3Config
from m3jax.hf.safetensors_io import CheckpointError
from m3jax.hf.save import save_shapes
from m3jax.hf.shapes import TENSOR_TABLE, shapes_only, tensor_bytes, tensor_table
from rl.generation import local_ray, shared_segments

CFG = M3Config(vocab_size=32, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
               head_dim=16, intermediate_size=16, dense_intermediate_size=48, shared_intermediate_size=16,
               num_local_experts=4, num_experts_per_tok=2, layer_types=("full_attention", "minimax_m3_sparse"),
               mlp_layer_types=("dense", "sparse"), index_n_heads=1, index_head_dim=16, index_block_size=4,
               index_topk_blocks=1)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_shapes_list_what_the_export_holds(tmp_path, dtype):
    model = nnx.eval_shape(lambda: tiny.m3_model(CFG, seed=0, dtype=dtype))  # shapes alone: nothing is drawn
    shapes = save_shapes(model, tmp_path / "shapes")
    assert sorted(os.listdir(shapes)) == ["config.json", TENSOR_TABLE] and shapes_only(shapes)
    export = m3jax.save_pretrained(tiny.m3_model(CFG, seed=0, dtype=dtype), tmp_path / "export", layout="released")
    assert not shapes_only(export)
    want = tensor_table(export)
    assert list(tensor_table(shapes).items()) == list(want.items())  # names, order, shapes, dtypes
    assert {d for _, d in want.values()} == {jnp.dtype(dtype)} | ({jnp.dtype(jnp.float32)} if dtype != jnp.float32
                                                                  else set())  # the fp32 router stays fp32
    with open(os.path.join(shapes, "config.json")) as a, open(os.path.join(export, "config.json")) as b:
        assert json.load(a) == json.load(b)
    # what sizes the transfer buffers and the local Ray's object store: the tensors' bytes, either way
    assert tensor_bytes(shapes) == tensor_bytes(export) == shared_segments.checkpoint_tensor_bytes(shapes)
    assert local_ray.checkpoint_bytes(shapes) == sum(tensor_bytes(export))


def test_a_run_directory_swaps_shapes_and_exports_in_place(tmp_path):
    """A resumed run writes its engines' directory again, over the export an older version left there or over the
    shapes of the last start; both are checkpoint directories that may be replaced whole."""
    model = tiny.m3_model(CFG, seed=0)
    path = tmp_path / "vllm-initial"
    m3jax.save_pretrained(model, path, layout="released")
    save_shapes(model, path)
    assert shapes_only(path)
    m3jax.save_pretrained(model, path, layout="released")
    assert not shapes_only(path) and not os.path.exists(path / TENSOR_TABLE)
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="is not a checkpoint directory"):
        save_shapes(model, tmp_path / "notes")
    assert (tmp_path / "notes" / "todo.txt").read_text() == "mine"


def test_a_directory_without_tensors_is_one_clear_error(tmp_path):
    with pytest.raises(CheckpointError, match=f"no .safetensors files and no {TENSOR_TABLE}"):
        tensor_table(str(tmp_path))
    assert not shapes_only(tmp_path) and not shapes_only(tmp_path / "nowhere")  # a pool's engines name what is missing
    (tmp_path / TENSOR_TABLE).write_text(json.dumps({"format": "m3jax-tensors/1", "tensors": [["a", "F99", [2]]]}))
    with pytest.raises(CheckpointError, match=f"{TENSOR_TABLE}: not a tensor table .*F99"):
        tensor_table(str(tmp_path))
    (tmp_path / TENSOR_TABLE).write_text(json.dumps({"format": "m3jax-tensors/9", "tensors": []}))
    with pytest.raises(CheckpointError, match="format 'm3jax-tensors/9', expected 'm3jax-tensors/1'"):
        tensor_table(str(tmp_path))
    (tmp_path / TENSOR_TABLE).write_text("[1, 2")
    with pytest.raises(CheckpointError, match="not a tensor table"):
        tensor_table(str(tmp_path))

"""Where llama.cpp puts a split model's layers, and the KV share that lands on main_gpu."""
from __future__ import annotations

import llama_cpp

from pflash_plugin.llama.model import ModelParams
from pflash_plugin.llama.placement import kv_share_on_main_gpu, layer_devices, splits_by_free_memory


def test_layers_split_in_proportion_with_the_output_layer_counted():
    # 32 layers + output on two equal GPUs: 33 layers cut at 16.5, so layers 0-16 on GPU 0
    devices = layer_devices(32, -1, [1.0, 1.0])
    assert devices == [0] * 17 + [1] * 15
    # 3:1 over 8 + 1 layers: GPU 1 from 9 x 0.75 = 6.75 on, so layer 7 and the output layer
    assert layer_devices(8, -1, [3.0, 1.0]) == [0] * 7 + [1]


def test_layers_not_offloaded_stay_on_the_cpu():
    # 10 of 32 + 1 layers offloaded: the last 10 layers of the 33 (the output layer is one of them)
    devices = layer_devices(32, 10, [1.0, 1.0])
    assert devices[:23] == [None] * 23
    assert devices[23:] == [0] * 5 + [1] * 4
    assert layer_devices(4, 0, [1.0, 1.0]) == [None] * 4


def layer_split(**kw) -> ModelParams:
    return ModelParams(**{"n_gpu_layers": -1, "split_mode": llama_cpp.LLAMA_SPLIT_MODE_LAYER, **kw})


def test_kv_share_follows_tensor_split_or_free_memory():
    assert kv_share_on_main_gpu(layer_split(), 32, 2, [80, 80]) == 17 / 32
    assert kv_share_on_main_gpu(layer_split(main_gpu=1), 32, 2, [80, 80]) == 15 / 32
    # tensor_split wins over free memory (not read then); entries past the GPUs llama.cpp sees are ignored
    assert kv_share_on_main_gpu(layer_split(tensor_split=(1.0, 3.0, 5.0)), 32, 2, []) == 9 / 32
    # all-zero tensor_split means "by free memory", as in llama.cpp
    assert kv_share_on_main_gpu(layer_split(tensor_split=(0.0, 0.0)), 32, 2, [30, 10]) == 25 / 32


def test_free_memory_is_read_only_where_llama_cpp_splits_by_it():
    assert splits_by_free_memory(layer_split(), 2)
    assert splits_by_free_memory(layer_split(tensor_split=(0.0, 0.0)), 2)
    assert not splits_by_free_memory(layer_split(tensor_split=(1.0, 1.0)), 2)
    assert not splits_by_free_memory(layer_split(), 1)
    assert not splits_by_free_memory(layer_split(split_mode=llama_cpp.LLAMA_SPLIT_MODE_NONE), 2)


def test_one_gpu_or_no_split_by_layers_keeps_all_kv_on_main_gpu():
    assert kv_share_on_main_gpu(layer_split(), 32, 1, []) == 1.0
    assert kv_share_on_main_gpu(layer_split(), 32, 0, []) == 1.0
    row = layer_split(split_mode=llama_cpp.LLAMA_SPLIT_MODE_ROW)
    none = layer_split(split_mode=llama_cpp.LLAMA_SPLIT_MODE_NONE, main_gpu=1)
    assert kv_share_on_main_gpu(row, 32, 2, []) == kv_share_on_main_gpu(none, 32, 2, []) == 1.0
